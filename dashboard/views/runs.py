"""Runs: history with status, duration and targets; open, compare two runs' environments, delete."""

from __future__ import annotations

import time
from pathlib import Path

import pandas as pd
import streamlit as st

from core.engine.snapshot import SUFFIX, read_snapshot
from core.engine.store import StoreError
from core.spec import SpecError
from dashboard.figures.common import environment_table, highlight_differences
from dashboard.pages import OVERVIEW, page
from dashboard.state import set_view, start_comparison, store
from dashboard.text import literal, trusted
from dashboard.ui import csv_download

# Snapshots made on real GPUs that ship with a checkout (none in an installed package)
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

st.title(trusted(page("runs").title))

with st.expander("Compare snapshots from other machines", icon=":material/upload_file:"):
    st.caption(
        "A snapshot (`python -m core snapshot … -o FILE`) holds one machine's captures. Comparing snapshots "
        "makes a run whose targets are named by machine, e.g. gpu-box/cuda:0·fp32: it opens on every page "
        "like any run, with the environments side by side and every pair of targets compared."
    )
    uploads = st.file_uploader(
        "Snapshot files", type=["wdsnap", "zip"], accept_multiple_files=True, key="runs.snapshots"
    )
    typed = st.text_area(
        "…or paths on this machine, one per line",
        key="runs.snapshot_paths",
        placeholder="/data/gpu-box.wdsnap",
    )
    if st.button("Compare snapshots", icon=":material/compare_arrows:", key="runs.compare"):
        paths = [Path(line.strip()).expanduser() for line in typed.splitlines() if line.strip()]
        files = [(upload.name, upload.getvalue()) for upload in uploads or []]
        if paths or files:
            start_comparison(paths, files)
        else:
            st.warning("Choose snapshot files or type their paths first.")

examples = sorted(EXAMPLES.glob(f"*{SUFFIX}"))
if examples:
    with st.expander("Examples made on a real GPU", icon=":material/memory:"):
        st.caption(
            "Snapshots made on a lent NVIDIA H200 (docs/gpu-validation.md and examples/README.md say how "
            "and when). Opening one compares its captures here, as a new run: a real GPU's results on "
            "any machine, no GPU needed."
        )
        for path in examples:
            try:
                shot = read_snapshot(path)
            except SpecError as e:  # a damaged copy in the checkout: say so, open the others
                st.error(literal(e), icon=":material/error:")
                continue
            what = f"{', '.join(shot.spec.checks)} on {', '.join(str(t) for t in shot.spec.targets)}"
            made = time.strftime("%Y-%m-%d", time.gmtime(shot.created))
            st.write(f"**{literal(path.stem)}** — {literal(shot.machine)}, {literal(made)}: {literal(what)}")
            if st.button(
                f"Open {literal(path.stem)}", icon=":material/open_in_new:", key=f"runs.example.{path.stem}"
            ):
                start_comparison([path])

records = store().list_runs()
if not records:
    st.info(
        f"No runs in {literal(store().runs_dir)} yet. The sidebar's **Run** button starts one on the demo "
        "workspace."
    )
    st.stop()


def history(records) -> pd.DataFrame:
    """One row per stored run."""
    out = []
    for r in records:
        spec = r.spec
        out.append(
            {
                "run": r.run_id,
                "status": r.status,
                "created": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.info.get("created") or 0)),
                "duration_s": r.info.get("duration_s"),
                "targets": ", ".join(str(t) for t in spec.targets) if spec else "?",
                "adapters": ", ".join(a.name for a in spec.adapters) if spec else "?",
                "checks": ", ".join(spec.checks) if spec else "?",
                "base": spec.base.path if spec else "?",
                "error": (r.error or "").splitlines()[0] if r.error else "",
                "note": r.id_note or "",
            }
        )
    return pd.DataFrame(out)


table = history(records)
st.caption(
    f"{len(records)} run(s) in {literal(store().runs_dir)}; newest {literal(records[0].run_id)} "
    f"({literal(records[0].status)}). "
    "Select a row to open or delete it. Runs made with the CLI in the same home appear here too."
)
event = st.dataframe(
    table,
    hide_index=True,
    on_select="rerun",
    selection_mode="single-row",
    key="runs.table",
    column_config={"duration_s": st.column_config.NumberColumn("duration (s)", format="%.1f")},
)
csv_download(table, "weightdrift-runs", key="runs.csv")
selected = event.selection.rows if event is not None else []
if selected:
    run_id = table.iloc[selected[0]]["run"]
    c1, c2 = st.columns(2)
    if c1.button(f"Open {literal(run_id)}", type="primary", icon=":material/open_in_new:", key="runs.open"):
        set_view("run", run_id)
        for name in ("target", "tensor", "adapter", "check"):
            set_view(name, None)
        st.switch_page(OVERVIEW.script, query_params={"run": run_id})
    with c2.popover("Delete…", icon=":material/delete:"):
        # Any process's run (this server's, a CLI's): its owner holds the run's lock.
        if store().in_use(run_id):
            st.warning("This run is still going (here or in another process); cancel it first.")
        else:
            st.write(f"Delete run {literal(run_id)} and everything in its folder? This cannot be undone.")
            if st.button(f"Yes, delete {literal(run_id)}", type="primary", key="runs.delete"):
                try:
                    store().delete(run_id)
                except (StoreError, KeyError) as e:  # taken up meanwhile, already gone, or not removable
                    st.error(literal(e), icon=":material/error:")
                else:
                    set_view("run", None)
                    st.toast(f"Deleted {literal(run_id)}")
                    st.rerun()

ids = [r.run_id for r in records]
if len(ids) < 2:
    st.stop()  # nothing to compare yet
st.subheader("Compare two runs' environments")
pair = st.multiselect("Two runs", ids, default=ids[:2], max_selections=2, key="runs.pair")
if len(pair) == 2:
    envs = {}
    for run_id in pair:
        for target, env in store().open(run_id).environments().items():
            envs[f"{run_id} · {target}"] = env
    if not envs:
        st.info("Neither run has captured environments (they failed before capturing).")
    else:
        env = environment_table(envs)
        st.caption(f"{int(env['differs'].sum())} setting(s) differ (highlighted).")
        st.dataframe(highlight_differences(env), key="runs.env")
        csv_download(env.reset_index(), f"environment-{pair[0]}-vs-{pair[1]}", key="runs.env.csv")
