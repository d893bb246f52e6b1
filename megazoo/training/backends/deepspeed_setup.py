"""What `DeepSpeedEngine` prepares before `deepspeed.initialize`: groups, tags, hooks, AdamW.

- `ZeroMPU`: `DeepSpeedMPU` whose one-rank groups are real one-rank process groups
  (`ParallelState` stores `group=None` for them, which DeepSpeed reads as the *world* group:
  at tp=2, dp=1 it would partition ZeRO state over the two tp ranks). Its "data parallel"
  group is our dp x sp group (its size stays dp): ZeRO-3 partitions parameters over that
  group but reduces their gradients over the sequence-data-parallel one, so both must be
  dp x sp for Ulysses (DeepSpeed's own Ulysses mpu has world = dp x sp).
- `tag_tensor_parallel`: DeepSpeed counts a parameter in the gradient norm on every tp rank
  only when it carries `tensor_model_parallel=True` (else only on tp rank 0).
- Megatron-SP parameters are summed over tp by `gradients.hook_sequence_parallel_grads`
  (tensor hooks run before accumulation into `.grad`, so before DeepSpeed's reduction).
"""
from __future__ import annotations

import logging
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from ...config.ds_config import offload_device
from ...layers.sharding import tp_dim_of
from ...parallel.mpu import _NAMES, DeepSpeedMPU
from ...parallel.state import ParallelState
from ..optim import build_optimizer as torch_adamw, param_groups
from ..ds_ops import before_build, needed_ops
from .fsdp2_sharding import one_rank_groups

log = logging.getLogger(__name__)


class ZeroMPU(DeepSpeedMPU):
    """`DeepSpeedMPU` with a real process group for every one-rank group (see module doc)."""

    def __init__(self, state: ParallelState):
        super().__init__(state)
        # a world of one rank is its own group; else collective (every rank makes every one)
        self._self_group = one_rank_groups(state) if state.world_size > 1 else dist.group.WORLD

    def group_of(self, attr: str):
        info = getattr(self.state, attr)
        return info.group if info.group is not None else self._self_group

    def get_data_parallel_group_ranks(self):
        return list(self.state.dp.ranks)


for _prefix, _attr in {**_NAMES, "data_parallel": "dp_sp"}.items():
    setattr(ZeroMPU, f"get_{_prefix}_group", lambda self, _a=_attr: self.group_of(_a))


def init_one_rank_group() -> None:
    """A one-rank torch.distributed group (in-memory store: no port, no file) and the
    LOCAL_RANK DeepSpeed insists on. DeepSpeed and FSDP2 need torch.distributed even in a
    plain one-process run with no launcher."""
    os.environ.setdefault("LOCAL_RANK", "0")
    dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1)


def ensure_process_group(state: ParallelState) -> None:
    """A one-rank group when none exists (a plain `python pretrain_gpt.py --deepspeed`, or
    the engine built directly)."""
    if dist.is_initialized():
        return
    if state.world_size > 1:
        raise ValueError("torch.distributed is not initialised but the state has "
                         f"{state.world_size} ranks: build the ParallelState after init")
    init_one_rank_group()


def check_nvme(ds: dict) -> None:
    """NVMe offload needs DeepSpeed's async_io op (libaio): say so before any collective."""
    if "async_io" not in needed_ops(ds):
        return
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible(verbose=False):
        raise ValueError("nvme offload needs DeepSpeed's async_io op, which cannot build here "
                         "(install libaio-dev, e.g. apt-get install libaio-dev), or offload to cpu")


def tag_tensor_parallel(model: nn.Module, state: ParallelState) -> None:
    """Mark tp shards `tensor_model_parallel` for DeepSpeed's gradient norm."""
    for p in model.parameters():
        p.tensor_model_parallel = state.tp.size > 1 and tp_dim_of(p) is not None
        index = getattr(p, "tp_index", None)
        if index is not None and state.tp.size > 1 and \
                sum(len(index(r)) for r in range(state.tp.size)) > p.tp_full_size:
            log.warning("a GQA parameter with kv rows replicated over tp: DeepSpeed's "
                        "gradient norm counts those rows once per holder")


def cpu_adam_available() -> bool:
    """Whether DeepSpeedCPUAdam's C++ op loads (JIT-builds with g++ on first use, announced
    on rank 0; a stale build lock is a ValueError naming it)."""
    rank0 = os.environ.get("RANK", "0") == "0"
    before_build("cpu_adam", lambda text: print(text, file=sys.stderr, flush=True) if rank0 else None)
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        CPUAdamBuilder().load(verbose=False)
        return True
    except Exception as exc:  # no compiler, wrong toolchain, missing headers
        log.warning("DeepSpeedCPUAdam unavailable (%s); using torch AdamW", exc)
        return False


def build_optimizer(model: nn.Module, training, ds: dict, cpu_adam: bool | None = None):
    """AdamW over `param_groups`; DeepSpeedCPUAdam when the optimizer is offloaded.

    `cpu_adam` None: use it when offloading and it loads. Mutates `ds` when falling back to
    torch AdamW under offload (DeepSpeed refuses a foreign optimizer there by default)."""
    groups = param_groups(model, training.weight_decay)
    offload = offload_device(ds) != "none"
    if cpu_adam is None:
        cpu_adam = offload and cpu_adam_available()
    if cpu_adam:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, adamw_mode=True, lr=training.lr,
                                betas=(training.adam_beta1, training.adam_beta2),
                                eps=training.adam_eps)
    if offload:
        ds["zero_force_ds_cpu_optimizer"] = False
    return torch_adamw(groups, training, foreach=False)


def use_accelerator_of(device: torch.device) -> None:
    """Point DeepSpeed at the accelerator of `device` (CPU models: its CPU accelerator)."""
    from deepspeed.accelerator import get_accelerator, set_accelerator

    if device.type == "cpu" and get_accelerator().device_name() != "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        set_accelerator(CPU_Accelerator())
    elif device.type != "cpu" and get_accelerator().device_name() == "cpu":
        raise ValueError(f"the model is on {device} but DeepSpeed selected its CPU accelerator: "
                         "unset DS_ACCELERATOR=cpu or build the model on the CPU")
