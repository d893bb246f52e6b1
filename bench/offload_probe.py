"""Where the time of a ZeRO-3 + CPU-Adam-offload step goes, on the GPU host.

    python -m bench.offload_probe primitives      # host bandwidth, PCIe, CPU Adam speeds
    python -m bench.offload_probe step [megazoo|hf]  # DeepSpeed step: forward / backward / step

`primitives`: host memory copy bandwidth, pinned and pageable PCIe bandwidth, and one Adam
step over gpt-1.3b's parameter count through DeepSpeedCPUAdam and torch's fused CPU AdamW.
`step`: the zero_bench configuration (gpt-1.3b, micro-batch 4, s=2048, bf16, ZeRO-3 + CPU
Adam) with the forward, backward and optimizer step timed separately (CUDA synchronised).
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch


N = 1_316_000_000  # gpt-1.3b parameters


def timed(fn, reps=3):
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def primitives():
    print("threads", torch.get_num_threads(), "cpus", os.cpu_count(), flush=True)
    a = torch.empty(N // 2, dtype=torch.float32)
    b = torch.empty_like(a)
    a.fill_(1.0), b.fill_(0.0)
    t = timed(lambda: b.copy_(a))
    print(f"host copy fp32 {a.numel()*4/1e9:.1f} GB: {t*1e3:.0f} ms = {2*a.numel()*4/t/1e9:.0f} GB/s r+w", flush=True)
    del a, b
    g = torch.empty(N, dtype=torch.bfloat16, device="cuda").normal_()
    pin = torch.empty(N, dtype=torch.bfloat16, pin_memory=True)
    page = torch.empty(N, dtype=torch.bfloat16)
    page.fill_(0)
    for name, fn in [("D2H pinned", lambda: pin.copy_(g, non_blocking=True)),
                     ("H2D pinned", lambda: g.copy_(pin, non_blocking=True)),
                     ("D2H pageable", lambda: page.copy_(g)),
                     ("H2D pageable", lambda: g.copy_(page))]:
        t = timed(fn)
        print(f"{name} bf16 {N*2/1e9:.1f} GB: {t*1e3:.0f} ms = {N*2/t/1e9:.1f} GB/s", flush=True)
    f32 = torch.empty(N, dtype=torch.float32)
    f32.fill_(0.5)
    t = timed(lambda: g.copy_(f32))
    print(f"H2D fp32 pageable -> bf16 GPU (DeepSpeed's param copy back): {t*1e3:.0f} ms", flush=True)
    t = timed(lambda: pin.copy_(f32))
    print(f"host fp32 -> bf16 cast: {t*1e3:.0f} ms", flush=True)
    del g, pin, page, f32
    p = torch.zeros(N, dtype=torch.float32)
    grad = torch.full((N,), 1e-3, dtype=torch.float32)
    p.grad = grad
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        opt = DeepSpeedCPUAdam([p], lr=1e-4, adamw_mode=True)
        opt.step()
        t = timed(opt.step)
        print(f"DeepSpeedCPUAdam step 1.3B fp32: {t*1e3:.0f} ms", flush=True)
        del opt
    except Exception as exc:  # noqa: BLE001
        print("DeepSpeedCPUAdam unavailable:", exc)
    for fused in (True, False):
        opt = torch.optim.AdamW([p], lr=1e-4, fused=fused, foreach=None if fused else True)
        opt.step()
        t = timed(opt.step)
        print(f"torch AdamW fused={fused} step 1.3B fp32 CPU: {t*1e3:.0f} ms", flush=True)
        del opt
    chunks = list(torch.chunk(p, 24))
    grads = list(torch.chunk(grad, 24))
    params = [torch.nn.Parameter(c) for c in chunks]
    for q, gq in zip(params, grads):
        q.grad = gq
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    opt.step()
    t1 = timed(lambda: [torch.optim.AdamW.step(opt)])
    print(f"torch fused AdamW 24 chunks together: {t1*1e3:.0f} ms", flush=True)


def step(kind):
    from bench import zero_bench as zb
    from megazoo.parallel import ParallelConfig

    shape = zb.SHAPE
    state = zb.init_state(ParallelConfig())
    args = zb.run_args(shape, ParallelConfig(), dp=1, bf16=True)
    if kind == "fsdp2":
        return fsdp2_phases(zb, shape, state, args)
    if kind == "megazoo":
        from megazoo.models import build_model
        from megazoo.training.backends.deepspeed_zero import DeepSpeedEngine
        model = build_model(args.model, state, device=zb.device(), seed=0, dtype=torch.bfloat16)
        eng = DeepSpeedEngine(model, state, args).ds
        ids = zb.batch(shape, zb.device())
        fwd = lambda: eng(ids, labels=ids)  # noqa: E731
    else:
        eng = zb.hf_engine(shape, state, args)
        ids = zb.batch(shape, zb.device())
        fwd = lambda: eng(input_ids=ids, labels=ids).loss  # noqa: E731
    rows = []
    for i in range(6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = fwd()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        eng.backward(loss)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        eng.step()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        rows.append((t1 - t0, t2 - t1, t3 - t2))
        print(f"{kind} it{i} fwd {1e3*(t1-t0):.0f} ms bwd {1e3*(t2-t1):.0f} ms step {1e3*(t3-t2):.0f} ms loss {float(loss):.3f}", flush=True)
    if os.environ.get("PROFILE"):
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            loss = fwd()
            eng.backward(loss)
            eng.step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40))


def fsdp2_phases(zb, shape, state, args):
    from megazoo.models import build_model
    from megazoo.training.backends.fsdp2 import FSDP2Engine
    from megazoo.training.gradients import complete_sharded_gradients as complete_gradients
    from megazoo.training.gradients import clip_divisor, global_grad_norm, local

    import dataclasses

    model = build_model(args.model, state, device=zb.device(), seed=0)
    zero = dataclasses.replace(args.zero, offload_optimizer="cpu",
                               fsdp_reshard_after_forward=not os.environ.get("KEEP"))
    eng = FSDP2Engine(model, state, dataclasses.replace(args, zero=zero))
    ids = zb.batch(shape, zb.device())
    def sync():
        torch.cuda.synchronize()
        return time.perf_counter()
    for i in range(6):
        eng.optimizer.zero_grad(set_to_none=True)
        t = [sync()]
        out = model(ids, labels=ids)
        t.append(sync())
        out.float().backward()
        t.append(sync())
        complete_gradients(model, state)
        norm = global_grad_norm(model, state)
        t.append(sync())
        divisor = clip_divisor(norm, eng.cfg.clip_grad)  # what FSDP2Engine.step folds in
        eng.optimizer.grad_scale = torch.tensor(
            divisor, device=local(next(model.parameters())).device) if divisor != 1.0 else None
        t.append(sync())
        eng.optimizer.step()
        t.append(sync())
        d = [1e3 * (b - a) for a, b in zip(t, t[1:])]
        t0 = sync()
        eng.train_step([{"input_ids": ids, "labels": ids}])
        whole = 1e3 * (sync() - t0)
        print(f"fsdp2 train_step {whole:.0f} ms; it{i} fwd {d[0]:.0f} bwd {d[1]:.0f} norm {d[2]:.0f} clip {d[3]:.0f} "
              f"adam {d[4]:.0f} ms", flush=True)
    if os.environ.get("PROFILE"):
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            eng.train_step([{"input_ids": ids, "labels": ids}])
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    if sys.argv[1] == "primitives":
        primitives()
    else:
        step(sys.argv[2] if len(sys.argv) > 2 else "megazoo")
