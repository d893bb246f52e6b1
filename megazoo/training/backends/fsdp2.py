"""`FSDP2Engine`: ZeRO-3 with our pipeline schedules, through PyTorch FSDP2 (`fully_shard`).

    engine = FSDP2Engine(model, state, args)       # --zero-impl fsdp2
    result = engine.train_step(micro_batches)

DeepSpeed refuses ZeRO-2/3 under pipeline parallelism; FSDP2 composes with it because each
FSDP2 unit only hooks its own forward and backward. Each pipeline rank shards its stage over
the dp x sp group (`fsdp2_sharding.shard_stage`), and `megazoo.pipeline.executor.run_pipeline`
drives the micro-batches exactly as in the plain engine.

Across micro-batches. By default (ZeRO-3 memory) each unit (two blocks, --fsdp-blocks-per-unit)
all-gathers its parameters for every micro-batch's forward and again for its backward;
--no-fsdp-reshard-after-forward keeps them from forward to backward (ZeRO-2-like memory, half
the all-gathers). Under a pipeline each unit reduce-scatters after every micro-batch's
backward by default (FSDP2 accumulates the sharded gradient: ZeRO-3 memory);
`--no-fsdp-reduce-every-microbatch`, and pp = 1 always, reduce-scatter only in each chunk's
last backward (`fsdp2_sharding.SyncOnLastMicroBatch`; unsharded gradients held meanwhile).

Precision: fp32, or bf16 compute through FSDP2's MixedPrecisionPolicy (fp32 sharded master
weights, fp32 gradient reduction). fp16 (needs loss scaling) is not supported here.
CPU offload: `CPUOffloadPolicy` keeps sharded parameters, gradients and AdamW state on the host.

Owns: the sharding of the stage, which micro-batch reduce-scatters (`stage`), the rest of
the gradient contract on the shards and the norm (`finish_gradients`), the fused AdamW step
(clipping folded into its gradient divisor; a non-finite loss or norm skips it), and the
checkpoint files (`fsdp2_checkpoint`).
"""
from __future__ import annotations

import math

import torch

from ...config.validate import check_engine
from ...parallel.state import ParallelState
from .base import Engine
from .fsdp2_sharding import SyncOnLastMicroBatch, shard_mesh, shard_stage
from ..gradients import clip_divisor, complete_sharded_gradients, global_grad_norm, local
from ..optim import build_optimizer, param_groups


def check_args(args, state: ParallelState) -> None:
    """What FSDP2 cannot run, said before any collective: the run's ZeRO checks
    (`config.validate.check_engine`: ZeRO-3 only, cpu offload only), fp16, the batch split."""
    check_engine(args.zero, args.parallel)
    cfg = args.training
    if cfg.fp16:
        raise ValueError("--zero-impl fsdp2 has no fp16 loss scaling: use --bf16, or --deepspeed")
    per_step = cfg.micro_batch_size * state.dp.size
    if cfg.global_batch_size % per_step:
        raise ValueError(f"--global-batch-size {cfg.global_batch_size} must divide by "
                         f"--micro-batch-size {cfg.micro_batch_size} x dp {state.dp.size}")


class FSDP2Engine(Engine):
    """`FSDP2Engine(model, state, args)`; `args`: `.training` (TrainingConfig), `.zero`
    (ZeroConfig: --offload-optimizer / --offload-param cpu offload both, FSDP2 has one policy)
    and `.compression` (its wire dtype is the reduce dtype)."""

    def __init__(self, model: torch.nn.Module, state: ParallelState, args):
        check_args(args, state)
        self.state, self.args, self.cfg = state, args, args.training
        zero = args.zero
        self.cpu_offload = "cpu" in (zero.offload_optimizer, zero.offload_param)
        self.reduce_every_microbatch = zero.fsdp_reduce_every_microbatch
        self.device = next(model.parameters()).device
        shard_stage(model, shard_mesh(state, self.device), device=self.device, bf16=self.cfg.bf16,
                    cpu_offload=self.cpu_offload,
                    reshard_after_forward=zero.fsdp_reshard_after_forward,
                    blocks_per_unit=zero.fsdp_blocks_per_unit,
                    reduce_dtype=args.compression.wire_dtype)
        self.model = model
        self.gathers_parameters = True
        # fused also on the host (offload): one pass over the host state
        self.optimizer = build_optimizer(param_groups(model, self.cfg.weight_decay), self.cfg,
                                         fused=True)
        self.steps = 0

    # -- the backend interface ---------------------------------------------------------------
    def stage(self, num_microbatches: int, loss_scale: float):
        """Under a pipeline with --fsdp-reduce-every-microbatch: the model (reduce-scatter in
        every micro-batch's backward); otherwise each chunk reduce-scatters in its last
        micro-batch's backward only (pp = 1: the last micro-batch)."""
        if self.state.pp.size > 1 and self.reduce_every_microbatch:
            return self.model
        return SyncOnLastMicroBatch(self.model, num_microbatches)

    def start_step(self, num_microbatches: int, lr: float) -> None:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)

    def finish_gradients(self) -> float:
        self.model.set_requires_gradient_sync(True)  # back to the default for the next step
        complete_sharded_gradients(self.model, self.state)
        return global_grad_norm(self.model, self.state)

    def step(self, lr: float, norm: float, loss_is_finite: bool) -> bool:
        if not (loss_is_finite and math.isfinite(norm)):
            self.optimizer.zero_grad(set_to_none=True)
            return False
        # clipping folded into the fused AdamW kernel, which divides every gradient by the
        # optimizer's `grad_scale` (as torch's GradScaler sets it): one pass over them fewer
        divisor = clip_divisor(norm, self.cfg.clip_grad)
        device = local(next(self.model.parameters())).device
        self.optimizer.grad_scale = torch.tensor(divisor, device=device) if divisor != 1.0 else None
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        return True

    def activation_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.cfg.bf16 else torch.float32

    def save(self, path: str, extra: dict) -> None:
        from .fsdp2_checkpoint import save_fsdp

        save_fsdp(self, path, extra)

    def load(self, path: str) -> dict:
        from .fsdp2_checkpoint import load_fsdp

        return load_fsdp(self, path)
