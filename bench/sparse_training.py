"""A model trained through `pretrain_gpt.py` with the seeds' sparse section, on today's path
and on FlexAttention over the layout's tiles (the path before the small-block plans), beside
dense attention: tokens/s and the loss.

    python -m bench.sparse_training --out sparse_training.json      # gpt-1.3b, s = 32k, GPU
    python -m bench.sparse_training --dry-run                       # tiny, CPU: the plumbing

Variants (each its own process, same seed and data): `dense` (cuDNN SDPA), `seeds` (the
seeds' section: `{"mode": "fixed", "block": 16, "different_layout_per_head": true}`, the
default path: the strided plan with its local part on the Triton kernel) and `seeds_before`
(the same section with every plan switched off in the child, `--child-path-before`:
FlexAttention over the layout's 128-tiles, the path before). Loss: the mean of the last 10
logged steps; the comparison is `seeds` against `seeds_before` (the same function computed
two ways).
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys

from bench.common import print_table, write_json
from bench.run_compare import run_variant

COMMON = ("--model gpt-1.3b --seq-length 32768 --max-position-embeddings 32768 "
          "--micro-batch-size 1 --global-batch-size 1 --bf16 --recompute full --lr 3e-4 "
          "--lr-warmup-iters 10 --min-lr 3e-5 --log-interval 1 --eval-iters 0")
DRY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 256 "
       "--max-position-embeddings 256 --micro-batch-size 1 --global-batch-size 1 "
       "--log-interval 1 --eval-iters 0")
SEEDS = ["--sparse-attention-mode", "fixed", "--sparse-block", "16",
         "--sparse-attention-config", '{"different_layout_per_head": true}']


def child_path_before(argv: list[str]) -> int:
    """pretrain_gpt.py's main with the dispatch table's "auto" choosing FlexAttention's tiles."""
    from megazoo.layers.sparse import dispatch
    from megazoo.training.run import main

    dispatch.choose = lambda *args, **keywords: dispatch.Route("flex", "the path before")
    return main(argv)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--child-path-before" in argv:  # (run_variant puts its own flags first)
        argv.remove("--child-path-before")
        return child_path_before(argv)
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--timeout", type=float, default=200.0, help="seconds per variant")
    p.add_argument("--logs", default="sparse_training_logs")
    p.add_argument("--out")
    p.add_argument("--dry-run", action="store_true")
    a = p.parse_args(argv)
    common = shlex.split(DRY if a.dry_run else COMMON) + ["--train-iters", str(a.iters)]
    rows = [run_variant("dense", common, a.logs, a.timeout),
            run_variant("seeds", common + SEEDS, a.logs, a.timeout),
            run_variant("seeds_before", ["--child-path-before", *common, *SEEDS], a.logs,
                        a.timeout, script="bench/sparse_training.py")]
    for row in rows:
        if row.get("losses"):
            row["last10_loss"] = statistics.mean(row["losses"][-10:])
        if rows[0].get("tokens_per_s") and row.get("tokens_per_s"):
            row["vs_dense"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
    new, old = rows[1].get("last10_loss"), rows[2].get("last10_loss")
    if new and old:
        rows[1]["loss_vs_path_before"] = new / old - 1
    print_table(rows, ["variant", "iterations", "tokens_per_s", "vs_dense", "last10_loss",
                       "loss_vs_path_before", "peak_gb", "error"])
    write_json(a.out, {"common": shlex.join(common), "seeds": shlex.join(SEEDS), "rows": rows})
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
