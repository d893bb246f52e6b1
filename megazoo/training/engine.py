"""The engine interface the training loop drives, and the result of one optimizer step.

    engine = build_engine(args, model, state)          # plain, DeepSpeed or FSDP2
    result = engine.train_step(micro_batches)          # one optimizer step
    loss = engine.eval_loss(micro_batches)             # no gradients, no step
    engine.save(path, extra); extra = engine.load(path)

A micro-batch is ``{"input_ids": LongTensor [b, s], "labels": LongTensor [b, s]}``, the full
sequence, the same on every tp / sp rank of a data-parallel replica (the model shards the
sequence itself); labels follow the Hugging Face convention (the model shifts them, -100 is
ignored). ``train_step`` gets the micro-batches of this data-parallel rank for one global
batch (gradient accumulation = their number) and returns the mean loss over all of them and
over the dp ranks, the same value on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..pipeline.executor import run_pipeline


@dataclass
class StepResult:
    """What one optimizer step reports (the same on every rank)."""

    loss: float
    """Mean token loss over the step's micro-batches and data-parallel ranks."""
    grad_norm: float
    """Global gradient norm before clipping (each unique parameter counted once); nan if skipped."""
    lr: float
    """Learning rate used for this step."""
    loss_scale: float | None = None
    """fp16 dynamic loss scale after the step (None without loss scaling)."""
    skipped: bool = False
    """True when the step was skipped (fp16 overflow): the weights did not change."""


class TrainingStopped(RuntimeError):
    """The run cannot go on (too many skipped steps, non-finite weights to save): one line
    for the user, exit status 1, no traceback."""


class Engine:
    """Base class of the training engines; see the module docstring."""

    model: torch.nn.Module
    cpu_offload: bool = False
    """The optimizer step runs on the host (CPU offload)."""

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> StepResult:
        raise NotImplementedError

    def eval_loss(self, micro_batches: list[dict[str, torch.Tensor]]) -> float:
        raise NotImplementedError

    def save(self, path: str, extra: dict) -> None:
        """Write a checkpoint directory (collective: every rank calls it)."""
        raise NotImplementedError

    def load(self, path: str) -> dict:
        """Restore model, optimizer, scheduler and scaler from `path`; return its `extra`."""
        raise NotImplementedError

    @torch.no_grad()
    def nonfinite_parameter(self) -> str | None:
        """The name of a parameter (this rank's part of it) holding inf / nan, else None."""
        for name, p in self.model.named_parameters():
            t = p.to_local() if hasattr(p, "to_local") else p
            if t.numel() and not bool(torch.isfinite(t).all()):
                return name
        return None


def mean_eval_loss(model, micro_batches, state, device, *, dtype=None) -> float:
    """Forward-only mean loss of `micro_batches` (through the pipeline schedule when pp > 1),
    averaged over dp; the same on every rank. The caller sets eval mode, no_grad, autocast."""
    if state.pp.size > 1:
        pairs = [(b["input_ids"], b["labels"]) for b in micro_batches]
        loss = run_pipeline(model, pairs, state, forward_only=True, dtype=dtype)
        return dp_mean(last_stage_loss(loss, state, device), state)
    total = torch.zeros((), device=device)
    for b in micro_batches:
        total += model(b["input_ids"], labels=b["labels"]).float() / len(micro_batches)
    return dp_mean(total, state)


def last_stage_loss(loss: torch.Tensor | None, state, device) -> torch.Tensor:
    """The last pipeline stage's loss on every stage, a float32 scalar on `device`.

    Stages without a loss (`None`) contribute zeros to a sum over the pp group; collective
    over pp when it has more than one rank.
    """
    out = torch.zeros((), device=device) if loss is None else \
        loss.detach().float().reshape(()).to(device)
    if state.pp.size > 1:
        dist.all_reduce(out, group=state.pp.group)
    return out


def dp_mean(loss: torch.Tensor, state) -> float:
    """A scalar loss averaged over the data-parallel ranks, as a Python float.

    Collective over dp when it has more than one rank; the caller's tensor is not modified.
    """
    loss = loss.detach().float().reshape(())
    if state.dp.size > 1:
        loss = loss.clone()
        dist.all_reduce(loss, group=state.dp.group)
        loss /= state.dp.size
    return float(loss)


def build_engine(args, model: torch.nn.Module, state) -> Engine:
    """The engine `args.zero` asks for, constructed as `Engine(model, state, args)`.

    `args` is the run's `megazoo.training.config.PretrainArgs`; `state` its ParallelState.
    zero_impl "none": `PlainEngine`; "deepspeed": `megazoo.training.zero.DeepSpeedEngine`;
    "fsdp2": `megazoo.training.fsdp.FSDP2Engine` (imported only when asked for).
    """
    zero = args.zero
    if zero.zero_impl == "deepspeed":
        from .zero import DeepSpeedEngine

        return DeepSpeedEngine(model, state, args)
    if zero.zero_impl == "fsdp2":
        from .fsdp import FSDP2Engine

        return FSDP2Engine(model, state, args)
    if zero.zero_stage not in (None, 0) or zero.offload_optimizer not in (None, "none") \
            or zero.offload_param not in (None, "none"):
        raise ValueError("--zero-stage / --offload-* need a ZeRO engine: add --deepspeed "
                         "(or --zero-impl fsdp2)")
    from .plain import PlainEngine

    return PlainEngine(model, state, args)
