"""OpenMP's wait policy and a busy machine: why every worker gets ``OMP_WAIT_POLICY=PASSIVE``.

``python -m bench.wait_policy``: a tiny Llama's forward (4 layers, hidden 64, bfloat16, batch 2 ×
16 tokens, torch's default thread count), timed in a fresh process per case (the policy is read when
OpenMP loads), median and mean ms per forward over ``--forwards``; each case alone and with one and
with two busy-looping processes beside it. The logits' sum is printed per case: the policy changes who waits, not what is
computed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

FORWARD = r"""
import statistics, sys, time, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256)
model = LlamaForCausalLM(config).to(torch.bfloat16)
ids = torch.randint(0, 256, (2, 16))
times = []
with torch.no_grad():
    model(ids)
    for _ in range(int(sys.argv[1])):
        t = time.perf_counter()
        out = model(ids).logits
        times.append(time.perf_counter() - t)
print(statistics.median(times) * 1000, statistics.mean(times) * 1000, out.float().sum().item(), torch.get_num_threads())
"""


# The settings compared: libgomp's default (spin a while, then sleep), spin forever, never spin, and
# spins of a given length before sleeping (GOMP_SPINCOUNT, in iterations).
SETTINGS = {
    "default": {},
    "OMP_WAIT_POLICY=ACTIVE": {"OMP_WAIT_POLICY": "ACTIVE"},
    "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
    "GOMP_SPINCOUNT=10000": {"GOMP_SPINCOUNT": "10000"},
    "GOMP_SPINCOUNT=100000": {"GOMP_SPINCOUNT": "100000"},
}
OMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def measure(setting: str, busy: int, forwards: int) -> tuple[float, float, float, int]:
    """(median and mean ms per forward, logits sum, threads) in a fresh process with `SETTINGS[setting]`,
    `busy` busy-looping processes beside it."""
    env = {k: v for k, v in os.environ.items() if k not in OMP_VARS} | SETTINGS[setting]
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        out = subprocess.run(
            [sys.executable, "-c", FORWARD, str(forwards)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    return float(out[0]), float(out[1]), float(out[2]), int(out[3])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--forwards", type=int, default=50)
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per case (the median of theirs)")
    args = p.parse_args(argv)
    print(f"CPUs: {os.cpu_count()}; load average {os.getloadavg()[0]:.2f}")
    print(
        "| busy processes beside it | OpenMP setting | ms per forward: median | mean | logits sum | threads |"
    )
    print("|---|---|---|---|---|---|")
    for busy in (0, 1, 2):
        for setting in SETTINGS:
            runs = [measure(setting, busy, args.forwards) for _ in range(args.repeats)]
            median = statistics.median(r[0] for r in runs)
            mean = statistics.median(r[1] for r in runs)
            print(f"| {busy} | {setting} | {median:.2f} | {mean:.2f} | {runs[0][2]:.6f} | {runs[0][3]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
