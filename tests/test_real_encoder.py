"""A real pretrained encoder (all-MiniLM-L6-v2, saved by transformers 4.8) through the CLI.

Its checkpoint holds 103 float32 tensors and `embeddings.position_ids` (int64), which current
transformers keeps as a non-persistent buffer outside the state dict. The CLI runs in this
process with the in-process runner.
"""

import json
from pathlib import Path

import pandas as pd

from core import cli


def run_cli(capsys, home, *args):
    code = cli.main(["run", *args, "--target", "cpu/float32", "--in-process", "--json", "--home", str(home)])
    out = json.loads(capsys.readouterr().out)
    return code, out, pd.read_parquet(Path(out["run_dir"]) / "metrics.parquet")


def test_base_only_weights_run_is_identical_with_position_ids_from_the_buffer(capsys, tmp_path, minilm):
    code, out, table = run_cli(capsys, tmp_path, "--base", str(minilm["base"]), "--check", "weights")
    assert code == 0 and out["exit_code"] == 0
    assert out["verdicts"] == {"identical": 104, "within tolerance": 0, "drift": 0, "broken": 0}
    assert len(table) == 104 and table.bitwise_equal.all() and (table.reference == "checkpoint").all()
    assert table.dtype.value_counts().to_dict() == {"float32": 103, "int64": 1}
    pos = table[table.tensor == "embeddings.position_ids"].iloc[0]
    assert (pos["dtype"], pos["shape"], pos["verdict"], pos["n_mismatch"], pos["rtol"], pos["atol"]) == (
        "int64",
        "1x512",
        "identical",
        0,
        0.0,
        0.0,
    )
    assert pos["note"] == "non-persistent buffer (not in the state dict): the model's own values"


def test_lora_with_the_default_checks(capsys, tmp_path, minilm):
    code, out, table = run_cli(
        capsys, tmp_path, "--base", str(minilm["base"]), "--adapter", f"{minilm['lora']}=lora"
    )
    assert out["status"] == "succeeded"
    assert code == (1 if table.verdict.isin(["drift", "broken"]).any() else 0)
    assert not (table.verdict == "broken").any()
    assert not table.explanation.str.contains("key mismatch").any()
    weights = table[table.check == "weights"]
    # 104 base tensors; LoRA A and B on query/key/value and the 3 dense layers of 6 blocks, and the pooler
    assert weights.groupby(weights.adapter.fillna("-")).size().to_dict() == {"-": 104, "lora": 74}
    assert (weights.verdict == "identical").all()
    assert (table.check == "deltas").sum() == 37
    assert set(table[table.check == "outputs"].adapter.fillna("-")) == {"-", "lora"}
