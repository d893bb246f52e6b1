"""Two GPUs: `pretrain_gpt.py` at tp=2, sp=2 (Ulysses) and pp=2 follows the one-GPU loss curve.

    python -m bench.layout_curves --out curves.json          # on a machine with 2 GPUs

Runs the same training (same seed, data, global batch, bf16) once on one GPU and once per
two-GPU layout under torchrun, each logging every step as JSON lines, then prints for each
layout the largest and the mean absolute difference of its per-step loss from the one-GPU
run. bf16 autocast reorders reductions differently in each layout, so the curves agree to
bf16 rounding, not bit for bit; the tolerance asked for is that of bf16 (~1e-2 relative).
`--device cpu` is a dry run with a tiny model on gloo.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = {"tp2": ["--tensor-model-parallel-size", "2"],
           "tp2_sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
           "sp2": ["--sequence-parallel-size", "2"],
           "pp2": ["--pipeline-model-parallel-size", "2"]}


def run(name: str, flags: list[str], common: list[str], ranks: int, folder: str) -> list[float]:
    log = os.path.join(folder, f"{name}.jsonl")
    launcher = [sys.executable] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
    cmd = launcher + [os.path.join(REPO, "pretrain_gpt.py")] + common + flags + ["--log-json", log]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(log)]
    return [r["loss"] for r in rows if "loss" in r and "iteration" in r]


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out")
    args = p.parse_args()
    if args.device == "cuda":
        model = ["--model", "gpt-350m", "--seq-length", "1024", "--bf16"]
    else:
        model = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                 "--seq-length", "64", "--max-position-embeddings", "64"]
    common = model + ["--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters",
                      str(args.iters), "--log-interval", "1", "--eval-interval", "100000",
                      "--eval-iters", "1", "--save", "", "--no-progress", "--generate-tokens", "0",
                      "--seed", "1234"]
    with tempfile.TemporaryDirectory() as folder:
        base = run("1gpu", [], common, 1, folder)
        rows = []
        for name, flags in LAYOUTS.items():
            losses = run(name, flags, common, 2, folder)
            diffs = [abs(a - b) for a, b in zip(losses, base)]
            rows.append(dict(layout=name, steps=len(losses), first_loss=losses[0],
                             last_loss=losses[-1], last_loss_1gpu=base[-1],
                             max_abs_diff=max(diffs), mean_abs_diff=sum(diffs) / len(diffs),
                             max_rel_diff=max(d / b for d, b in zip(diffs, base))))
    for r in rows:
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    if args.out:
        json.dump(dict(one_gpu=base, layouts=rows), open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
