"""The plain engine's optimizer offload on two GPUs against DeepSpeed ZeRO-3 + CPU optimizer
offload at the same flags: the part `plain-offload` of bench/two_gpu.py.

    python -m bench.two_gpu --parts plain-offload --offload-layouts tp2 --out two_gpu/
    python -m bench.two_gpu --dry-run --parts plain-offload --out /tmp/two_gpu   # CPU, gloo, tiny

One device call per layout (`--offload-layouts`); every row is one `pretrain_gpt.py` process
(torchrun with 2 ranks, or one process on GPU 0), each rank on its share of the host cores
(OMP_NUM_THREADS and --cpu-threads = cores / 2; the one-GPU row gets the same share, as on a
one-GPU machine of half this host). Each row is planned by `megazoo.plan` with the same flags
(the default corpus's 2,048-token vocabulary) and, where the flags leave the offload fraction
open, runs at the planner's: the smallest fraction whose GPU share fits the GPU.

- tp2: gpt-1.3b, tp = 2, micro-batch 4, s 2048, global batch 4 (one micro-batch), bf16: the
  plain engine with --optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d at fraction 1
  (all optimizer state on the host, as DeepSpeed keeps it); DeepSpeed `--deepspeed
  --zero-stage 3 --offload-optimizer cpu`; the plain engine at the planner's fraction where it
  is not 1 (0 for gpt-1.3b: its state fits the GPUs).
- dp2: the LLaMA 5.2B shape of bench/offload_bench.py (24 layers, h 4096, GQA 32/8, ffn 14336,
  s 2048, micro-batch 2, --recompute full, bf16), --use-distributed-optimizer, global batch 16
  on one GPU and 32 at dp = 2 (the same micro-batches per rank), both at one fraction
  (--offload-fraction, else the planner's for one GPU): scaling efficiency
  tokens/s(2) / (2 tokens/s(1)); DeepSpeed at dp = 2, global batch 32; then dp = 2 at the
  planner's dp = 2 fraction where that differs (0 on an 80 GB GPU: no offload needed).
- largest: `python -m megazoo.plan --largest --optimizer-cpu-offload
  --overlap-cpu-optimizer-d2h-h2d --use-distributed-optimizer` with --tp 2 and with --dp 2, at
  --plan-gpu-gb (default 0.95 of GPU 0's memory) and --plan-host-gb (0.8 of the host's); the
  larger answer is trained with the planner's command (its vocabulary of 32,000 becomes the
  corpus's 2,048, and the row is planned again at that) for --largest-iters steps: losses
  (finite, the mean of the last 3 below the first), GPU peak (the run's max allocated, build
  included) and rank 0's host RSS against the plan (target: within 5%).
With --dry-run each row runs on CPU with gloo at a tiny shape; the largest row asks the
planner the same questions and trains a tiny model with the answer's layout and offload flags.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import math
import os
import shlex
import statistics
import time

from bench import offload_bench, train_bench
from bench.common import failure_line, run_command, write_json
from bench.run_compare import run_variant

LAYOUTS = ("tp2", "dp2", "largest")
VOCAB = 2048  # the default corpus's tokenizer: what every row trains on
OFFLOAD = ["--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d"]
DEEPSPEED = ["--deepspeed", "--zero-stage", "3", "--offload-optimizer", "cpu"]
# flags of the planner's --largest command that give the shape and batch (dropped in a dry run)
SHAPE_FLAGS = ("--family", "--num-layers", "--hidden-size", "--num-attention-heads",
               "--num-key-value-heads", "--ffn-hidden-size", "--max-position-embeddings",
               "--seq-length", "--micro-batch-size", "--global-batch-size", "--recompute")


def gpt_flags(dry: bool) -> list[str]:
    """gpt-1.3b at micro-batch 4 in bf16 (dry: tiny, fp32)."""
    shape = train_bench.SHAPES["tiny" if dry else "gpt-1.3b"]
    return train_bench.model_flags(shape) + ["--micro-batch-size", str(shape["micro"])] + \
        ([] if dry else ["--bf16"])


def llama_flags(dry: bool) -> list[str]:
    """The 5.2B LLaMA shape at micro-batch 2, --recompute full, in bf16 (dry: tiny, fp32)."""
    return offload_bench.model_flags(offload_bench.TINY if dry else offload_bench.SHAPE) + \
        ([] if dry else ["--bf16"])


def threads() -> int:
    """Host threads per rank: the cores shared by the two ranks."""
    return max(1, (os.cpu_count() or 2) // 2)


def plan_args(flags: list[str], dp: int):
    """The run's PretrainArgs as `python -m megazoo.plan FLAGS --dp DP` parses them, with the
    default corpus's vocabulary."""
    from megazoo.plan.cli import plan_parser
    from megazoo.config.flags import args_from_namespace

    args = args_from_namespace(plan_parser().parse_args(flags + ["--dp", str(dp)]))
    return dataclasses.replace(args, model=dataclasses.replace(args.model, vocab_size=VOCAB))


def planned(flags: list[str], dp: int, gpu_gb: float, pick: bool) -> dict:
    """The planner's GB for the run `flags` describe; with `pick`, at the smallest offload
    fraction whose GPU share fits `gpu_gb` (the fraction is returned)."""
    from megazoo.plan import GB, PlanOptions
    from megazoo.plan.largest import plan_shape

    args = plan_args(flags, dp)
    est, args = plan_shape(args, args.model, PlanOptions(gpu_memory=gpu_gb, gpus_per_node=2), pick)
    out = {"plan_peak_gb": est.peak_allocated / GB, "plan_host_gb": est.host_per_gpu / GB,
           "plan_fits_gpu": est.verdicts["gpu"]}
    if args.training.optimizer_cpu_offload:
        out["fraction"] = args.training.optimizer_offload_fraction
    return out


def run_row(cfg, name: str, flags: list[str], nproc: int, dp: int, iters: int,
            pick: bool = False) -> dict:
    """Plan, then run one pretrain_gpt.py row (at the planner's fraction with `pick`)."""
    try:
        plan = planned(flags, dp, cfg.plan_gpu_gb, pick)
    except (ValueError, SystemExit) as exc:  # flags the run's checks refuse: the row says so
        return {"name": name, "flags": shlex.join(flags), "error": f"plan: {exc}"}
    if pick:
        flags = flags + ["--optimizer-offload-fraction", f"{plan['fraction']:g}"]
    left = cfg.offload_budget - (time.monotonic() - cfg.offload_start)
    if left < 30:
        return {"name": name, "flags": shlex.join(flags), "error": "not run: --offload-budget spent"}
    env = {"OMP_NUM_THREADS": str(threads())}
    if nproc == 1:
        env["CUDA_VISIBLE_DEVICES"] = "0"
    run = ["--train-iters", str(iters), "--log-interval", "1", "--eval-iters", "0",
           "--no-plot-curves", "--cpu-threads", str(threads())]
    row = run_variant(name.replace(" ", "_").replace("=", ""), flags + run, cfg.logs,
                      min(cfg.timeout, left - 10), nproc, env)
    row.update(plan, name=name, flags=shlex.join(flags))
    print(f"  {name}: {row.get('tokens_per_s')} tokens/s {row.get('error', '')}", flush=True)
    return row


def layout_tp2(cfg) -> dict:
    common, iters = gpt_flags(cfg.dry_run) + ["--tp", "2", "--global-batch-size", "4"], cfg.offload_iters
    rows = {"plain f=1": run_row(cfg, "tp2 plain f=1", common + OFFLOAD +
                                 ["--optimizer-offload-fraction", "1"], 2, 1, iters)}
    if cfg.offload_peer:
        rows["deepspeed"] = run_row(cfg, "tp2 deepspeed", common + DEEPSPEED, 2, 1, iters)
    if planned(common + OFFLOAD, 1, cfg.plan_gpu_gb, True)["fraction"] != 1:
        rows["plain planned"] = run_row(cfg, "tp2 plain planned", common + OFFLOAD, 2, 1, iters, True)
    return rows


def layout_dp2(cfg) -> dict:
    """One GPU and dp = 2 at one fraction (--offload-fraction, else the planner's for one GPU),
    DeepSpeed, then dp = 2 at the planner's dp = 2 fraction where that differs."""
    shape = llama_flags(cfg.dry_run)
    gb = 8 if cfg.dry_run else 16  # one GPU; dp = 2 gets twice that: the same micro-batches
    plain, iters = OFFLOAD + ["--use-distributed-optimizer"], cfg.offload_iters
    one, two = shape + ["--global-batch-size", str(gb)], shape + ["--global-batch-size", str(2 * gb)]
    f = cfg.offload_fraction
    if f is None:  # a dry run's tiny model fits any GPU: 0.5 runs the host and GPU shares
        f = 0.5 if cfg.dry_run else planned(one + plain, 1, cfg.plan_gpu_gb, True)["fraction"]
    at_f = plain + ["--optimizer-offload-fraction", f"{f:g}"]
    rows = {"1 gpu": run_row(cfg, f"dp1 plain f={f:g}", one + at_f, 1, 1, iters),
            "dp2": run_row(cfg, f"dp2 plain f={f:g}", two + at_f, 2, 2, iters)}
    if cfg.offload_peer:
        rows["deepspeed"] = run_row(cfg, "dp2 deepspeed", two + DEEPSPEED, 2, 2, max(4, iters - 2))
    if planned(two + plain, 2, cfg.plan_gpu_gb, True)["fraction"] != f:
        rows["dp2 planned"] = run_row(cfg, "dp2 plain planned", two + plain, 2, 2, iters, True)
    return rows


def ask_largest(flags: list[str], gpu_gb: float, host_gb: float) -> dict:
    """`python -m megazoo.plan --largest FLAGS --json` at these budgets, in this process."""
    from megazoo.plan.cli import main as plan_main

    argv = ["--largest", "--json", *flags, "--gpu-memory", f"{gpu_gb:g}",
            "--host-memory", f"{host_gb:g}", "--gpus-per-node", "2"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = plan_main(argv)
        except SystemExit as exc:  # its parser's one-line error
            rc = exc.code or 2
    if rc:
        return {"error": err.getvalue().strip(), "ask": shlex.join(argv)}
    answer = json.loads(out.getvalue())
    return {"ask": shlex.join(argv), "command": answer["command"],
            "num_parameters": answer["num_parameters"]}


def drop_flags(tokens: list[str], names) -> list[str]:
    """`tokens` without each flag of `names` and its value."""
    kept, skip = [], False
    for token in tokens:
        if skip:
            skip = False
        elif token in names:
            skip = True
        else:
            kept.append(token)
    return kept


def layout_largest(cfg) -> dict:
    """Ask the planner for tp = 2 and dp = 2, train the larger answer, compare with its plan."""
    base = OFFLOAD + ["--use-distributed-optimizer"]
    asked = {name: ask_largest(base + layout, cfg.plan_gpu_gb, cfg.plan_host_gb)
             for name, layout in (("tp2", ["--tp", "2"]), ("dp2", ["--dp", "2"]))}
    fitting = [n for n in asked if "command" in asked[n]]
    if not fitting:
        return {"largest": {"name": "largest", "asked": asked, "error": "no shape fits"}}
    pick = max(fitting, key=lambda n: asked[n]["num_parameters"])
    tokens = shlex.split(asked[pick]["command"])
    flags = tokens[tokens.index("pretrain_gpt.py") + 1:]
    if cfg.dry_run:  # the answer's layout and offload, a tiny fp32 shape
        flags = [t for t in drop_flags(flags, SHAPE_FLAGS) if t != "--bf16"] + llama_flags(True) + [
            "--global-batch-size", str(4 if pick == "dp2" else 2)]
    row = run_row(cfg, f"largest {pick}", flags, 2, 2 if pick == "dp2" else 1, cfg.largest_iters)
    losses = row.get("losses") or []
    row.update(layout=pick, asked=asked, num_parameters=asked[pick]["num_parameters"],
               finite_and_falling=bool(losses) and all(map(math.isfinite, losses))
               and len(losses) >= 4 and statistics.mean(losses[-3:]) < losses[0])
    return {"largest": row}


def machine(cfg) -> dict:
    """The budgets the planner is given: GPU 0's memory and the host's, in GB. nvidia-smi,
    not torch.cuda: a CUDA context here would hold GPU 0 memory while the rows run."""
    if cfg.dry_run:
        return {"gpu_gb": 80.0, "host_gb": 250.0}
    rc, out, err = run_command(["nvidia-smi", "--query-gpu=memory.total,name",
                                "--format=csv,noheader,nounits", "--id=0"], 60)
    if rc != 0:
        raise SystemExit(f"error: nvidia-smi failed: {failure_line(err or out)}")
    mib, name = out.strip().split(",", 1)
    with open("/proc/meminfo") as f:
        total_kb = next(int(x.split()[1]) for x in f if x.startswith("MemTotal:"))
    return {"gpu_gb": int(mib) * 2**20 / 1e9, "host_gb": total_kb * 1024 / 1e9, "gpu": name.strip()}


def run_part(cfg) -> None:
    """Each layout of cfg.offload_layouts into OUT/plain_offload_<layout>.json."""
    cfg.offload_start, cfg.logs = time.monotonic(), os.path.join(cfg.out, "logs")
    os.makedirs(cfg.logs, exist_ok=True)
    got = machine(cfg)
    cfg.plan_gpu_gb = cfg.plan_gpu_gb or round(0.95 * got["gpu_gb"], 1)
    cfg.plan_host_gb = cfg.plan_host_gb or round(0.8 * got["host_gb"], 1)
    runners = {"tp2": layout_tp2, "dp2": layout_dp2, "largest": layout_largest}
    for layout in cfg.offload_layouts:
        print(f"-- plain-offload {layout}", flush=True)
        rows = runners[layout](cfg)
        write_json(os.path.join(cfg.out, f"plain_offload_{layout}.json"),
                   {"layout": layout, "machine": got, "threads_per_rank": threads(),
                    "plan_budget_gb": [cfg.plan_gpu_gb, cfg.plan_host_gb],
                    "rows": rows})


def add_flags(parser) -> None:
    """bench.two_gpu's flags of this part."""
    parser.add_argument("--offload-layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS),
                        help="plain-offload: the layouts to run (one device call each)")
    parser.add_argument("--offload-peer", action=argparse.BooleanOptionalAction,
                        default=True, help="plain-offload: also DeepSpeed ZeRO-3 + CPU offload")
    parser.add_argument("--offload-iters", type=int, default=6,
                        help="plain-offload: pretrain_gpt.py steps per row (DeepSpeed's at dp = 2: "
                             "2 fewer, at least 4); the first is warm-up")
    parser.add_argument("--offload-budget", type=float, default=540.0,
                        help="plain-offload: seconds for all its rows; a row is skipped with less "
                             "than 30 s left, and none runs past it")
    parser.add_argument("--offload-fraction", type=float, default=None,
                        help="plain-offload dp2: the fraction of the one-GPU and dp = 2 rows "
                             "(default: the planner's for one GPU)")
    parser.add_argument("--plan-gpu-gb", type=float, default=None,
                        help="plain-offload: the planner's GPU budget, for fractions and the "
                             "largest model (default 0.95 of GPU 0's memory)")
    parser.add_argument("--plan-host-gb", type=float, default=None,
                        help="plain-offload largest: the planner's host budget (default 0.8 of "
                             "the host's memory)")
    parser.add_argument("--largest-iters", type=int, default=12,
                        help="plain-offload largest: training steps (at least 10)")
