"""Host memory of DeepSpeed ZeRO-3 with its optimizer offloaded to cpu, from the allocations
its `stage3.py` makes (DeepSpeed 0.19.8; `offload_optimizer.pin_memory` defaults to true):

- sub-groups: each parameter group (Megatron's two: matrices, then 1-D tensors) is cut into
  sub-groups after the tensor that brings it to `sub_group_size` (1e9) partition elements;
  with a partial offload (`ratio`) the last `ratio` of the sub-groups are stepped on the host;
- fp32 masters of the host's sub-groups, pageable (4 B per element), and DeepSpeedCPUAdam's
  m and v, pageable, allocated at the first step (8 B);
- each sub-group's fp32 gradient: a pageable buffer copied into a pinned one (4 B), also for
  the sub-groups stepped on the GPU (whose pinned block, once moved there, stays in torch's
  host cache and is reused by the next sub-group of its size);
- one flat buffer of every gradient partition in the accumulation dtype, pinned the same way;
- transients: while the states initialise, an fp32 gradient buffer of the largest sub-group
  and the pageable source of each pinned one; while stepping, the bf16 copy of one host
  sub-group's updated masters made on the host before it goes up to the GPU;
- pinned buffers come from torch's caching host allocator, which rounds each one up to a
  power of two (`offload.pinned`): a 1.09e9-element sub-group's gradient takes 8.6 GB, not
  4.4 GB. That rounding, not a rate per parameter, is why the host bytes per parameter vary
  with the model size (bench/results/plan_memory_h100_2026-11-25b.md).

The host peak is the largest of three moments: the end of the state initialisation, the
pinning of the flat gradient buffer, and a training step; plus the process's runtime
(`DS_HOST_RUNTIME_BYTES`: CUDA, torch, DeepSpeed and its CPU Adam op on the host).
"""
from __future__ import annotations

import math

from ..config.model import ModelConfig
from ..offload import pinned
from .tensors import model_tensors

SUB_GROUP_ELEMENTS = 1e9  # DeepSpeed ZeRO-3 sub_group_size default
DS_HOST_RUNTIME_BYTES = 2.05e9  # fitted: 2.03-2.20 GB over four runs (the report named above)


def sub_groups(config: ModelConfig, tp: int, z: int,
               size: float = SUB_GROUP_ELEMENTS) -> list[int]:
    """Partition elements of each ZeRO-3 sub-group on one rank (tp shards, / z, rounded up),
    in DeepSpeed's order: the matrices' group, then the 1-D tensors' group."""
    groups, tensors = [], model_tensors(config, tp)
    for matrices in (True, False):
        elements = [math.ceil(numel / z) for numel, matrix in tensors if matrix == matrices]
        current = 0
        for i, numel in enumerate(elements):
            current += numel
            if current >= size or i == len(elements) - 1:
                groups.append(current)
                current = 0
    return groups


def zero3_cpu_offload_host(groups: list[int], ratio: float, grad_bytes: int) -> float:
    """Peak host bytes of one rank whose sub-groups are `groups` (elements), `ratio` of them
    stepped on the host, gradients accumulated in `grad_bytes` per element."""
    count = len(groups)
    on_host = [i >= int((1 - ratio) * count) for i in range(count)]
    host_elements = sum(g for g, h in zip(groups, on_host) if h)
    masters = 4 * host_elements
    free: dict[float, int] = {}  # torch's cached pinned blocks by size
    grads, init = 0.0, 0.0
    for elements, host in zip(groups, on_host):
        block = pinned(4 * elements)
        if free.get(block):
            free[block] -= 1
        else:
            grads += block
        init = max(init, grads + 4 * elements)  # the pageable source is alive while pinning
        if not host:
            free[block] = free.get(block, 0) + 1
    init += masters + 4 * max(groups)
    flat = pinned(grad_bytes * sum(groups))
    flatten = masters + grads + grad_bytes * sum(groups) + flat
    step = 12 * host_elements + grads + flat + 2 * max(
        (g for g, h in zip(groups, on_host) if h), default=0)
    return max(init, flatten, step) + DS_HOST_RUNTIME_BYTES
