"""Which optimizer the plain engine's masters and moments live in: `MasterAdamW` (all on the
GPU, fp32 main gradients), `OffloadAdamW` (a share on the host / disk, or bf16 main
gradients), or `DelayedOffloadAdamW` (the host share one step late)."""
from __future__ import annotations

from torch import nn

from ...plan.offload import check_nvme_path
from ...config.offload import OffloadPlan
from .delayed_offload import DelayedOffloadAdamW
from .grad_buffer import GradBuffer
from .master_optimizer import MasterAdamW
from .offload_optimizer import OffloadAdamW


def build_master_optimizer(model: nn.Module, buffers: GradBuffer, cfg, plan: OffloadPlan | None,
                           initial: dict | None = None):
    """`MasterAdamW`, or `OffloadAdamW` for an offload plan or bf16 main gradients (all on the
    GPU then: it upcasts each bucket's gradient to fp32 before the step). `initial`: the fp32
    values the masters start from (`lean_build.initial_values`; None: the flat buffer)."""
    if plan is None and cfg.accumulate_grads_in_bf16:
        plan = OffloadPlan(fraction=0.0, overlap=False)
    if plan is None:
        return MasterAdamW(model, buffers, cfg, overlap_param_gather=cfg.overlap_param_gather)
    if plan.nvme_path is not None:
        check_nvme_path(plan.nvme_path)
    if plan.delayed:
        return DelayedOffloadAdamW(model, buffers, cfg, plan, initial=initial,
                                   overlap_param_gather=cfg.overlap_param_gather)
    return OffloadAdamW(model, buffers, cfg, plan, overlap_param_gather=cfg.overlap_param_gather,
                        initial=initial)
