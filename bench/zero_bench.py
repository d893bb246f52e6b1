"""ZeRO-3 + CPU optimizer offload: megazoo under DeepSpeedEngine vs DeepSpeed + HF GPT2, the
largest GPT one GPU trains, and tp=2 / sp=2 on two GPUs; planner predictions beside each.

    python -m bench.zero_bench [--out zero.json]           # 1 GPU: megazoo (DeepSpeed, FSDP2) vs HF GPT2
    python -m bench.zero_bench --largest                   # 1 GPU: the planner's largest GPT
    torchrun --nproc-per-node 2 -m bench.zero_bench --two-gpu
    python -m bench.zero_bench --dry-run                   # all three on CPU, tiny model

Shape: GPT-3 XL, h=2048, l=24, 16 heads, s=2048, micro-batch 4,
V=50304; bf16, ZeRO-3, optimizer offloaded to the CPU, one micro-batch per step, gradient
clipping 1.0. Rows, each in its own subprocess (peak GPU memory and host RSS are its own):
"megazoo" = our model under DeepSpeedEngine (DeepSpeedCPUAdam); "fsdp2" = our model under
FSDP2Engine with CPUOffloadPolicy (fp32 parameters, gradients and AdamW state on the host,
torch's fused CPU AdamW, clipping folded into it); "fsdp2-keep" = the same with the gathered
parameters kept from forward to backward (--no-fsdp-reshard-after-forward); "hf" = the peer,
DeepSpeed + Hugging Face GPT2 with the same DeepSpeed config (`megazoo.config.ds_config`).
Reported: tokens/s (median step after warm-up), the ratio to the peer (target >= 1.3), peak
GPU memory allocated and reserved, peak host RSS, and `megazoo.plan.estimate_memory` for the
run (the same PretrainArgs the engine trains with). `bench/offload_probe.py` breaks a step down.

`--largest` asks the planner for the largest candidate GPT (full recompute, micro-batch 1,
ZeRO-3 + CPU optimizer offload, parameter offload only if needed) that fits --gpu-gb of GPU
and --host-gb of host memory, trains it a few steps on one repeated batch and prints each
loss (finite and falling) and measured vs planned memory. `--two-gpu` runs tp=2 (ZeRO-3 +
CPU offload, DeepSpeed), Ulysses sp=2 (ZeRO-3) and tp=2 under FSDP2 (ZeRO-3 + CPU offload),
or the `--layouts` named, in one torchrun job, each rank on its share of the host cores
(torchrun's OMP_NUM_THREADS=1 overridden): tokens/s, MFU against the measured bf16 matmul
ceiling, memory per GPU vs the planner. A layout's peak memory is its own only when it runs
first in its process (`bench.two_gpu` starts one process per layout). Where the GPU machine lacks
DeepSpeed, `bash tools/gpu_stage.sh` stages it (then `source .gpu/setup.sh && ...` there).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

from bench.common import (REPO, RESULT, child_env, module_command, print_table, results, torchrun,
                          write_json)
from megazoo.models.flops import flops_per_iteration
from megazoo.training.metrics import measure_peak_tflops

SHAPE = dict(hidden=2048, layers=24, heads=16, seq=2048, batch=4, vocab=50304)
TINY = dict(hidden=64, layers=2, heads=4, seq=64, batch=2, vocab=512)
# --largest candidates, largest first: (name, layers, hidden, heads); vocab 50304, s 2048.
LARGEST = [("gpt-13b", 40, 5120, 40), ("gpt-7.5b", 36, 4096, 32), ("gpt-7.1b", 34, 4096, 32),
           ("gpt-6.7b", 32, 4096, 32), ("gpt-2.7b", 32, 2560, 32)]
TINY_LARGEST = [("tiny-l4", 4, 64, 4), ("tiny-l2", 2, 64, 4)]
# megazoo under DeepSpeed, megazoo under FSDP2 (ZeRO-3 + CPU offload; "-keep": gathered
# parameters kept from forward to backward, --no-fsdp-reshard-after-forward), the peer last.
IMPLS = ("megazoo", "fsdp2", "fsdp2-keep", "hf")


def model_config(shape: dict, recompute: str = "none"):
    from megazoo.models import ModelConfig

    return ModelConfig(family="gpt", num_layers=shape["layers"], hidden_size=shape["hidden"],
                       num_attention_heads=shape["heads"], vocab_size=shape["vocab"],
                       max_position_embeddings=shape["seq"], make_vocab_size_divisible_by=128,
                       recompute=recompute)


def run_args(shape: dict, par, *, dp: int, bf16: bool, offload_param: str = "none",
             offload_optimizer: str = "cpu", recompute: str = "none", ratio: float = 1.0,
             zero_impl: str = "deepspeed", reshard: bool = True):
    """The run's PretrainArgs for `shape`: what the engines train with and the planner plans."""
    from megazoo.config.run import DataConfig, PretrainArgs, TrainingConfig
    from megazoo.config.zero import ZeroConfig

    training = TrainingConfig(micro_batch_size=shape["batch"], global_batch_size=shape["batch"] * dp,
                              lr=3e-4, min_lr=3e-4, lr_warmup_iters=0, lr_decay_style="constant",
                              weight_decay=0.0, clip_grad=1.0, bf16=bf16)
    zero = ZeroConfig(zero_impl=zero_impl, zero_stage=3, offload_optimizer=offload_optimizer,
                      offload_param=offload_param, fsdp_reshard_after_forward=reshard,
                      offload_optimizer_ratio=None if ratio == 1.0 else ratio)
    return PretrainArgs(model=model_config(shape, recompute), parallel=par, training=training,
                        data=DataConfig(seq_length=shape["seq"]), zero=zero)


def plan(args, gpu_gb: float = 80.0) -> dict:
    """The planner's numbers for the run `args` (the PretrainArgs the bench trains with)."""
    from megazoo.plan import PlanOptions, estimate_memory

    est = estimate_memory(args, PlanOptions(gpu_memory=gpu_gb))
    return {"plan_gpu_gb": est.gpu_total / 1e9, "plan_alloc_gb": est.allocated / 1e9,
            "plan_host_gb": est.host_per_gpu / 1e9, "plan_fits": est.fits,
            "params": est.num_parameters}


def init_state(par):
    """ParallelState for this process (torchrun's env, or a one-rank group of our own)."""
    from megazoo.parallel import ParallelState

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(29500 + os.getpid() % 1000))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend)
    return ParallelState.initialize(par)


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def batch(shape: dict, dev: torch.device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), generator=g).to(dev)


def megazoo_step(shape, state, args):
    from megazoo.models import build_model
    from megazoo.training.backends.deepspeed_zero import DeepSpeedEngine

    dtype = torch.bfloat16 if args.training.bf16 else None
    model = build_model(args.model, state, device=device(), seed=0, dtype=dtype)
    engine = DeepSpeedEngine(model, state, args)
    ids = batch(shape, device())
    return lambda: engine.train_step([{"input_ids": ids, "labels": ids}]).loss


def fsdp2_step(shape, state, args, reshard_after_forward=True):
    """megazoo under FSDP2Engine: ZeRO-3 with CPUOffloadPolicy (sharded fp32 parameters,
    gradients and AdamW state on the host; torch's fused CPU AdamW)."""
    from megazoo.models import build_model
    from megazoo.training.backends.fsdp2 import FSDP2Engine

    import dataclasses

    model = build_model(args.model, state, device=device(), seed=0)
    zero = dataclasses.replace(args.zero, offload_optimizer="cpu",
                               fsdp_reshard_after_forward=reshard_after_forward)
    engine = FSDP2Engine(model, state, dataclasses.replace(args, zero=zero))
    ids = batch(shape, device())
    return lambda: engine.train_step([{"input_ids": ids, "labels": ids}]).loss


def hf_engine(shape, state, args):
    """The peer: DeepSpeed around Hugging Face GPT2 of the same shape, same DeepSpeed config."""
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from transformers import AutoModelForCausalLM, GPT2Config

    from megazoo.config.ds_config import build_ds_config
    from megazoo.training.backends.deepspeed_setup import ZeroMPU, use_accelerator_of

    use_accelerator_of(device())
    cfg = GPT2Config(n_embd=shape["hidden"], n_layer=shape["layers"], n_head=shape["heads"],
                     n_positions=shape["seq"], vocab_size=shape["vocab"])
    with torch.device(device()):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    if args.training.bf16:
        model = model.to(torch.bfloat16)
    ds = build_ds_config(args, state.dp.size)
    opt = DeepSpeedCPUAdam(model.parameters(), lr=args.training.lr, adamw_mode=True)
    eng, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds, mpu=ZeroMPU(state))
    return eng


def hf_step(shape, state, args):
    eng = hf_engine(shape, state, args)
    ids = batch(shape, device())

    def step():
        loss = eng(input_ids=ids, labels=ids).loss
        eng.backward(loss)
        eng.step()
        return float(loss)
    return step


def measure(step, warmup: int, iters: int) -> dict:
    dev = device()
    losses = [step() for _ in range(warmup)]
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        losses.append(step())
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    out = {"step_s": statistics.median(times), "losses": [round(float(x), 4) for x in losses],
           "host_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9}
    if dev.type == "cuda":
        out["peak_alloc_gb"] = torch.cuda.max_memory_allocated() / 1e9
        out["peak_reserved_gb"] = torch.cuda.max_memory_reserved() / 1e9
    return out


def worker(kind: str, dry: bool, warmup: int, iters: int) -> dict:
    """One implementation on one GPU (or CPU with --dry-run), in this process."""
    from megazoo.parallel import ParallelConfig

    shape = TINY if dry else SHAPE
    state = init_state(ParallelConfig())
    args = run_args(shape, ParallelConfig(), dp=1, bf16=not dry)
    builders = {"megazoo": megazoo_step, "hf": hf_step, "fsdp2": fsdp2_step,
                "fsdp2-keep": lambda *a: fsdp2_step(*a, reshard_after_forward=False)}
    step = builders[kind](shape, state, args)
    out = {"impl": kind, **measure(step, warmup, iters)}
    out["tokens_s"] = shape["batch"] * shape["seq"] / out["step_s"]
    planned = run_args(shape, ParallelConfig(), dp=1, bf16=not dry, reshard=kind != "fsdp2-keep",
                       zero_impl="fsdp2" if kind.startswith("fsdp2") else "deepspeed")
    return {**out, **plan(planned)}


RATIOS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5)  # ZeRO-3 partial offload: fraction on the host


def pick_largest(dry: bool, gpu_gb: float, host_gb: float) -> tuple[dict, str, dict]:
    """The first candidate (largest first) the planner fits: the whole optimizer on the host
    if it fits there, else the largest fraction of it that does (the rest on the GPU), and
    parameter offload only as the last resort. Host budget: --host-gb (pass less than the
    machine has, to leave room for the OS, Python and pinned staging buffers)."""
    from megazoo.parallel import ParallelConfig

    for name, layers, hidden, heads in (TINY_LARGEST if dry else LARGEST):
        shape = dict(hidden=hidden, layers=layers, heads=heads, seq=64 if dry else 2048,
                     batch=1, vocab=512 if dry else 50304)
        for offload_param, ratio in [("none", r) for r in RATIOS] + [("cpu", 1.0)]:
            p = plan(run_args(shape, ParallelConfig(), dp=1, bf16=not dry, recompute="full",
                              offload_param=offload_param, ratio=ratio), gpu_gb)
            if p["plan_fits"] and p["plan_host_gb"] <= host_gb:
                return shape, offload_param, {"name": name, "offload_ratio": ratio, **p}
    raise SystemExit(f"no candidate fits {gpu_gb} GB GPU + {host_gb} GB host")


def largest(dry: bool, gpu_gb: float, host_gb: float, steps: int) -> dict:
    from megazoo.parallel import ParallelConfig

    shape, offload_param, planned = pick_largest(dry, gpu_gb, host_gb)
    print(f"planner picked {planned['name']} ({planned['params'] / 1e9:.2f}e9 params), "
          f"offload_param={offload_param}, optimizer on the host {planned['offload_ratio']:.0%}: plan {planned['plan_gpu_gb']:.1f} GB GPU, "
          f"{planned['plan_host_gb']:.1f} GB host", flush=True)
    state = init_state(ParallelConfig())
    args = run_args(shape, ParallelConfig(), dp=1, bf16=not dry, offload_param=offload_param,
                    recompute="full", ratio=planned["offload_ratio"])
    step = megazoo_step(shape, state, args)
    out = measure(step, warmup=0, iters=steps)
    for i, loss in enumerate(out["losses"]):
        print(f"step {i + 1}: loss {loss:.4f}", flush=True)
    ok = all(map(lambda x: x == x and abs(x) < float("inf"), out["losses"])) \
        and out["losses"][-1] < out["losses"][0]
    return {**planned, **out, "offload_param": offload_param, "finite_and_falling": ok}


# --two-gpu layouts: name -> (ParallelConfig keywords, optimizer offload, ZeRO implementation)
TWO_GPU_LAYOUTS = {"tp2+offload": ({"tp": 2}, "cpu", "deepspeed"),
                   "sp2": ({"sp": 2}, "none", "deepspeed"),
                   "tp2+offload fsdp2": ({"tp": 2}, "cpu", "fsdp2")}


def two_gpu(dry: bool, warmup: int, iters: int, layouts=tuple(TWO_GPU_LAYOUTS)) -> list[dict]:
    """tp=2 (ZeRO-3 + CPU offload), sp=2 (ZeRO-3, optimizer on the GPU) under DeepSpeed, and
    tp=2 with FSDP2's ZeRO-3 + CPU offload: each of `layouts` in turn. A layout's peak memory
    is only its own when it is the process's first (an engine's leftovers are not all freed),
    so bench.two_gpu runs one layout per process."""
    from megazoo.parallel import ParallelConfig

    shape = TINY if dry else SHAPE
    if torch.cuda.is_available():  # each rank measures its own GPU's ceiling
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    ceiling = None if dry else measure_peak_tflops(torch.device("cuda"))
    flops = flops_per_iteration(shape["batch"], shape["seq"], shape["layers"], shape["hidden"], shape["vocab"])
    rows = []
    for name in layouts:
        sizes, offload, impl = TWO_GPU_LAYOUTS[name]
        par = ParallelConfig(**sizes)
        gc.collect()  # the previous layout's engine: its memory must not count here
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        state = init_state(par)
        args = run_args(shape, par, dp=1, bf16=not dry, offload_optimizer=offload)
        step = (fsdp2_step if impl == "fsdp2" else megazoo_step)(shape, state, args)
        out = measure(step, warmup, iters)
        tflops = flops / out["step_s"] / 1e12  # one replica's work, shared by the 2 GPUs
        rows.append({"layout": name, **out, "tokens_s": shape["batch"] * shape["seq"] / out["step_s"],
                     "tflops_per_gpu": tflops / 2,
                     "mfu": None if ceiling is None else tflops / 2 / ceiling,
                     **plan(run_args(shape, par, dp=1, bf16=not dry,
                                     offload_optimizer=offload, zero_impl=impl))})
    return rows


def run_child(argv: list[str], launcher: list[str] | None = None) -> list[dict]:
    cmd = module_command("zero_bench", launcher) + argv
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=child_env())
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return results(proc.stdout)


def compare(dry: bool, warmup: int, iters: int) -> list[dict]:
    flags = ["--dry-run"] if dry else []
    rows = []
    for kind in IMPLS:
        rows += run_child(["--worker", kind, "--warmup", str(warmup), "--iters", str(iters), *flags])
    for row in rows:
        row["ratio"] = row["tokens_s"] / rows[-1]["tokens_s"]
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--largest", action="store_true")
    p.add_argument("--two-gpu", action="store_true")
    p.add_argument("--layouts", nargs="+", choices=list(TWO_GPU_LAYOUTS), default=list(TWO_GPU_LAYOUTS),
                   help="--two-gpu: the layouts to run, in this order")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny model, all modes")
    p.add_argument("--worker", choices=IMPLS, help=argparse.SUPPRESS)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--steps", type=int, default=6, help="--largest: training steps")
    p.add_argument("--gpu-gb", type=float, default=80.0)
    p.add_argument("--host-gb", type=float, default=115.0,
                   help="--largest: host memory the optimizer state may use (128 GB host - OS)")
    p.add_argument("--out")
    a = p.parse_args(argv)
    dry = a.dry_run
    if a.worker:
        print(RESULT + json.dumps(worker(a.worker, dry, a.warmup, a.iters)), flush=True)
        return 0
    if a.two_gpu:
        # torchrun sets OMP_NUM_THREADS=1: give each rank its share of the host's cores, so
        # the offloaded optimizer (DeepSpeed's CPU Adam and torch's AdamW alike) is not
        # stepped on one thread (the 2026-11-23 two-GPU rows ran on one)
        threads = max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        os.environ["OMP_NUM_THREADS"] = str(threads)  # for DeepSpeed's op, loaded later
        torch.set_num_threads(threads)
        rows = two_gpu(dry, a.warmup, a.iters, a.layouts)
        if int(os.environ.get("RANK", "0")) == 0:
            print(RESULT + json.dumps(rows), flush=True)
            print_table(rows, ["layout", "tokens_s", "mfu", "peak_alloc_gb", "plan_alloc_gb",
                               "plan_gpu_gb", "host_rss_gb", "plan_host_gb"])
            write_json(a.out, rows)
        return 0
    if a.largest:
        row = largest(dry, a.gpu_gb, a.host_gb, a.steps)
        print(RESULT + json.dumps(row), flush=True)
        write_json(a.out, row)
        return 0 if row["finite_and_falling"] else 1
    rows = compare(dry, a.warmup, a.iters)
    print_table(rows, ["impl", "tokens_s", "ratio", "peak_alloc_gb", "peak_reserved_gb",
                       "plan_alloc_gb", "plan_gpu_gb", "host_rss_gb", "plan_host_gb"])
    result = {"compare": rows}
    if dry:  # exercise the other two modes as well, on CPU
        result["largest"] = run_child(["--largest", "--dry-run", "--steps", "3"])[0]
        result["two_gpu"] = run_child(["--two-gpu", "--dry-run", "--iters", "2", "--warmup", "1"],
                                      torchrun(2))[0]
        print(json.dumps({k: result[k] for k in ("largest", "two_gpu")}, indent=1)[:3000])
    write_json(a.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
