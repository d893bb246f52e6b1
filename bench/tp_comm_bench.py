"""Tensor parallelism + Megatron SP and Ulysses on 2 GPUs with and without --tp-comm-overlap:
tokens/s and the collectives one training step issues, beside one GPU.

    python -m bench.tp_comm_bench --out DIR                  # 2 GPUs (see bench/README.md)
    python -m bench.tp_comm_bench --dry-run --out /tmp/tpc   # CPU, gloo, tiny shape

Each row is pretrain_gpt.py (gpt-1.3b shape of train_bench.py, bf16, micro-batch 4, s 2048,
--use-distributed-optimizer --overlap-grad-reduce) run by this module's child under torchrun:
steps `--skip`+1 .. `--skip`+`--steps` are timed (one device sync before and after the
window), then one more step runs under `megazoo.parallel.comm_count.CommCounter` (not timed:
the counter costs host time per op) and its collectives are printed by kind and group
(calls and bytes per step), with the host reads of tensor values and the event polls the
step made. Rows: one GPU (the baseline of the ratio), tp 2 + SP and Ulysses sp 2, each
with and without --tp-comm-overlap. Results: `RESULT {json}` lines, DIR/tp_comm.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from bench.common import REPO, module_command, results, run_command, torchrun, write_json
from bench.train_bench import SHAPES, model_flags

ENGINE = ["--use-distributed-optimizer", "--overlap-grad-reduce"]
ROWS = {  # name -> (ranks, flags)
    "one GPU": (1, []),
    "tp2+SP": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "tp2+SP overlap": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                           "--tp-comm-overlap"]),
    "ulysses sp2": (2, ["--sequence-parallel-size", "2"]),
    "ulysses sp2 overlap": (2, ["--sequence-parallel-size", "2", "--tp-comm-overlap"]),
}
RUN_FLAGS = ["--save", "", "--generate-tokens", "0", "--no-progress", "--eval-iters", "0",
             "--data-cache-path", os.path.join(REPO, "data_cache")]


def child(skip: int, steps: int, run_flags: list[str]) -> int:
    """Under torchrun: run pretrain_gpt.py's main with Engine.train_step wrapped (module doc)."""
    from megazoo.parallel.comm_count import CommCounter, named_groups
    from megazoo.training.backends.base import Engine
    from megazoo.training.run import main as run_main

    original, seen, out = Engine.train_step, [0], {"wall_s": 0.0, "tokens": 0}
    cuda = torch.cuda.is_available()

    def train_step(self, micro_batches):
        seen[0] += 1
        if skip < seen[0] <= skip + steps:
            if cuda and seen[0] == skip + 1:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            result = original(self, micro_batches)
            if cuda and seen[0] == skip + steps:
                torch.cuda.synchronize()
            out["wall_s"] += time.perf_counter() - t0
            out["tokens"] += sum(mb["input_ids"].numel() for mb in micro_batches) * self.state.dp.size
            return result
        if seen[0] != skip + steps + 1:
            return original(self, micro_batches)
        with CommCounter(named_groups(self.state)) as counts:
            result = original(self, micro_batches)
        out["collectives"] = [[kind, group, calls, counts.bytes_by_kind()[kind, group]]
                              for (kind, group), calls in sorted(counts.summary().items())]
        out["host_syncs"], out["event_polls"] = counts.host_syncs, counts.events
        return result

    Engine.train_step = train_step
    rc = run_main(run_flags)
    if seen[0] <= skip + steps:
        print(f"the run made {seen[0]} steps; give --train-iters > {skip + steps}")
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        out["tokens_per_s"] = out["tokens"] / out["wall_s"]
        out["step_ms"] = out["wall_s"] / steps * 1e3
        print("RESULT " + json.dumps(out), flush=True)
    return rc


def row_flags(cfg, extra: list[str]) -> list[str]:
    shape = SHAPES["tiny" if cfg.dry_run else cfg.shape]
    flags = model_flags(shape) + ["--micro-batch-size", str(shape["micro"]),
                                  "--global-batch-size", str(cfg.global_batch),
                                  "--train-iters", str(cfg.skip + cfg.steps + 1),
                                  "--log-interval", str(cfg.skip + cfg.steps + 1)]
    return flags + RUN_FLAGS + ENGINE + ([] if cfg.dry_run else ["--bf16"]) + extra


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--out", default="tp_comm")
    p.add_argument("--shape", default="gpt-1.3b", choices=sorted(SHAPES))
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--skip", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--timeout", type=float, default=150, help="seconds per row")
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS),
                   help="which rows (default: all; 'one GPU' is the scaling's base)")
    p.add_argument("--dry-run", action="store_true", help="tiny shape, fp32, CPU")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    cfg = p.parse_args(argv[:split])
    if cfg.child:
        return child(cfg.skip, cfg.steps, argv[split + 1:])
    os.makedirs(cfg.out, exist_ok=True)
    rows = {}
    for name in cfg.rows:
        ranks, extra = ROWS[name]
        launcher = torchrun(ranks) if ranks > 1 else None
        cmd = module_command("tp_comm_bench", launcher) + [
            "--child", "--skip", str(cfg.skip), "--steps", str(cfg.steps), "--", *row_flags(cfg, extra)]
        rc, out, err = run_command(cmd, timeout=cfg.timeout)
        with open(os.path.join(cfg.out, name.replace(" ", "_").replace("+", "_") + ".log"), "w") as f:
            f.write(out + "\n--- stderr ---\n" + err)
        found = results(out)
        rows[name] = dict(found[-1], ranks=ranks) if found else {"error": f"rc {rc}: {err[-300:]}"}
        print(name, json.dumps(rows[name]), flush=True)
        write_json(os.path.join(cfg.out, "tp_comm.json"), rows)  # kept if a later row hangs
    base = rows.get("one GPU", {}).get("tokens_per_s")
    for name, row in rows.items():
        if base and "tokens_per_s" in row:
            row["vs_n_one_gpu"] = row["tokens_per_s"] / (row["ranks"] * base)
        print(f"{name}: {row.get('tokens_per_s', float('nan')):.0f} tokens/s, "
              f"{row.get('vs_n_one_gpu', float('nan')):.2f} of N x one GPU; collectives per step "
              f"{row.get('collectives')}; host reads {row.get('host_syncs')}, "
              f"event polls {row.get('event_polls')}")
    write_json(os.path.join(cfg.out, "tp_comm.json"), rows)
    return 0 if all("tokens_per_s" in r for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
