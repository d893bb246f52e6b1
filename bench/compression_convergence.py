"""Convergence of compressed gradient communication: the default `pretrain_gpt.py` run (GPT
L4 h128 on the default corpus, 800 steps) at dp = 2 on two gloo ranks (CPU), uncompressed,
topk 0.01 and 1bit after a warmup, each reporting the validation loss and its bytes on the
wire per step (from the run's own `--log-json`).

    python -m bench.compression_convergence [--iters 800] [--out results.json]
    python -m bench.compression_convergence --iters 20 --variants none 1bit   # a quick look
    python -m bench.compression_convergence --variants topk-fv --logs runs/   # keep the logs

Each variant is a `torchrun --nproc-per-node 2 pretrain_gpt.py` child (launched by
`run_compare.run_variant`) with one intra-op thread per rank, no checkpoint and no sample;
the table gives the final validation loss (each row also its validation curve), its
difference from the uncompressed run, and the mean bytes a rank sent per compressed step
(and the fp32 all-reduce's bytes over them: the compression ratio). Results:
bench/results/compression_convergence_cpu_2026-11-23.md and the compression_* reports beside
it. The 800-step comparison of the named recipes is this benchmark; CI runs a short one
(tests/training/test_compression_convergence.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from .common import print_table, write_json
from .experimental.compression_recipes import RESEARCH
from .run_compare import run_variant as launch

TOPK = ["--gradient-compression", "topk", "--topk-ratio", "0.01"]
VARIANTS = {
    "none": [],
    "topk": TOPK,
    "1bit": ["--gradient-compression", "1bit", "--compression-start-step", "100"],
    "2bit": ["--gradient-compression", "2bit", "--compression-start-step", "100"],
    # 1-bit Adam's rule: AdamW's variance frozen when compression starts, and each rank
    # compresses its local momentum instead of its gradient
    "topk-fv": [*TOPK, "--compression-start-step", "100", "--freeze-variance"],
    "1bit-fv": ["--gradient-compression", "1bit", "--compression-start-step", "100",
                "--freeze-variance"],
    "2bit-fv": ["--gradient-compression", "2bit", "--compression-start-step", "100",
                "--freeze-variance"],
    # the named recipes (megazoo.training.compression_config.RECIPES)
    "topk-tuned": ["--compression-recipe", "topk-tuned"],
    "1bit-adam": ["--compression-recipe", "1bit-adam"],
    # research recipes, run through bench/experimental/compression_recipes.py
    **{name: ["--compression-recipe", name] for name in RESEARCH},
}


def run_variant(name: str, iters: int, folder: str, extra: list[str],
                timeout: float | None = None) -> dict:
    """One two-rank run (`run_compare.run_variant` through torchrun, stopped after `timeout`
    seconds when given); its log summarised."""
    flags = ["--train-iters", str(iters), "--cpu-threads", "1", "--log-interval", "1",
             "--eval-interval", str(max(iters // 4, 1))] + VARIANTS[name] + extra
    script = ("bench/experimental/compression_recipes.py" if name in RESEARCH
              else "pretrain_gpt.py")
    row = launch(name, flags, folder, timeout, nproc=2, script=script)
    if "error" in row:
        raise SystemExit(f"{name} failed: {row['error']}")
    with open(os.path.join(folder, f"{name}.jsonl")) as f:
        records = [json.loads(line) for line in f]
    steps = [r for r in records if "comm_bytes" in r]
    compressed = [r for r in steps if r.get("compression_ratio", 1.0) > 1.0]
    counted = compressed or steps
    valid = [r["valid_loss"] for r in records if "valid_loss" in r]
    return {"variant": name, "valid_loss": valid[-1] if valid else None,
            "valid_curve": [round(v, 4) for v in valid],
            "train_loss": sum(r["loss"] for r in steps[-10:]) / max(len(steps[-10:]), 1),
            "bytes_per_step": sum(r["comm_bytes"] for r in counted) / max(len(counted), 1),
            "ratio": sum(r["compression_ratio"] for r in counted) / max(len(counted), 1),
            "compressed_steps": len(compressed),
            "tokens_per_s": sum(r["tokens_per_s"] for r in steps) / max(len(steps), 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=800)
    parser.add_argument("--variants", nargs="+", default=["none", "topk-tuned", "1bit-adam"],
                        choices=sorted(VARIANTS))
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--logs", default=None,
                        help="keep each run's --log-json here (default: a temporary folder)")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                        help="more pretrain_gpt.py flags for every variant")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.logs or tmp
        os.makedirs(folder, exist_ok=True)
        for name in args.variants:
            rows.append(run_variant(name, args.iters, folder, args.extra))
            print(json.dumps(rows[-1]), flush=True)
    base = next((r["valid_loss"] for r in rows if r["variant"] == "none"), None)
    for r in rows:
        if base and r["valid_loss"] is not None:
            r["valid_vs_none_pct"] = 100.0 * (r["valid_loss"] - base) / base
    print_table(rows, ["variant", "valid_loss", "valid_vs_none_pct", "train_loss",
                       "bytes_per_step", "ratio", "compressed_steps", "tokens_per_s"])
    write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
