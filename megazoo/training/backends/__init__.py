"""Training backends: what really differs between the engines, behind one interface
(`base.Engine`): wrapping the model, backward, finishing the gradients, the optimizer step,
save and load.

    engine = build_engine(args, model, state)     # plain, FSDP2 or DeepSpeed

- `plain`: Megatron's DDP and mixed precision (bf16 / fp16 parameters, bucketed fp32 main
  gradients reduced over dp x sp while backward runs, fp32 masters and moments, optionally
  sharded: the distributed optimizer); its parts `grad_buffer`, `master_optimizer`;
- `fsdp2`: ZeRO-3 with our pipeline schedules through PyTorch FSDP2 (`fsdp2_sharding`,
  `fsdp2_checkpoint`);
- `deepspeed_zero`: ZeRO-1/2/3 and offload through DeepSpeed (`deepspeed_setup`).
This module is the factory above them: `base` never imports a backend.
"""
from __future__ import annotations

import torch

from .base import Engine, StepResult, TrainingStopped

__all__ = ["Engine", "StepResult", "TrainingStopped", "build_engine"]


def build_engine(args, model: torch.nn.Module, state) -> Engine:
    """The engine `args.zero` asks for, constructed as `Engine(model, state, args)`.

    `args` is the run's `megazoo.config.run.PretrainArgs`; `state` its ParallelState.
    zero_impl "none": `plain.PlainEngine`; "deepspeed": `deepspeed_zero.DeepSpeedEngine`;
    "fsdp2": `fsdp2.FSDP2Engine` (each imported only when asked for).
    """
    zero, t = args.zero, args.training
    plain_only = [flag for flag, on in (
        ("--use-distributed-optimizer", t.use_distributed_optimizer),
        ("--overlap-grad-reduce", t.overlap_grad_reduce),
        ("--ddp-bucket-size", t.ddp_bucket_size is not None)) if on]
    if zero.zero_impl != "none" and plain_only:
        raise ValueError(f"{plain_only[0]} is for the plain engine; --deepspeed / --zero-impl "
                         "fsdp2 shard and reduce by themselves: drop it")
    if zero.zero_impl == "deepspeed":
        from .deepspeed_zero import DeepSpeedEngine

        return DeepSpeedEngine(model, state, args)
    if zero.zero_impl == "fsdp2":
        from .fsdp2 import FSDP2Engine

        return FSDP2Engine(model, state, args)
    if zero.zero_stage not in (None, 0) or zero.offload_optimizer not in (None, "none") \
            or zero.offload_param not in (None, "none"):
        raise ValueError("--zero-stage / --offload-* need a ZeRO engine: add --deepspeed "
                         "(or --zero-impl fsdp2)")
    from .plain import PlainEngine

    return PlainEngine(model, state, args)
