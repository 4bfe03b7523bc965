import pytest

from core.models.targets import Device, check_targets_exist
from core.spec import (
    REFERENCE_TARGET,
    AdapterRef,
    ModelRef,
    ProbeInputs,
    ProbeSpec,
    SpecError,
    Target,
    ToleranceOverride,
)


@pytest.mark.parametrize(
    "text, expected, label",
    [
        ("cpu/float32", Target("cpu", "float32"), "cpu·fp32"),
        ("cpu/bf16", Target("cpu", "bfloat16"), "cpu·bf16"),
        ("cuda:1/float16+tf32", Target("cuda:1", "float16", tf32=True), "cuda:1·fp16·tf32"),
        ("cpu/float32+threads=1", Target("cpu", "float32", threads=1), "cpu·fp32·threads=1"),
        ("cuda:0/float32+deterministic", Target("cuda:0", "float32", deterministic=True), "cuda:0·fp32·det"),
        ("cuda/float32", Target("cuda:0", "float32"), "cuda:0·fp32"),
        (
            "cuda:0/fp32+matmul=high",
            Target("cuda:0", "float32", matmul_precision="high"),
            "cuda:0·fp32·matmul=high",
        ),
    ],
)
def test_target_parse_and_label(text, expected, label):
    t = Target.parse(text)
    assert t == expected
    assert t.label == label
    assert Target.parse(str(t)) == t  # canonical string round-trips


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("cpu", "DEVICE/DTYPE"),
        ("cpu/int4", "unknown dtype"),  # int8 is a target now: bitsandbytes (issue 26)
        ("gpu:0/float32", "unknown device"),
        ("cpu/float32+fast", "unknown flag"),
        ("cpu/float32+threads=0", "flag threads=0 is not a CPU thread count"),
        ("cpu/float32+threads=" + "9" * 5000, "is not a CPU thread count"),  # past int()'s 4300 digits
        ("cuda:²/float32", r"unknown device 'cuda:²'; use cpu, cuda:N or mps"),
    ],
)
def test_target_parse_errors(text, fragment):
    with pytest.raises(SpecError, match=fragment):
        Target.parse(text)


def test_a_cuda_index_is_kept_as_written_without_int():
    assert Target.parse("cuda:007/fp32").device == "cuda:7"
    assert Target.parse("cuda:" + "1" * 5000 + "/fp32").device == "cuda:" + "1" * 5000


def test_reference_target():
    assert Target.parse("cpu/float64").is_reference
    assert REFERENCE_TARGET.label == "cpu·fp64"
    assert not Target.parse("cpu/float32").is_reference


def test_missing_device_is_refused_with_the_list_of_devices():
    devices = [Device("cpu", "cpu", "x"), Device("cuda:0", "cuda", "H100")]
    check_targets_exist([Target.parse("cuda:0/float32")], devices)
    with pytest.raises(SpecError, match=r"cuda:3 does not exist.*available: cpu, cuda:0"):
        check_targets_exist([Target.parse("cuda:3/float32")], devices)
    with pytest.raises(SpecError, match="tf32 applies to CUDA"):
        check_targets_exist([Target.parse("cpu/float32+tf32")], devices)


def test_adapter_ref_parse():
    assert AdapterRef.parse("/a/b/lora") == AdapterRef("/a/b/lora", "lora")
    assert AdapterRef.parse("/a/b/lora/=mine") == AdapterRef("/a/b/lora/", "mine")
    with pytest.raises(SpecError):
        AdapterRef.parse("/a/b=bad name")


def test_probe_spec_json_round_trip():
    spec = ProbeSpec(
        base=ModelRef("/models/tiny", revision="main"),
        adapters=(AdapterRef("/ad/lora", "lora"), AdapterRef("/ad/dora", "d2")),
        targets=(Target.parse("cpu/float32"), Target.parse("cuda:1/bfloat16+tf32+threads=2")),
        checks=("weights", "outputs"),
        probe=ProbeInputs(input_ids=((1, 2, 3), (4, 5, 6))),
        tolerances={"*": ToleranceOverride(rtol=1e-3, atol=None), "lora_B": ToleranceOverride(atol=1e-6)},
        seed=7,
    )
    again = ProbeSpec.from_json(spec.to_json())
    assert again == spec
    assert again.tolerance_for("lora_B") == ToleranceOverride(atol=1e-6)
    assert again.tolerance_for("output") == ToleranceOverride(rtol=1e-3)


def test_an_adapter_path_may_hold_an_equals_sign(tmp_path):
    # the part after the last '=' is no name: the whole text is the path
    assert AdapterRef.parse("runs/lr=1e-4/lora") == AdapterRef("runs/lr=1e-4/lora", "lora")
    assert AdapterRef.parse("runs/lr=1e-4/lora=mine") == AdapterRef("runs/lr=1e-4/lora", "mine")
    # a folder whose name ends in '=NAME' is taken whole when it exists
    folder = tmp_path / "sweep=best"
    folder.mkdir()
    with pytest.raises(SpecError, match="name 'sweep=best' must be letters"):
        AdapterRef.parse(str(folder))  # exists: not split, and its folder name is no adapter name
    assert AdapterRef.parse(f"{folder}=best") == AdapterRef(str(folder), "best")
    assert AdapterRef.parse(str(tmp_path / "gone=best")) == AdapterRef(str(tmp_path / "gone"), "best")


def test_input_folders_are_checked_without_a_library(tmp_path):
    """A wrong base or adapter path is refused in one line before any worker imports the libraries; a hub
    id (owner/name, no such folder here) is left to the worker."""
    from core.spec import AdapterRef, InputError, ModelRef, adapter_folder, model_folder

    assert model_folder(ModelRef("someone/some-model")) is None
    file = tmp_path / "weights.bin"
    file.write_bytes(b"")
    with pytest.raises(InputError, match=rf"^base model {file}: not a folder$"):
        model_folder(ModelRef(str(file)))
    with pytest.raises(InputError, match=rf"^base model {tmp_path}: not a model folder \(no config.json\)$"):
        model_folder(ModelRef(str(tmp_path)))
    (tmp_path / "config.json").write_text("{}")
    assert model_folder(ModelRef(str(tmp_path))) == tmp_path
    with pytest.raises(
        InputError, match=rf"^adapter a: not an adapter folder \(no adapter_config.json in {tmp_path}\)$"
    ):
        adapter_folder(AdapterRef(str(tmp_path), "a"))
    with pytest.raises(InputError, match=rf"^adapter a: no such folder {tmp_path / 'nope'}$"):
        adapter_folder(AdapterRef(str(tmp_path / "nope"), "a"))
