"""`PlainEngine`: Megatron's data parallelism and mixed precision, with tp / sp / pp from the
model itself.

Owns: the model's dtype (bf16 / fp16 parameters, or fp32), the flat parameter and fp32
main-gradient buffers in buckets (`grad_buffer.GradBuffer`: reduced over dp x sp, overlapped
with backward under --overlap-grad-reduce, reduce-scattered under
--use-distributed-optimizer), the fp32 masters and AdamW moments (`master_optimizer`), the
fp16 loss scaler, and the checkpoint files (fp32 masters and moments, one format at any
dp / tp / pp and with or without the distributed optimizer).

One `train_step`: the micro-batches through the pipeline executor (pp = 1 runs the
no-pipeline schedule), each loss scaled by 1/m (times the fp16 loss scale); backward hooks
accumulate into the main gradients and launch bucket reductions; then the tied-embedding
sum, the wait for what is in flight, the global norm from the flat buffer (one multi-tensor
kernel), the skip decision (a non-finite loss or norm skips the step in every precision;
fp16 also backs the loss scale off), and the fused AdamW step whose gradient divisor folds
in the loss scale and the clipping factor. Skipped steps do not advance the lr clock.
"""
from __future__ import annotations

import math

import torch

from ..parallel.state import ParallelState
from ..pipeline.executor import run_pipeline
from .config import PretrainArgs
from .engine import Engine, StepResult, dp_mean, last_stage_loss, mean_eval_loss
from .grad_buffer import GradBuffer
from .gradients import (clip_divisor, counted_flat_ranges, flat_grad_norm,
                        hook_sequence_parallel_grads, intersect, sum_tied_embedding,
                        tied_embedding_weight)
from .lr_schedule import learning_rate
from .master_optimizer import MOMENTS, MasterAdamW
from .scaler import DynamicLossScaler

AUX_PREFIXES = MOMENTS


class _ScaledLossStage:
    """The model as `run_pipeline` sees it, with the last stage's loss multiplied by `scale`
    (fp16 loss scaling inside the pipeline's own backward)."""

    def __init__(self, model, scale: float):
        self._model, self._scale = model, scale

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, *args, **kwargs):
        out = self._model(*args, **kwargs)
        if kwargs.get("labels") is not None or (len(args) > 1 and args[1] is not None):
            if out.dim() == 0:
                return out * self._scale
        return out


def model_dtype(cfg) -> torch.dtype:
    return torch.bfloat16 if cfg.bf16 else torch.float16 if cfg.fp16 else torch.float32


class PlainEngine(Engine):
    """`PlainEngine(model, state, config)` (config: PretrainArgs); the model arrives in fp32
    and is cast to the run's dtype here (the masters keep the fp32 initial values)."""

    def __init__(self, model: torch.nn.Module, state: ParallelState, config: PretrainArgs):
        self.model, self.state, self.config = model, state, config
        cfg = self.cfg = config.training
        self._sp_hooks = hook_sequence_parallel_grads(model, state)
        tied = tied_embedding_weight(model, state)
        bucket = cfg.ddp_bucket_size or max(40_000_000, 1_000_000 * state.dp_sp.size)
        self.buffers = GradBuffer(model, state, bucket_numel=bucket, overlap=cfg.overlap_grad_reduce,
                                  shard=cfg.use_distributed_optimizer,
                                  deferred=() if tied is None else (tied,))
        self.optimizer = MasterAdamW(model, self.buffers, cfg,
                                     overlap_param_gather=cfg.overlap_param_gather)
        self.buffers.cast_params(model_dtype(cfg))
        counted = counted_flat_ranges([(p, self.buffers.offsets[id(p)]) for p in self.buffers.params],
                                      state)
        owned = intersect(counted, self.buffers.shard_ranges())
        self.norm_views = [self.buffers.main_grad[lo:hi] for lo, hi in owned]
        self.scaler = (DynamicLossScaler(cfg.initial_loss_scale, cfg.loss_scale_window,
                                         cfg.min_loss_scale) if cfg.fp16 else None)
        self.steps = 0  # optimizer steps taken (skipped ones not): the lr clock
        self.device = next(model.parameters()).device

    def _forward_backward(self, micro_batches, scale: float) -> torch.Tensor:
        """Mean loss over the micro-batches (unscaled; this replica, every stage)."""
        pairs = [(b["input_ids"], b["labels"]) for b in micro_batches]
        stage = _ScaledLossStage(self.model, scale) if scale != 1.0 else self.model
        loss = run_pipeline(stage, pairs, self.state)
        loss = (loss / scale) if loss is not None else None
        return last_stage_loss(loss, self.state, self.device)

    def _finish_gradients(self) -> None:
        self.buffers.finish(lambda: sum_tied_embedding(self.model, self.state,
                                                       grad_of=lambda w: w.main_grad))

    def train_step(self, micro_batches) -> StepResult:
        self.model.train()
        lr = learning_rate(self.steps, self.cfg)
        scale = self.scaler.scale if self.scaler else 1.0
        self.buffers.start_step(len(micro_batches))
        loss = self._forward_backward(micro_batches, scale)
        self._finish_gradients()
        loss = dp_mean(loss, self.state)
        norm = flat_grad_norm(self.norm_views, self.state, self.buffers.shard) / scale
        finite = math.isfinite(norm) and math.isfinite(loss)
        if self.scaler is not None:
            self.scaler.update(not finite)
        loss_scale = self.scaler.scale if self.scaler else None
        if not finite:
            return StepResult(loss, math.nan, lr, loss_scale, skipped=True)
        self.optimizer.step(lr, scale * clip_divisor(norm, self.cfg.clip_grad))
        self.steps += 1
        return StepResult(loss, norm, lr, loss_scale)

    @torch.no_grad()
    def eval_loss(self, micro_batches) -> float:
        self.optimizer.wait_params()
        self.model.eval()
        return mean_eval_loss(self.model, micro_batches, self.state, self.device)

    @torch.no_grad()
    def nonfinite_parameter(self) -> str | None:
        """One check over the flat fp32 masters (this rank's shard), then the name."""
        if bool(torch.isfinite(self.optimizer.master).all()):
            return None
        return super().nonfinite_parameter() or "an fp32 master weight"

    # -- checkpoints: the fp32 masters and moments, full tensors per parameter --------------
    def _as_params(self, flat: torch.Tensor) -> dict:
        """{name: view of the full flat tensor shaped like the parameter}."""
        return {n: self.buffers.view(flat, p) for n, p in self.model.named_parameters()}

    def _swap_params(self, flat: torch.Tensor | None, saved: dict | None = None) -> dict:
        """Point the parameters at views of `flat` (None: back to `saved`); return the old."""
        old = {}
        for n, p in self.model.named_parameters():
            old[n] = p.data
            p.data = saved[n] if flat is None else self.buffers.view(flat, p)
        return old

    def save(self, path: str, extra: dict) -> None:
        from ..checkpoint import save_checkpoint

        full = self.optimizer.full_state()
        aux = {k: self._as_params(full[k]) for k in MOMENTS}
        engine = {"steps": self.steps, "adam_step": self.optimizer.adam_step,
                  "scaler": self.scaler.state_dict() if self.scaler else None}
        old = self._swap_params(full["master"])
        try:
            save_checkpoint(self.model, path, state=self.state,
                            extra={**extra, "engine": engine}, aux=aux)
        finally:
            self._swap_params(None, old)

    def load(self, path: str) -> dict:
        from ..checkpoint import load_model_weights
        from ..checkpoint.load import CheckpointReader

        # Weights-only checkpoints (converted from HF, say) start a fresh optimizer.
        stored = set(CheckpointReader(path).aux_prefixes)
        prefixes = AUX_PREFIXES if stored.issuperset(AUX_PREFIXES) else ()
        self.optimizer.wait_params()
        master = torch.zeros(self.buffers.numel, dtype=torch.float32, device=self.device)
        old = self._swap_params(master)
        try:
            meta, aux = load_model_weights(self.model, path, state=self.state,
                                           aux_prefixes=prefixes)
        finally:
            self._swap_params(None, old)
        extra = meta.get("extra") or {}
        engine = extra.get("engine", {})
        self.steps = int(engine.get("steps", 0))
        step = int(engine.get("adam_step", 0))
        full = {"master": master}
        if step > 0 and prefixes:
            for k in MOMENTS:
                full[k] = torch.zeros_like(master)
                views = self._as_params(full[k])
                for name, t in aux[k].items():
                    views[name].copy_(t)
        self.optimizer.load_full_state(full, step if len(full) > 1 else 0)
        if self.scaler is not None and engine.get("scaler"):
            self.scaler.load_state_dict(engine["scaler"])
        return extra
