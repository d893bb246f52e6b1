"""What bf16 main gradients (--accumulate-grads-in-bf16) cost in loss, on CPU in fp32.

    python -m bench.bf16_grads_cpu --iters 200 --out bf16_grads.json

Two `pretrain_gpt.py` runs of the default small GPT on the default corpus, fp32 weights and
compute, 8 micro-batches per step (--micro-batch-size 2 --global-batch-size 16), the same
seed and data: one accumulating the main gradients in fp32, one in bf16. The only
difference is the rounding of the gradient sum to bf16 after each micro-batch, so the loss
gap is its cost. Prints the per-step relative loss difference (max, mean over the last 20
steps) and the final losses.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from bench.common import REPO, child_env, write_json


def losses(extra: list[str], iters: int) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log.jsonl")
        cmd = [sys.executable, os.path.join(REPO, "pretrain_gpt.py"), "--micro-batch-size", "2",
               "--global-batch-size", "16", "--train-iters", str(iters), "--log-interval", "1",
               "--save", "", "--eval-iters", "0", "--generate-tokens", "0", "--no-progress",
               "--no-plot-curves", "--data-cache-path", os.path.join(REPO, "data_cache"),
               "--log-json", log, *extra]
        subprocess.run(cmd, check=True, capture_output=True, cwd=tmp, env=child_env())
        with open(log) as f:
            return [r["loss"] for r in map(json.loads, f) if "loss" in r and "iteration" in r]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    fp32 = losses([], a.iters)
    bf16 = losses(["--accumulate-grads-in-bf16"], a.iters)
    rel = [abs(x - y) / x for x, y in zip(fp32, bf16)]
    tail = rel[-20:]
    out = {"iters": a.iters, "final_fp32": fp32[-1], "final_bf16": bf16[-1],
           "max_rel_diff": max(rel), "mean_rel_diff_last20": statistics.mean(tail),
           "mean_loss_last20_fp32": statistics.mean(fp32[-20:]),
           "mean_loss_last20_bf16": statistics.mean(bf16[-20:])}
    write_json(a.out, {**out, "fp32": fp32, "bf16": bf16})
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
