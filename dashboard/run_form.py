"""The sidebar's run form: base, adapters, targets, checks, tolerances; validated field by field.

Every check that needs no model load runs on each rerun, so a wrong path or an adapter made for
another base is explained under its own field before anything is submitted.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import streamlit as st

from core.checks import CHECKS
from core.demo.workspace import (
    DEMO_ADAPTERS,
    DEMO_BASE,
    DEMO_TARGETS,
    find_adapters,
    recent_adapters,
    recent_bases,
)
from core.judgement import ANOMALY_RATIO
from core.models.loading import STRATEGIES
from core.models.targets import Device, check_targets_exist
from core.models.validate import (
    InputError,
    validate_adapter,
    validate_merge_subset,
    validate_model,
    validate_tolerance,
)
from core.spec import (
    DEFAULT_CHECKS,
    DEFAULT_MAX_NEW_TOKENS,
    FOUR_BIT_FORMATS,
    MAX_THREADS,
    QUANTIZED_FORMATS,
    REFERENCE_TARGET,
    AdapterRef,
    ModelRef,
    ProbeInputs,
    ProbeSpec,
    SpecError,
    Target,
    ToleranceOverride,
    prompts_from_text,
)
from dashboard.pages import result_page
from dashboard.state import engine, ray_runner, start_run, store
from dashboard.text import literal

# float dtypes, then the bitsandbytes formats of a quantized base (QUANTIZED_FORMATS)
DTYPES = ("float32", "bfloat16", "float16", *QUANTIZED_FORMATS)
# "modules_to_save": the tensors of a module an adapter saves whole (a classifier head)
ROLES = ("*", "base", "lora_A", "lora_B", "delta", "modules_to_save", "output")


@dataclass
class FormErrors:
    """What is wrong, per field; empty when the form can be submitted."""

    base: list[str] = field(default_factory=list)
    adapters: list[str] = field(default_factory=list)
    targets: list[str] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)
    merge_subset: list[str] = field(default_factory=list)
    tolerance: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return any((self.base, self.adapters, self.targets, self.checks, self.merge_subset, self.tolerance))


def validate_form(
    base: str | None,
    adapters: list[str],
    targets: list[str],
    checks: list[str],
    devices: list[Device],
    tolerance: ToleranceOverride | None = None,
    reference: str | None = None,
    merge_subset: list[str] | None = None,
    role: str = "*",
) -> FormErrors:
    """Field-by-field validation of the run form (no model load): the messages the form shows."""
    errors = FormErrors()
    shapes = None
    if not base:
        errors.base.append("Choose a base model folder or type a path or hub id.")
    else:
        try:
            shapes = validate_model(ModelRef(path=base))
        except InputError as e:
            errors.base.append(str(e))
    refs: list[AdapterRef] = []
    for text in adapters:
        try:
            refs.append(AdapterRef.parse(text))
        except SpecError as e:
            errors.adapters.append(str(e))
    names = [a.name for a in refs]
    for dup in sorted({n for n in names if names.count(n) > 1}):
        errors.adapters.append(f"Adapter name {dup!r} is used twice: type one as PATH=OTHER_NAME.")
    if base and not errors.base:
        for ref in refs:
            try:
                validate_adapter(ref, shapes, base)
            except InputError as e:
                errors.adapters.append(str(e))
    parsed: list[Target] = []
    if not targets:
        errors.targets.append("Choose at least one target, e.g. cpu/float32.")
    for text in targets:
        try:
            parsed.append(Target.parse(text))
        except SpecError as e:
            errors.targets.append(str(e))
    if len(set(parsed)) != len(parsed):
        errors.targets.append("A target is listed twice.")
    try:
        check_targets_exist(parsed, devices)
    except SpecError as e:
        errors.targets.append(str(e))
    if not checks:
        errors.checks.append("Choose at least one check (under “Checks, tolerances and seed”).")
    try:
        validate_merge_subset(merge_subset or [], names, checks)
    except InputError as e:
        errors.merge_subset.append(str(e))
    if reference is not None:
        try:
            check_targets_exist([Target.parse(reference)], devices)
        except SpecError as e:
            errors.tolerance.append(f"Reference: {e}")
    if tolerance is not None:
        try:
            validate_tolerance(role, tolerance)
        except InputError as e:
            errors.tolerance.append(str(e))
    return errors


def target_options(devices: list[Device]) -> list[str]:
    """Targets offered for the devices this machine has: each dtype, plus the usual flag variants."""
    options = []
    for d in devices:
        for dtype in DTYPES:
            options.append(f"{d.name}/{dtype}")
        if d.kind == "cuda":
            options += [f"{d.name}/float32+tf32", f"{d.name}/float32+deterministic"]
        if d.kind == "cpu":
            options += ["cpu/float32+threads=1", "cpu/float32+deterministic", "cpu/nf4+portable"]
    return options


def _show(errors: list[str]) -> None:
    for message in errors:
        st.error(literal(message), icon=":material/error:")


def _demo_paths(manifest: dict | None) -> dict[str, str]:
    return {} if not manifest else {path: f"demo · {name}" for name, path in manifest["models"].items()}


def run_form(manifest: dict | None) -> None:
    """Draw the form in the sidebar; on Run, submit the spec to the engine and select the new run."""
    runner, devices, runner_ok, task_timeout = _runner_choice()
    demo_paths = _demo_paths(manifest)
    records = store().list_runs()  # read once: both "recent" lists come from it
    bases = list(demo_paths) + [b for b in recent_bases(records) if b not in demo_paths]
    default_base = manifest["models"][DEMO_BASE] if manifest else (bases[0] if bases else None)
    st.session_state.setdefault("form.base_choice", default_base)

    def base_changed() -> None:
        st.session_state.pop("form.adapters", None)  # the old base's adapters do not apply

    chosen = st.selectbox(
        "Base model",
        bases,
        key="form.base_choice",
        format_func=lambda p: demo_paths.get(p, p),
        on_change=base_changed,
        help="The demo's models and the bases of earlier runs.",
    )
    typed = st.text_input(
        "…or a model folder / hub id",
        key="form.base",
        on_change=base_changed,
        placeholder="/path/to/model or org/name",
        help="A local folder with config.json and *.safetensors, or a hub id (needs the hub or its cache).",
    )
    base = typed.strip() or chosen
    base_errors_at = st.container()

    choices = find_adapters(base, extra_roots=[]) if base else []
    recent = recent_adapters(records, base) if base else []
    # Adapters that fit come first; the others stay choosable, and the form says why they fail.
    labels = {c.path: c.name if c.name == c.type else f"{c.name} ({c.type})" for c in choices if c.fits}
    labels |= {a.path: a.name for a in recent if a.path not in labels}
    labels |= {c.path: f"{c.name} — not for this base" for c in choices if not c.fits}
    demo_base = manifest is not None and base == manifest["models"].get(DEMO_BASE)
    if "form.adapters" not in st.session_state:
        st.session_state["form.adapters"] = [
            c.path for c in choices if c.fits and (not demo_base or c.name in DEMO_ADAPTERS)
        ]
    for extra in st.session_state["form.adapters"]:
        labels.setdefault(extra, extra)  # typed paths stay selectable
    adapters = st.multiselect(
        "Adapters",
        list(labels),
        key="form.adapters",
        accept_new_options=True,
        format_func=lambda p: labels.get(p, p),
        placeholder="adapter folders (type PATH or PATH=NAME)",
        help="Adapters found next to the base that fit it; type a folder to add another (PATH=NAME renames).",
    )
    adapter_errors_at = st.container()

    options = target_options(devices)
    st.session_state.setdefault("form.targets", [t for t in DEMO_TARGETS if t in options])
    for extra in st.session_state["form.targets"]:
        if extra not in options:
            options.append(extra)
    targets = st.multiselect(
        "Targets",
        options,
        key="form.targets",
        accept_new_options=True,
        placeholder="DEVICE/DTYPE[+FLAG…]",
        help=(
            "Where to load: only devices this machine has. Flags: +tf32 (CUDA), +deterministic, "
            "+threads=N, +matmul=high; for nf4/fp4 +compute=DTYPE, +double_quant and on the CPU +portable "
            "(bitsandbytes' fused AVX512-BF16 kernel off); with the Ray runner +node=NAME (that node's "
            "device). cpu/float64 is the reference and always runs."
        ),
    )
    _target_builder(devices)
    target_errors_at = st.container()

    with st.expander("Checks, tolerances and seed"):
        checks = st.multiselect(
            "Checks",
            list(CHECKS),
            # On the demo every check (each takes seconds there), so one Run fills every page; on a
            # user's model the quick ones, the others a choice here.
            default=list(CHECKS) if demo_base else list(DEFAULT_CHECKS),
            key="form.checks",
            help="\n".join(f"- **{name}**: {c.description}" for name, c in CHECKS.items()),
        )
        strategies = ["isolated"]
        if "adapters" in checks:
            strategies = st.multiselect(
                "Load strategies",
                list(STRATEGIES),
                default=["isolated", "from_pretrained_loop"],
                key="form.strategies",
                help="How the adapters check loads the adapters (in the order listed above), each strategy "
                "in its own worker; `isolated` (a fresh base per adapter) always runs as the ground truth.",
            )
        merge_subset: list[str] = []
        if "merge" in checks:
            names = []
            for text in adapters:
                with contextlib.suppress(SpecError):  # reported under the Adapters field
                    names.append(AdapterRef.parse(text).name)
            merge_subset = st.multiselect(
                "Merge together (adapter_names=)",
                names,
                key="form.merge_subset",
                help="Adapters the merge check also merges into one model, one after another and all at "
                "once. Empty: the run's first two plain LoRA adapters that save no module whole (modules_to_save).",
            )
        merge_errors_at = st.container()
        role = st.selectbox(
            "Tolerance applies to",
            ROLES,
            key="form.role",
            format_func=lambda r: "every row" if r == "*" else r,
        )
        rtol = st.number_input(
            "rtol", value=None, min_value=0.0, format="%g", key="form.rtol", placeholder="per-dtype default"
        )
        atol = st.number_input(
            "atol", value=None, min_value=0.0, format="%g", key="form.atol", placeholder="per-dtype default"
        )
        seed = st.number_input("Probe seed", value=0, min_value=0, step=1, key="form.seed")
        prompt_text = st.text_area(
            "Prompts (one a line)",
            value="",
            key="form.prompts",
            help="Probe with real text through the checkpoint's own tokenizer (no remote code), one probe row "
            "per line; empty: token ids drawn from the seed. The generate check decodes from each.",
        )
        max_new_tokens = st.number_input(
            "Tokens to generate", value=DEFAULT_MAX_NEW_TOKENS, min_value=1, step=1, key="form.max_new_tokens"
        )
        reference = st.text_input(
            "Reference for outputs",
            value=str(REFERENCE_TARGET),
            key="form.reference",
            help="The target every output is compared against, DEVICE/DTYPE[+FLAG…]: cpu/float64 (exact) by "
            "default; a model too large for float64 runs it one block at a time.",
        )
        keep_tensors = st.checkbox(
            "Keep every compared tensor",
            value=False,
            key="form.keep_tensors",
            help="For the element-wise drill-down of a large model. By default a base over 256 MiB keeps "
            "each tensor's metric row and a bounded sketch (block-max map, histogram, worst elements), "
            "not a second copy of the model.",
        )
        peers = st.checkbox(
            "Judge each target against its peer",
            value=True,
            key="form.peers",
            help="Its peer is the CPU target of its dtype without flags (cuda:1/bfloat16+tf32 → cpu/bfloat16), "
            f"added to the run when missing: a row whose error is over {ANOMALY_RATIO:g}× its peer's on the same tensor is an "
            "anomaly; the rest is what the dtype's rounding gives. Off (--no-peers): no peer, no judgement.",
        )
        tolerance_errors_at = st.container()
    check_errors_at = st.container()  # outside the expander, so a missing check is seen when folded
    override = ToleranceOverride(rtol=rtol, atol=atol) if (rtol is not None or atol is not None) else None

    errors = validate_form(base, adapters, targets, checks, devices, override, reference, merge_subset, role)
    for where, messages in (
        (base_errors_at, errors.base),
        (adapter_errors_at, errors.adapters),
        (target_errors_at, errors.targets),
        (check_errors_at, errors.checks),
        (merge_errors_at, errors.merge_subset),
        (tolerance_errors_at, errors.tolerance),
    ):
        with where:
            _show(messages)

    if st.button("Run", type="primary", icon=":material/play_arrow:", key="form.run", width="stretch"):
        if errors or not runner_ok:
            st.error("Fix the fields marked above first.")
            return
        spec = ProbeSpec(
            base=ModelRef(path=base),
            adapters=tuple(AdapterRef.parse(a) for a in adapters),
            targets=tuple(Target.parse(t) for t in targets),
            checks=tuple(checks),
            tolerances={role: override} if override else {},
            seed=int(seed),
            strategies=tuple(dict.fromkeys(["isolated", *strategies])),
            merge_subset=tuple(merge_subset),
            keep_tensors=bool(keep_tensors),
            reference=Target.parse(reference),
            peers=bool(peers),
            probe=ProbeInputs(prompts=prompts_from_text(prompt_text)),
            max_new_tokens=int(max_new_tokens),
            task_timeout_s=task_timeout,
        )
        start_run(spec, result_page(spec.checks), runner)


RUNNER_LABELS = {"process": "Worker processes here", "ray": "Ray (this or other machines)"}


def _runner_choice() -> tuple:
    """Where the run's tasks go (None: the engine's worker processes), the devices targets may name
    there, whether that choice can run, and each task's time limit (None: the engine's default):
    worker processes on this machine (default), or Ray tasks on a Ray cluster (core.engine.ray_runner;
    a local Ray when no address is given)."""
    with st.expander("Runner"):
        timeout = st.number_input(
            "Task time limit (s)",
            value=None,
            min_value=1.0,
            step=60.0,
            key="form.task_timeout",
            placeholder="from the model's size and the checks",
            help="A task still running after this many seconds is killed: its rows read broken "
            "(timed out after N s in stage S), and the other tasks go on.",
        )
        choice = st.radio(
            "Run the tasks on",
            list(RUNNER_LABELS),
            key="form.runner",
            format_func=RUNNER_LABELS.get,
            help="Ray sends each target's capture to a fresh Ray worker process, pinned to a GPU "
            "(cuda:N) or to a node (+node=NAME in the target), and brings the capture back here.",
        )
        if choice != "ray":
            return None, engine().devices, True, timeout
        address = st.text_input(
            "Ray address",
            key="form.ray_address",
            placeholder="empty: a local Ray; auto, HOST:PORT or ray://HOST:10001",
        )
        try:
            runner = ray_runner(address.strip())
            return runner, runner.devices(), True, timeout
        except SpecError as e:  # not installed, or the cluster cannot be reached: nothing runs
            st.error(literal(e), icon=":material/error:")
            return None, engine().devices, False, timeout


def _target_builder(devices: list[Device]) -> None:
    """Compose a target from device, dtype and flags, and add it to the Targets field."""
    with st.expander("Add a target with flags"):
        names = [d.name for d in devices]
        device = st.selectbox("Device", names, key="form.new.device")
        dtype = st.selectbox("Dtype", DTYPES, key="form.new.dtype")
        is_cuda = device.startswith("cuda")
        tf32 = st.toggle(
            "TF32 (matmul and cuDNN)",
            key="form.new.tf32",
            disabled=not is_cuda,
            help="CUDA only: lets float32 matmuls run in TF32.",
        )
        det = st.toggle("Deterministic algorithms", key="form.new.det")
        threads = st.number_input(
            "CPU threads",
            value=None,
            min_value=1,
            max_value=MAX_THREADS,
            step=1,
            key="form.new.threads",
            placeholder="torch default",
        )
        can_be_portable = device == "cpu" and dtype in FOUR_BIT_FORMATS
        portable = st.toggle(
            "Portable 4-bit CPU path",
            key="form.new.portable",
            disabled=not can_be_portable,
            help="CPU nf4/fp4 only: bitsandbytes' fused kernel off (its default on a CPU with AVX512-BF16), "
            "the path other CPUs run.",
        )
        flags = (["tf32"] if tf32 and is_cuda else []) + (["deterministic"] if det else [])
        flags += [f"threads={int(threads)}"] if threads else []
        flags += ["portable"] if portable and can_be_portable else []
        spec = "+".join([f"{device}/{dtype}", *flags])

        def add() -> None:
            current = list(st.session_state.get("form.targets", []))
            if spec not in current:
                st.session_state["form.targets"] = [*current, spec]

        st.button(f"Add {literal(spec)}", on_click=add, key="form.new.add", width="stretch")
