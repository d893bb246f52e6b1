"""Training backends behind one interface (`base.Engine`): what really differs between the
engines (wrapping the model, backward, finishing the gradients, the optimizer step, save and
load). `build_engine` picks one: `plain` (Megatron's DDP and distributed optimizer, with
optimizer offload), `fsdp2` (ZeRO-3 under our pipeline schedules) or `deepspeed_zero`
(ZeRO-1/2/3 and offload through DeepSpeed); `base` never imports a backend.
"""
from __future__ import annotations

import torch

from ...config.ds_config import check_json_training_keys
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
    check_json_training_keys(args, state.dp.size)  # what build_ds_config checks for DeepSpeed
    if zero.zero_impl == "fsdp2":
        from .fsdp2 import FSDP2Engine

        return FSDP2Engine(model, state, args)
    if zero.zero_stage not in (None, 0):
        raise ValueError("--zero-stage needs a ZeRO engine: add --deepspeed (or --zero-impl "
                         "fsdp2); the plain engine offloads with --offload-optimizer alone")
    from .plain import PlainEngine

    return PlainEngine(model, state, args)
