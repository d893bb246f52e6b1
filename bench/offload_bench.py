"""Optimizer offload on one GPU: the plain engine's `--optimizer-cpu-offload` against the
model's forward + backward alone and against DeepSpeed ZeRO-3 + CPU optimizer offload, in
one run on the same machine.

    python -m bench.offload_bench --fraction 0.5 --out offload.json
    python -m bench.offload_bench --dry-run        # tiny shape on CPU: checks the plumbing

Rows (each `pretrain_gpt.py` row in its own process, so peaks are its own):
- `adamw`: one AdamW step over N fp32 parameters on the host: torch's fused CPU kernel,
  torch foreach, DeepSpeed's CPUAdam (when its op loads); and the offload's step as it runs
  (bf16 gradient in, bf16 parameters out): torch's three passes against the C kernel the
  offload uses (csrc/host_adamw.c);
- `fwd+bwd`: the model's forward and backward with --recompute full, bf16 weights, no
  optimizer step: the rate the offloaded run is measured against (gb micro-batches);
- `offload`: `pretrain_gpt.py --optimizer-cpu-offload --optimizer-offload-fraction F
  --overlap-cpu-optimizer-d2h-h2d` (plain engine), at gb 16 and gb 64;
- `deepspeed`: `pretrain_gpt.py --deepspeed --zero-stage 3 --offload-optimizer cpu`;
- `fsdp2`: `pretrain_gpt.py --zero-impl fsdp2 --zero-stage 3 --offload-optimizer cpu`;
- `bf16grads16` / `bf16grads64`: the offload row with --accumulate-grads-in-bf16 at the lowest
  fraction the planner fits on this GPU (`offload_largest.planned_fraction`);
- `delayed16`: that row with --offload-delayed-update;
- `tolerance`: 100 steps of a 0.5B LLaMA without offload, offloaded, offloaded with bf16
  main gradients; the largest per-step relative loss difference against the first;
- `--largest` / `--peer-largest`: the largest LLaMA `python -m megazoo.plan --largest` finds
  for this GPU, host and --nvme-path disk (at most --largest-disk GB of state on it), trained
  --largest-iters steps at each --largest-gbs (bench/offload_largest.py: a disk-bound 13B
  takes one call per global batch); the peer is DeepSpeed ZeRO-3 with cpu offload;
- `infinity`, `infinity-largest`, `plain-at`: DeepSpeed ZeRO-Infinity (parameters and
  optimizer state on --nvme-path) at 0.39B and at the largest its disk need allows, and the
  plain engine at that size (bench/offload_infinity.py).
tokens/s, MFU, GPU peak and host RSS peak as the runs log them (median of the logged
intervals after the first).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch.optim.adamw import adamw

from bench import offload_infinity as infinity
from bench import offload_largest as largest
from bench.common import REPO, child_env, time_ms, write_json

SHAPE = dict(family="llama", layers=24, hidden=4096, heads=32, kv_heads=8, ffn=14336, seq=2048,
             micro=2)
TINY = dict(family="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, seq=64, micro=2)
VOCAB = 2048  # the default corpus' tokenizer
CPU = torch.device("cpu")


def model_flags(shape: dict) -> list[str]:
    return ["--family", "llama", "--num-layers", str(shape["layers"]),
            "--hidden-size", str(shape["hidden"]), "--num-attention-heads", str(shape["heads"]),
            "--num-key-value-heads", str(shape["kv_heads"]), "--ffn-hidden-size",
            str(shape["ffn"]), "--seq-length", str(shape["seq"]), "--max-position-embeddings",
            str(shape["seq"]), "--recompute", "full", "--micro-batch-size", str(shape["micro"])]


def adamw_rows(n: int) -> list[dict]:
    """Seconds of one AdamW step over `n` fp32 host parameters, per implementation."""
    p = torch.zeros(n)
    p.grad = torch.full((n,), 1e-3)
    rows = []
    makers = {"torch fused": lambda: torch.optim.AdamW([p], lr=1e-4, fused=True),
              "torch foreach": lambda: torch.optim.AdamW([p], lr=1e-4, foreach=True)}
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        makers["deepspeed CPUAdam"] = lambda: DeepSpeedCPUAdam([p], lr=1e-4, adamw_mode=True)
    except Exception as exc:  # noqa: BLE001 - a peer that does not load is reported
        rows.append({"row": "adamw deepspeed CPUAdam", "error": str(exc)[:200]})
    for name, make in makers.items():
        try:
            opt = make()
            s = time_ms(opt.step, CPU, warmup=1, iters=3) / 1e3
            rows.append({"row": f"adamw {name}", "params": n, "step_s": s,
                         "params_per_s": n / s})
            del opt
        except Exception as exc:  # noqa: BLE001
            rows.append({"row": f"adamw {name}", "error": str(exc)[:200]})
    rows += _bf16_rows(n)
    print(json.dumps(rows), flush=True)
    return rows


def _bf16_rows(n: int) -> list[dict]:
    """The offload's host step as it runs (bf16 gradient in, bf16 parameters out): torch's
    three passes (upcast, fused AdamW, cast) against the one-pass C kernel."""
    from megazoo.kernels.host_adamw import host_adamw
    from megazoo.training.backends.cpu_offload import adamw_piece

    state = {k: torch.rand(n) for k in ("master", "exp_avg", "exp_avg_sq")}
    grad, out = torch.full((n,), 1e-3, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    scratch, step = torch.empty(n), torch.zeros(())
    hyper = dict(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8)

    def torch_passes():
        scratch.copy_(grad)
        adamw([state["master"]], [scratch], [state["exp_avg"]], [state["exp_avg_sq"]], [],
              [step], fused=True, amsgrad=False, weight_decay=0.1, maximize=False, **hyper)
        out.copy_(state["master"])

    kernel, calls = host_adamw(), {"torch upcast + fused + cast (bf16 in/out)": torch_passes}
    if kernel is not None:
        piece = adamw_piece(0, n, hyper["lr"], 0.1, 1, hyper["beta1"], hyper["beta2"])
        calls["megazoo C one pass (bf16 in/out)"] = lambda: kernel(
            state, grad, [piece], out=out, divisor=1.0, beta1=0.9, beta2=0.95, eps=1e-8)
    rows = []
    for name, call in calls.items():
        s = time_ms(call, CPU, warmup=1, iters=3) / 1e3
        rows.append({"row": f"adamw {name}", "params": n, "step_s": s, "params_per_s": n / s})
    return rows


def fwd_bwd_row(shape: dict, gb: int, dry: bool) -> dict:
    """The model's forward + backward over one global batch of micro-batches, no step."""
    from megazoo.models import ModelConfig, build_model
    from megazoo.models.flops import flops_per_iteration

    device = torch.device("cpu" if dry else "cuda")
    cfg = ModelConfig(family="llama", num_layers=shape["layers"], hidden_size=shape["hidden"],
                      num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                      ffn_hidden_size=shape["ffn"], vocab_size=VOCAB,
                      max_position_embeddings=shape["seq"], recompute="full")
    model = build_model(cfg, state=None, device=device, seed=0,
                        dtype=torch.float32 if dry else torch.bfloat16)
    model.check_inputs = False
    ids = torch.randint(0, VOCAB, (shape["micro"], shape["seq"]), device=device)
    micro = gb // shape["micro"]

    def step():
        for _ in range(micro):
            model(ids, labels=ids).div(micro).backward()
        for p in model.parameters():
            p.grad = None

    times = []
    for i in range(4):
        if not dry:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if not dry:
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    s = statistics.median(times)
    flops = flops_per_iteration(gb, shape["seq"], shape["layers"], shape["hidden"], VOCAB)
    return {"row": f"fwd+bwd gb {gb}", "step_s": s, "tokens_per_s": gb * shape["seq"] / s,
            "model_tflops": flops / s / 1e12,
            "peak_gb": None if dry else torch.cuda.max_memory_allocated() / 1e9}


def pretrain_row(name: str, shape: dict, gb: int, iters: int, extra: list[str], dry: bool,
                 timeout: float) -> dict:
    """pretrain_gpt.py's logged rates (median of the intervals after the first)."""
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log.jsonl")
        model = (shape["flags"] + ["--micro-batch-size", str(shape["micro"])]
                 if shape.get("flags") else model_flags(shape))
        cmd = [sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *model,
               "--global-batch-size", str(gb), "--train-iters", str(iters), "--log-interval", "1",
               "--save", "", "--eval-iters", "0", "--generate-tokens", "0", "--no-progress",
               "--no-plot-curves", "--lr-warmup-iters", "0",
               "--data-cache-path", os.path.join(REPO, "data_cache"), "--log-json", log,
               *([] if dry else ["--bf16"]), *extra]
        print(name, " ".join(cmd[1:]), flush=True)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp,
                                  env=child_env(), timeout=timeout)
            failed = proc.returncode != 0 and (proc.stderr or proc.stdout)[-600:]
        except subprocess.TimeoutExpired:  # the steps it logged still count
            proc, failed = None, f"timed out after {timeout:.0f} s"
        wall = time.perf_counter() - t0
        records = []
        if os.path.exists(log):
            with open(log) as f:
                records = [json.loads(x) for x in f if '"tokens_per_s"' in x]
        if (failed and proc is not None) or not records:
            return {"row": name, "error": failed or (proc.stderr or proc.stdout)[-600:]}
    rates = [r["tokens_per_s"] for r in records[1:]] or [records[-1]["tokens_per_s"]]
    last = records[-1]
    mfus = [r["mfu"] for r in records[1:] if "mfu" in r]
    return {"row": name, "gb": gb, "tokens_per_s": statistics.median(rates),
            "step_s": gb * shape["seq"] / statistics.median(rates),
            "mfu": statistics.median(mfus) if mfus else None,
            "losses": [round(r.get("loss", float("nan")), 6) for r in records],
            "peak_gb": last.get("gpu_max_allocated_gb"), "host_rss_gb": last.get("host_rss_gb"),
            "wall_s": wall, "steps": len(records), "timed_out": proc is None,
            "stdout_tail": "" if proc is None else proc.stdout[-1500:],
            "command": " ".join(["pretrain_gpt.py", *cmd[2:]])}


def tolerance_rows(dry: bool, left) -> list[dict]:
    """100 steps of a model the un-offloaded plain engine fits (LLaMA 8 x 2048, 0.5B; lr 3e-4
    after 10 warm-up steps), without offload, offloaded at fraction 0.5, and offloaded with
    bf16 main gradients: each offloaded run's largest per-step relative loss difference
    from the first (bf16 on the GPU: not bit-exact, so this is the tolerance to state)."""
    shape = TINY if dry else dict(SHAPE, layers=8, hidden=2048, heads=16, kv_heads=8, ffn=5632)
    sane = ["--lr", "3e-4", "--lr-warmup-iters", "10"]
    offload = ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5",
               "--overlap-cpu-optimizer-d2h-h2d"]
    runs = {"tolerance plain": sane, "tolerance offload f=0.5": sane + offload,
            "tolerance offload f=0.5 bf16 grads": sane + offload + ["--accumulate-grads-in-bf16"]}
    rows = [pretrain_row(name, shape, 16, 5 if dry else 100, flags, dry, left())
            for name, flags in runs.items()]
    base = rows[0].get("losses") or []
    for row in rows[1:]:
        pairs = list(zip(base, row.get("losses") or []))
        if pairs:
            row["max_rel_loss_diff"] = max(abs(b - a) / abs(a) for a, b in pairs)
            row["final_losses"] = (pairs[-1][0], pairs[-1][1])
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--fraction", type=float, default=0.5)
    ap.add_argument("--rows", nargs="*", default=["fwd", "offload16", "offload64", "adamw",
                                                    "deepspeed"])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for everything")
    ap.add_argument("--extra", nargs="*", default=[], help="more flags for the offload rows")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("--largest", action="store_true", help="also the largest-model rows")
    ap.add_argument("--peer-largest", action="store_true", help="also DeepSpeed's largest")
    ap.add_argument("--largest-iters", type=int, default=10)
    ap.add_argument("--largest-gbs", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--nvme-path", help="disk for the largest plain run's optimizer state")
    ap.add_argument("--largest-disk", type=float, nargs="+", default=largest.DISK_CAPS,
                    help="GB of the largest plain run's optimizer state the planner may put "
                         "on disk, tried in turn until the answer reaches 13B: it is read "
                         "and written once per step, so this bounds the step time")
    infinity.add_arguments(ap)
    a = ap.parse_args(argv)
    dry, start = a.dry_run, time.perf_counter()
    shape = TINY if dry else SHAPE
    left = lambda: a.budget - (time.perf_counter() - start)  # noqa: E731
    rows, done = [], {}
    offload = ["--optimizer-cpu-offload", "--optimizer-offload-fraction", str(a.fraction),
               "--overlap-cpu-optimizer-d2h-h2d", *a.extra]
    print(f"offload fraction {a.fraction}", flush=True)
    for row in a.rows:
        if left() < 30:
            rows.append({"row": row, "error": "no time left"})
            continue
        if row == "adamw":
            rows += adamw_rows(10_000 if dry else 500_000_000)
        elif row == "fwd":
            try:
                rows.append(fwd_bwd_row(shape, 16, dry))
            except Exception as exc:  # noqa: BLE001 - the other rows still run
                rows.append({"row": "fwd+bwd gb 16", "error": str(exc)[:300]})
            if not dry:
                torch.cuda.empty_cache()
        elif row.startswith("offload"):
            gb = int(row[len("offload"):])
            rows.append(pretrain_row(f"offload f={a.fraction} gb {gb}", shape, gb, a.iters,
                                     offload, dry, left()))
        elif row.startswith(("bf16grads", "delayed")):
            gb = int(row.removeprefix("bf16grads").removeprefix("delayed"))
            budgets = largest.machine_budgets(None, dry)
            f = largest.planned_fraction(budgets, model_flags(shape), gb)
            flags = ["--optimizer-cpu-offload", "--accumulate-grads-in-bf16",
                     "--optimizer-offload-fraction", str(f if f is not None else 1.0),
                     "--overlap-cpu-optimizer-d2h-h2d", *a.extra]
            flags += ["--offload-delayed-update"] if row.startswith("delayed") else []
            rows.append(pretrain_row(f"{row} f={f}", shape, gb, a.iters, flags, dry, left()))
        elif row in infinity.ROWS:
            rows += infinity.run_row(row, a, dry, left, pretrain_row, model_flags, shape, done)
        elif row == "tolerance":
            rows += tolerance_rows(dry, left)
        elif row == "fsdp2":
            rows.append(pretrain_row("fsdp2 zero3 cpu-offload gb 16", shape, 16,
                                     max(3, a.iters - 2), ["--zero-impl", "fsdp2",
                                                           "--zero-stage", "3",
                                                           "--offload-optimizer", "cpu"],
                                     dry, left()))
        elif row == "deepspeed":
            rows.append(pretrain_row("deepspeed zero3 cpu-offload gb 16", shape, 16,
                                     max(3, a.iters - 2), ["--deepspeed", "--zero-stage", "3",
                                                           "--offload-optimizer", "cpu"],
                                     dry, left()))
        print(json.dumps(rows[-1]), flush=True)
    for on, name, flags in ((a.largest, "largest", largest.PLAIN),
                            (a.peer_largest, "peer-largest", largest.PEER)):
        if not on:
            continue
        nvme = largest.nvme_dir(a.nvme_path) if name == "largest" else None
        margin = largest.PEER_HOST_MARGIN if name == "peer-largest" else 0.0
        budgets = largest.machine_budgets(nvme, dry, margin)
        planned = largest.plan_target(budgets, flags + (["--nvme-path", nvme] if nvme else []),
                                      a.largest_disk)
        if nvme:
            rows.append(largest.disk_rates(nvme, dry))
        rows += largest.largest_rows(name, planned, a.largest_gbs, a.largest_iters, dry, left,
                                     pretrain_row, shape)
        print(json.dumps(rows[-1]), flush=True)
    write_json(a.out, {"shape": shape, "fraction": a.fraction, "rows": rows})
    for r in rows:
        keys = ("layers", "num_parameters", "tokens_per_s", "step_s", "mfu", "peak_gb", "host_rss_gb",
                "disk_gb", "loss_first", "loss_last", "write_gb_per_s", "read_gb_per_s", "error")
        print(r["row"], {k: (round(r[k], 3) if isinstance(r.get(k), float) else r.get(k))
                         for k in keys if k in r})


if __name__ == "__main__":
    main()
