"""The engine interface the training loop drives, and the result of one optimizer step.

    engine = build_engine(args, model, state)          # megazoo.training.backends
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

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...layers.fp8 import fp8_weight_cache
from ...pipeline.executor import run_pipeline
from ..lr_schedule import learning_rate


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
    """A training backend behind the one `train_step` / `eval_loss` of every engine.

    What a backend owns (and overrides): wrapping the model (its constructor), what the
    pipeline executor drives (`stage`), the backward of a micro-batch's loss (`backward`),
    the start of a step (`start_step`), finishing the gradients and their global norm
    (`finish_gradients`), the optimizer step (`step`), and `save` / `load`. Everything else,
    the micro-batch schedule (`megazoo.pipeline.executor.run_pipeline`; pp = 1 runs the
    no-pipeline schedule), the loss average and the learning-rate clock (`steps`, advanced
    only by applied steps), is here, once.
    """

    model: torch.nn.Module
    state = None
    cfg = None
    device: torch.device
    steps: int = 0
    """Optimizer steps applied (skipped ones not): the learning-rate clock."""
    cpu_offload: bool = False
    """The optimizer step runs on the host (CPU offload)."""
    checkpoint_kind: str = "megazoo"
    """What `save` writes, as `megazoo.checkpoint.output.KINDS` names it (which files in a
    checkpoint folder are the engine's own, and may be replaced)."""
    gathers_parameters: bool = False
    """Whole parameters exist only while a layer runs (ZeRO-3, FSDP2): FP8 weight casts are then
    not kept across the step's micro-batches (`fp8_weight_cache` would hold an FP8 copy of
    every weight of the stage, 2 bytes per parameter)."""

    # -- the one step ------------------------------------------------------------------------
    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> StepResult:
        lr = learning_rate(self.steps, self.cfg)
        scale = self.loss_scale()
        self.start_step(len(micro_batches), lr)
        pairs = [(b["input_ids"], b["labels"]) for b in micro_batches]
        with self._weight_casts():  # FP8 layers: each weight cast once for all micro-batches
            loss = run_pipeline(self.stage(len(micro_batches), scale), pairs, self.state,
                                dtype=self.activation_dtype(), backward=self.backward)
        loss = dp_mean(last_stage_loss(None if loss is None else loss / scale, self.state,
                                       self.device), self.state)
        norm = self.finish_gradients()
        applied = self.step(lr, norm, math.isfinite(loss))
        self.steps += int(applied)
        return StepResult(loss, norm if applied else math.nan, lr, self.reported_loss_scale(),
                          skipped=not applied)

    @torch.no_grad()
    def eval_loss(self, micro_batches: list[dict[str, torch.Tensor]]) -> float:
        """Forward-only mean loss through the pipeline schedule, averaged over dp."""
        module = self.eval_module()
        module.eval()
        pairs = [(b["input_ids"], b["labels"]) for b in micro_batches]
        with self._weight_casts():
            loss = run_pipeline(module, pairs, self.state, forward_only=True,
                                dtype=self.activation_dtype())
        return dp_mean(last_stage_loss(loss, self.state, self.device), self.state)

    def _weight_casts(self):
        return contextlib.nullcontext() if self.gathers_parameters else fp8_weight_cache()

    # -- what a backend provides -------------------------------------------------------------
    def stage(self, num_microbatches: int, loss_scale: float):
        """What the pipeline executor calls for this step (the model, or a wrapper)."""
        return self.model

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss on the last stage (already divided by m)."""
        loss.backward()

    def start_step(self, num_microbatches: int, lr: float) -> None:
        """Before the micro-batches: training mode, gradients zeroed."""
        self.model.train()

    def finish_gradients(self) -> float:
        """After the micro-batches: complete the gradients; return their global norm (of
        the unscaled gradient, each parameter of the one-process model counted once)."""
        raise NotImplementedError

    def step(self, lr: float, norm: float, loss_is_finite: bool) -> bool:
        """The optimizer step at `lr`, unless the step is skipped (non-finite loss or norm):
        return whether it was applied."""
        raise NotImplementedError

    def loss_scale(self) -> float:
        """The fp16 loss scale the step's losses are multiplied by (1.0 without one)."""
        return 1.0

    def reported_loss_scale(self) -> float | None:
        """The loss scale after the step, for the log (None without loss scaling)."""
        return None

    def activation_dtype(self) -> torch.dtype | None:
        """The dtype of activations sent between pipeline stages (None: the parameters')."""
        return None

    def eval_module(self):
        """The module evaluation runs (the model, or a wrapper that owns its forward)."""
        self.wait_params()
        return self.model

    def wait_params(self) -> None:
        """Wait for parameter updates still in flight (overlapped all-gathers)."""

    def save(self, path: str, extra: dict) -> None:
        """Write a checkpoint directory (collective: every rank calls it). When any rank's
        weights or optimizer state hold inf or nan it writes nothing and raises
        `megazoo.checkpoint.files.NonFiniteError` on every rank, naming the tensor where it
        was found (`megazoo.save_checkpoint` does this, or `refuse_nonfinite` beforehand)."""
        raise NotImplementedError

    def load(self, path: str) -> dict:
        """Restore model, optimizer, scheduler and scaler from `path`; return its `extra`."""
        raise NotImplementedError


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
