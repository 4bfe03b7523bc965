"""Demo scenarios: named runs on the demo workspace that reproduce one problem in one click.

Each scenario builds a ProbeSpec from the demo manifest (`core.demo.build`) and this machine's devices.
The dashboard offers a page's scenarios as buttons (`dashboard.ui.scenario_buttons`); the CLI runs
one with `python -m core run --scenario NAME`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from core.demo.build import TIE_PROMPT
from core.models.targets import Device
from core.spec import AdapterRef, ModelRef, ProbeInputs, ProbeSpec, SpecError, Target


@dataclass(frozen=True)
class Scenario:
    """One reproducible problem on the demo workspace."""

    name: str  # slug for the CLI (--scenario) and tests, e.g. "bf16-merge-residual"
    title: str  # button text
    page: str  # url_path of the page that offers it: "merge", "memory", "adapters", "drift"
    description: str  # what it shows, in a sentence or two
    build: Callable[[dict, list[Device]], ProbeSpec]  # (demo manifest, devices) -> spec


SCENARIOS: dict[str, Scenario] = {}


def register(scenario: Scenario) -> Scenario:
    """Add a scenario to the registry (names are unique)."""
    if scenario.name in SCENARIOS:
        raise ValueError(f"scenario {scenario.name!r} is registered twice")
    SCENARIOS[scenario.name] = scenario
    return scenario


def scenarios_for(page: str) -> list[Scenario]:
    """The scenarios a page offers, in registration order."""
    return [s for s in SCENARIOS.values() if s.page == page]


def scenario_spec(name: str, manifest: dict, devices: list[Device]) -> ProbeSpec:
    """The spec of scenario `name` on this demo workspace and machine; SpecError for an unknown name."""
    scenario = SCENARIOS.get(name)
    if scenario is None:
        raise SpecError(f"unknown scenario {name!r}; available: {', '.join(SCENARIOS)}")
    return scenario.build(manifest, devices)


def demo_spec(
    manifest: dict,
    adapters: tuple[str, ...] | list[str],
    targets: tuple[str, ...] | list[str],
    checks: tuple[str, ...] | list[str],
    base: str = "tiny-llama",
    **fields,
) -> ProbeSpec:
    """A spec on the demo workspace: demo adapter names in order (each loaded under its own name)."""
    missing = [a for a in adapters if a not in manifest["adapters"]]
    if missing:
        raise SpecError(
            f"the demo workspace has no adapter {', '.join(missing)}; rebuild it (python -m core demo)"
        )
    return ProbeSpec(
        base=ModelRef(path=manifest["models"][base]),
        adapters=tuple(AdapterRef(path=manifest["adapters"][a]["path"], name=a) for a in adapters),
        targets=tuple(Target.parse(t) for t in targets),
        checks=tuple(checks),
        **fields,
    )


def last_cuda(devices: list[Device]) -> str | None:
    """`cuda:N` for the highest N this machine has, or None without CUDA."""
    cuda = [d.name for d in devices if d.name.startswith("cuda:")]
    return max(cuda, key=lambda n: int(n.split(":")[1])) if cuda else None


# --- issue 4: merge residuals ---------------------------------------------------------------------

register(
    Scenario(
        name="bf16-merge-residual",
        title="bfloat16 merge residual",
        page="merge",
        description="LoRA merged on cpu/bfloat16 against cpu/float32 by PEFT's default path (merge_adapter, "
        "merge_and_unload) and by safe_merge: merged weights against W + ΔW in float64 (in ulps) and merged "
        "against unmerged outputs; bfloat16 leaves the larger residual, and safe_merge, which rounds ΔW to "
        "bfloat16 before adding it, a larger one than the default path.",
        build=lambda m, d: demo_spec(m, ["lora"], ["cpu/float32", "cpu/bfloat16"], ["merge"]),
    )
)
register(
    Scenario(
        name="qlora-served-elsewhere",
        title="QLoRA served on bfloat16 and float32",
        page="merge",
        description="The demo LoRA as if trained on the NF4 base (QLoRA), served on cpu/bfloat16 and "
        "cpu/float32: how far its outputs move from what the 4-bit model gives, and what merge_and_unload() "
        "into the 4-bit base does (dequantize, add ΔW, quantize again) beside the float bases.",
        build=lambda m, d: demo_spec(
            m, ["lora"], ["cpu/nf4", "cpu/bfloat16", "cpu/float32"], ["outputs", "merge"]
        ),
    )
)
register(
    Scenario(
        name="qlora-merge-repacked",
        title="QLoRA merge after a forward on the CPU",
        page="merge",
        description="The demo LoRA merged into its NF4 base on the CPU by bitsandbytes' default path (cpu/nf4) "
        "and its portable one (cpu/nf4+portable). On a CPU with AVX512-BF16 the default repacks each 4-bit "
        "weight at the first forward for a fused kernel, and PEFT's merge after that forward reads the "
        "repacked layout as the plain one: the merge check says so, and merge_and_unload() moves the outputs "
        "more than twice as far as on +portable, where the move is the merge's own. On a CPU without "
        "AVX512-BF16 both run the portable path, and the run's notes say the CPU lacks it.",
        build=lambda m, d: demo_spec(m, ["lora"], ["cpu/nf4", "cpu/nf4+portable"], ["merge"]),
    )
)
register(
    Scenario(
        name="boft-merge-cpu",
        title="BOFT merge on CPU vs float64",
        page="merge",
        description="BOFT's rotation and scale merged on cpu/float32, against the float64 formula and "
        "the float64 model's outputs, with PEFT's own 1e-2 rotation tolerance beside the dtype default.",
        build=lambda m, d: demo_spec(m, ["boft"], ["cpu/float32"], ["merge"]),
    )
)
register(
    Scenario(
        name="tied-merge-save",
        title="merge with tied embeddings then save",
        page="merge",
        description="Merge a LoRA into the tied-embedding model and save it: which save paths work "
        "(save_pretrained against safetensors save_file), shared tensors named, reload compared.",
        build=lambda m, d: demo_spec(m, ["lora", "lora_embed"], ["cpu/float32"], ["merge"]),
    )
)
register(
    Scenario(
        name="tied-lm-head",
        title="LoRA on lm_head of a tied-embedding model",
        page="merge",
        description="LoRA on q_proj + lm_head, where lm_head is tied to embed_tokens: merging writes ΔW "
        "into the shared storage and changes the embeddings too; the check names the tied pair.",
        build=lambda m, d: demo_spec(m, ["lora_lm_head"], ["cpu/float32"], ["merge"]),
    )
)
register(
    Scenario(
        name="nan-safe-merge",
        title="NaN in an adapter with safe_merge",
        page="merge",
        description="A LoRA with one NaN in a lora_B tensor: safe_merge refuses that module, PEFT's default "
        "merge writes the NaN into W; both reported as broken with the module named instead of a crash.",
        build=lambda m, d: demo_spec(m, ["lora_nan"], ["cpu/float32"], ["merge"]),
    )
)


# --- issue 5: memory placement --------------------------------------------------------------------
register(
    Scenario(
        name="memory-placement",
        title="Memory per device and load stage",
        page="memory",
        description=(
            "LoRA and DoRA on tiny-llama, loaded with and without torch_device, each in a fresh process: "
            "memory per device index at every stage and where every tensor lives (on the last GPU "
            "where there is one, else RSS on the CPU)."
        ),
        build=lambda manifest, devices: demo_spec(
            manifest, ["lora", "dora"], [f"{last_cuda(devices) or 'cpu'}/float32"], ["memory"]
        ),
    )
)


# --- issue 6: adapter consistency -----------------------------------------------------------------

register(
    Scenario(
        name="loop-pissa-lora",
        title="loop with from_pretrained over LoRA + PiSSA adapters",
        page="adapters",
        description="PiSSA then LoRA on one base object, by a from_pretrained loop and by load_adapter, "
        "against isolated: PiSSA rewrites the base weights, so the LoRA after it predicts differently.",
        build=lambda m, d: demo_spec(
            m,
            ["pissa", "lora"],
            ["cpu/float32"],
            ["adapters"],
            strategies=("from_pretrained_loop", "load_adapter"),
        ),
    )
)
register(
    Scenario(
        name="pissa-converted",
        title="PiSSA converted to LoRA",
        page="adapters",
        description="The PiSSA adapter converted to LoRA (rank doubles) on the original base against the "
        "PiSSA model, and loaded first in a loop: it no longer changes the adapters after it.",
        build=lambda m, d: demo_spec(
            m,
            ["pissa_lora", "lora", "pissa"],
            ["cpu/float32"],
            ["adapters"],
            strategies=("from_pretrained_loop",),
        ),
    )
)
register(
    Scenario(
        name="adapter-not-applied",
        title="adapter that is not applied",
        page="adapters",
        description="A LoRA whose B is zero (PEFT's default init) changes nothing: flagged as not "
        "applied; two plain LoRAs in a loop stack but predict exactly as isolated.",
        build=lambda m, d: demo_spec(
            m,
            ["lora", "lora_b", "lora_noop"],
            ["cpu/float32"],
            ["adapters"],
            strategies=("from_pretrained_loop",),
        ),
    )
)


# --- issue 18: where the outputs part -------------------------------------------------------------

register(
    Scenario(
        name="bf16-activations",
        title="where bfloat16 parts from float64",
        page="activations",
        description="tiny-llama on cpu/bfloat16 and cpu/float32, every module's output against cpu/float64: "
        "accumulated and local drift per module, and the first module where bfloat16 parts from the "
        "reference (float32 stays within tolerance throughout).",
        build=lambda m, d: demo_spec(m, [], ["cpu/float32", "cpu/bfloat16"], ["activations"]),
    )
)


# --- issue 27: behaviour ---------------------------------------------------------------------------

register(
    Scenario(
        name="generation-parts",
        title="bfloat16 generates other text",
        page="outputs",
        description="Greedy generation from a real prompt through the demo tokenizer with lora_tie, whose "
        "two best next tokens are 1e-4 apart at one step: float32 keeps the reference's text, bfloat16's "
        "rounding takes the other token there and its text parts from the reference's at that position.",
        build=lambda m, d: demo_spec(
            m,
            ["lora_tie"],
            ["cpu/float32", "cpu/bfloat16"],
            ["outputs", "generate"],
            probe=ProbeInputs(prompts=(TIE_PROMPT,)),
            max_new_tokens=12,
        ),
    )
)
