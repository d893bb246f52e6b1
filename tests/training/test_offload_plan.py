"""The planner's split of the offloaded optimizer state against a real split run: a tiny
LLaMA on the plain engine (bf16, bf16 main gradients, --optimizer-cpu-offload --nvme-path
with a pinned --optimizer-offload-host-memory), planned with `estimate_memory` from the same
arguments and trained one step.

Tolerance: none on what both sides compute. The planner and the engine apply one function
(`offload.host_split`) to the same buckets, so the host slots, which of them live on
disk, the host bytes and each file's size must agree exactly (the files are 12 B per element
padded to 4 KiB). The blocks a file takes (st_blocks) may only exceed its size up to the
filesystem's allocation unit: the store preallocates and writes every byte, so a file that
takes fewer blocks (sparse, or a compressing filesystem) fails. Without the C kernel (torch's
fallback) the engine's split also counts the fp32 scratch the step allocates, byte for byte.
"""
import math
import os

import pytest
import torch

from megazoo.config.zero import ZeroConfig
from megazoo.kernels.host_adamw import backend, host_adamw
from megazoo.models import ModelConfig, build_model
from megazoo.parallel import ParallelConfig, ParallelState
from megazoo.plan.engines import planned_split
from megazoo.plan.layout import PlanOptions, resolve
from megazoo.plan.memory import estimate_memory
from megazoo.offload import disk_span, host_split
from megazoo.training.backends.plain import PlainEngine

from helpers import ddp_checks as checks

LLAMA = ModelConfig(family="llama", num_layers=3, hidden_size=64, num_attention_heads=4,
                    num_key_value_heads=2, ffn_hidden_size=176, vocab_size=checks.VOCAB,
                    max_position_embeddings=checks.S)
RUN = dict(ddp_bucket_size=6000, optimizer_cpu_offload=True, optimizer_offload_fraction=0.9,
           overlap_cpu_optimizer_d2h_h2d=True, bf16=True, accumulate_grads_in_bf16=True)


def run_args(nvme: str, host_gb: float | None):
    args = checks.make_args(ParallelConfig(), zero=ZeroConfig(nvme_path=nvme), **RUN,
                            optimizer_offload_host_memory=host_gb)
    args.model = LLAMA
    return args


def split_budget_gb(nvme: str) -> float:
    """The smallest host budget (GB, in 4 KiB steps) whose split keeps half the host slots
    in memory."""
    args = run_args(nvme, None)
    n = estimate_memory(args, PlanOptions()).parameters_per_gpu
    forward, _ = planned_split(LLAMA, resolve(args, PlanOptions()), n)
    for budget in range(4096, 2 ** 26, 4096):
        if host_split(forward, budget, grad_bytes=2, param_bytes=2).memory >= len(forward) // 2:
            return budget / 1e9
    raise AssertionError("no budget splits the tiny model")


def split_run(nvme: str):
    """(the plan, its host slots in forward order and their split, the engine's optimizer
    after one step) of the tiny split run."""
    args = run_args(nvme, split_budget_gb(nvme))
    est = estimate_memory(args, PlanOptions())
    forward, plan = planned_split(LLAMA, resolve(args, PlanOptions()), est.parameters_per_gpu)
    assert 0 < plan.memory < len(forward) and est.disk_per_gpu == plan.disk > 0
    state = ParallelState.single()
    engine = PlainEngine(build_model(LLAMA, state, device="cpu", seed=args.training.seed),
                         state, args)
    loss = checks.train(engine, state, range(1))[0]  # every disk file written once
    engine.optimizer.wait_params()  # the worker's host steps (the store is one thread's)
    engine.optimizer.stores.host.flush()
    assert math.isfinite(loss)
    return est, forward, plan, engine.optimizer


@pytest.mark.skipif(host_adamw() is None, reason=f"the plan assumes the one-pass host kernel "
                                                 f"({backend().reason})")
def test_planned_disk_bytes_are_the_files_of_a_split_run(tmp_path):
    """The planner's host slots, split, host bytes and disk bytes are the engine's, and the
    disk bytes are the files it writes (no fp32 scratch: the one-pass kernel)."""
    est, forward, plan, opt = split_run(str(tmp_path / "nvme"))
    assert opt._adamw.host.scratch_bytes(torch.bfloat16) == 0 and opt._adamw.host.scratch is None
    # the same host slots, the same split, the same buckets on disk (the last of the forward)
    assert [s.numel for s in opt.host_order] == forward
    assert (opt.split.memory, opt.split.host, opt.split.disk) == (plan.memory, plan.host,
                                                                  plan.disk)
    store = opt.stores.host
    assert [store.on_disk(s.index) for s in opt.host_order] == \
        [False] * plan.memory + [True] * (len(forward) - plan.memory)
    # shard i is host slot i (bucket order: the reverse of the forward)
    root = tmp_path / "nvme" / "rank00000"
    files = sorted(root.glob("shard*.bin"))
    disk = forward[plan.memory:][::-1]
    assert [f.stat().st_size for f in files] == [disk_span(s) for s in disk]
    assert sum(f.stat().st_size for f in files) == est.disk_per_gpu
    unit = max(os.statvfs(root).f_frsize, 4096)
    for f in files:
        size, taken = f.stat().st_size, f.stat().st_blocks * 512
        assert size <= taken < size + unit, f"{f.name}: {taken} bytes taken for {size}"


def test_torch_fallback_splits_with_the_scratch_it_allocates(tmp_path, monkeypatch):
    """Without the C kernel the host step upcasts bf16 gradients into an fp32 scratch of the
    largest host slot: the engine's split counts exactly the bytes the step then holds (the
    plan, which assumes the kernel, does not)."""
    import megazoo.kernels.host_adamw as hk

    monkeypatch.setenv("MEGAZOO_NO_HOST_KERNEL", "1")
    hk._load.cache_clear()
    try:
        _, forward, plan, opt = split_run(str(tmp_path / "nvme"))
    finally:
        monkeypatch.delenv("MEGAZOO_NO_HOST_KERNEL")
        hk._load.cache_clear()
    scratch = opt._adamw.host.scratch
    assert scratch is not None and scratch.dtype == torch.float32
    assert 4 * scratch.numel() == opt._adamw.host.scratch_bytes(torch.bfloat16) == 4 * max(forward)
    budget = opt.plan.host_memory
    assert opt.split == host_split(forward, budget, grad_bytes=2, param_bytes=2,
                                   scratch=4 * max(forward))
    # the budget is the smallest that holds the plan's split, so the scratch takes a slot's room
    assert opt.split.memory == plan.memory - 1 and opt.split.disk > plan.disk
