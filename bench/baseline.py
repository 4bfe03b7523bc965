"""The plain load-plus-forward baseline, run as ``python -m bench.baseline`` in a fresh process.

What a user does without WeightDrift: ``AutoModelForCausalLM.from_pretrained(dtype=…)``, then
``PeftModel.from_pretrained``, then one forward pass on the same probe input as ``core run``
(2 × 16 token ids drawn from a generator seeded with 0, attention mask of ones). Times are
measured inside the process, imports apart; one JSON object is printed on stdout.
"""

from __future__ import annotations

import time

_T0 = time.perf_counter()  # before the heavy imports below, so that they can be timed apart

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

PROBE_BATCH, PROBE_SEQ_LEN, PROBE_SEED = 2, 16, 0  # core.spec.ProbeInputs' defaults, run seed 0


def main(argv: list[str] | None = None) -> int:
    """Load, attach, forward; print the timings as JSON."""
    p = argparse.ArgumentParser(prog="python -m bench.baseline")
    p.add_argument("--base", required=True)
    p.add_argument("--adapter", required=True)
    p.add_argument("--dtype", required=True, choices=["float32", "bfloat16", "float16", "float64"])
    args = p.parse_args(argv)

    import torch
    import transformers
    from peft import PeftModel

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    t_imported = time.perf_counter()

    dtype = getattr(torch, args.dtype)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.base, dtype=dtype)
    t_base = time.perf_counter()
    model = PeftModel.from_pretrained(model, args.adapter)
    model.eval()
    t_adapter = time.perf_counter()

    vocab = model.config.vocab_size
    ids = torch.randint(
        0, vocab, (PROBE_BATCH, PROBE_SEQ_LEN), generator=torch.Generator().manual_seed(PROBE_SEED)
    )
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    t_forward = time.perf_counter()

    from bench.e2e import vm_hwm  # after the timings: it is not part of the load

    out = {
        "dtype": args.dtype,
        "import_s": t_imported - _T0,
        "load_base_s": t_base - t_imported,
        "load_adapter_s": t_adapter - t_base,
        "forward_s": t_forward - t_adapter,
        "load_forward_s": t_forward - t_imported,
        "logits_shape": list(logits.shape),
        "logits_finite": bool(torch.isfinite(logits).all()),
        "torch_threads": torch.get_num_threads(),
        # VmHWM, not ru_maxrss: after fork + exec ru_maxrss still holds the forking parent's peak
        "peak_rss_bytes": vm_hwm("self"),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
