"""`PlainEngine`: Megatron's data parallelism and mixed precision, with tp / sp / pp from the
model itself.

Owns: the model's dtype (bf16 / fp16 parameters, or fp32); the flat parameter and main-
gradient buffers in buckets (`grad_buffer.GradBuffer`; under --gradient-accumulation-fusion
the parallel linears' weight-gradient GEMMs accumulate into them, `megazoo.layers.wgrad`);
the fp32 masters and AdamW moments (`master_optimizer.MasterAdamW`, or
`offload_optimizer.OffloadAdamW` for optimizer offload, `config.offload.plain_offload`, and
bf16 main gradients); the fp16 loss scaler; and the checkpoint files (fp32 masters and
moments, one format at any layout, with or without the distributed optimizer).

Its part of the one `Engine.train_step`: the losses scaled by the fp16 loss scale (`stage`);
`finish_gradients` sums the tied embedding, waits for the bucket reductions and takes the
global norm from the flat buffer; `step` skips on a non-finite loss or norm (fp16 also backs
the loss scale off), else runs AdamW with the loss scale and the clipping factor folded into
its gradient divisor.
"""
from __future__ import annotations

import math

import torch

from ...config.run import PretrainArgs
from ...layers.linear import fusable_weights
from ...compress import Reducer
from ...parallel.state import ParallelState
from .base import Engine
from .grad_buffer import GradBuffer
from .lean_build import initial_values
from ...parallel.device import local_device
from ..gradients import (clip_divisor, counted_flat_ranges, flat_grad_norm,
                        intersect, sum_tied_embedding,
                        tied_embedding_weight)
from .delayed_offload import DelayedOffloadAdamW
from .master_optimizer import MOMENTS, MasterAdamW
from .offload_optimizer import OffloadAdamW
from ...config.offload import OffloadPlan, plain_offload
from ...offload.checks import check_nvme_path
from ..scaler import DynamicLossScaler


class _ScaledLossStage:
    """The model as `run_pipeline` sees it, with the last stage's loss multiplied by `scale`
    (fp16 loss scaling inside the pipeline's own backward)."""

    def __init__(self, model, scale: float):
        self._model, self._scale = model, scale

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, *args, **kwargs):
        out = self._model(*args, **kwargs)
        if out is not None and out.dim() == 0:  # the loss (only a call with labels gives one)
            return out * self._scale
        return out


def build_master_optimizer(model, buffers: GradBuffer, cfg, plan: OffloadPlan | None,
                           initial: dict | None = None):
    """`MasterAdamW`, or `OffloadAdamW` (`DelayedOffloadAdamW` under --offload-delayed-update)
    for an offload plan or bf16 main gradients (all on the GPU then: it upcasts each bucket's
    gradient to fp32 before the step). `initial`: the fp32 values the masters start from
    (`lean_build.initial_values`; None: the flat buffer)."""
    if plan is None and not cfg.accumulate_grads_in_bf16:
        return MasterAdamW(model, buffers, cfg)
    plan = plan or OffloadPlan(fraction=0.0, overlap=False)
    if plan.nvme_path is not None:
        check_nvme_path(plan.nvme_path)
    kind = DelayedOffloadAdamW if plan.delayed else OffloadAdamW
    return kind(model, buffers, cfg, plan, initial=initial)


def model_dtype(cfg) -> torch.dtype:
    return torch.bfloat16 if cfg.bf16 else torch.float16 if cfg.fp16 else torch.float32


class PlainEngine(Engine):
    """`PlainEngine(model, state, config)` (config: PretrainArgs); the model arrives in fp32
    and is cast to the run's dtype here (the masters keep the fp32 initial values)."""

    def __init__(self, model: torch.nn.Module, state: ParallelState, config: PretrainArgs):
        self.model, self.state, self.config = model, state, config
        cfg = self.cfg = config.training
        tied = tied_embedding_weight(model, state)
        bucket = cfg.bucket_elements(state.dp_sp.size)
        # the bucket reduction, dense or compressed (megazoo.compress)
        self.reducer = Reducer(state, config.compression, cfg)
        self.offload = plain_offload(config)
        self.cpu_offload = self.offload is not None
        bf16_grads = cfg.accumulate_grads_in_bf16
        fuse = cfg.gradient_accumulation_fusion and not (bf16_grads and config.model.fp8_format)
        # offload overlap: each bucket's gradient leaves as soon as it is final
        overlap = cfg.overlap_grad_reduce or bool(self.offload and self.offload.overlap)
        initial = initial_values(model, config)  # the masters come from these
        lean = dict(device=local_device(), dtype=model_dtype(cfg)) if initial else {}
        self.buffers = GradBuffer(model, state, bucket_numel=bucket, overlap=overlap,
                                  shard=cfg.use_distributed_optimizer,
                                  deferred=() if tied is None else (tied,),
                                  reducer=self.reducer,
                                  fused=fusable_weights(model) if fuse else (),
                                  grad_dtype=torch.bfloat16 if bf16_grads else torch.float32,
                                  **lean)
        self.resume_notes: list[str] = []
        self.optimizer = build_master_optimizer(model, self.buffers, cfg, self.offload, initial)
        self.buffers.cast_params(model_dtype(cfg))
        offsets = self.buffers.offsets
        counted = counted_flat_ranges([(p, offsets[id(p)]) for p in self.buffers.params], state)
        owned = intersect(counted, self.buffers.shard_ranges())
        self.norm_views = [self.buffers.main_grad[lo:hi] for lo, hi in owned]
        self.scaler = (DynamicLossScaler(cfg.initial_loss_scale, cfg.loss_scale_window,
                                         cfg.min_loss_scale) if cfg.fp16 else None)
        self.steps, self._scale = 0, 1.0
        self.device = next(model.parameters()).device

    # -- the backend interface ---------------------------------------------------------------
    def stage(self, num_microbatches: int, loss_scale: float):
        return _ScaledLossStage(self.model, loss_scale) if loss_scale != 1.0 else self.model

    def start_step(self, num_microbatches: int, lr: float) -> None:
        self.model.train()
        self._scale = self.loss_scale()
        if isinstance(self.optimizer, OffloadAdamW):
            self.optimizer.start_step()
        self.buffers.start_step(num_microbatches)
        self.reducer.start_step(self.steps, self.optimizer, self._scale)

    def finish_gradients(self) -> float:
        """Tied-embedding sum, the buckets still to reduce, then the norm from the flat buffer
        (divided by the fp16 loss scale)."""
        self.buffers.finish(lambda: sum_tied_embedding(self.model, self.state,
                                                       grad_of=lambda w: w.main_grad))
        return flat_grad_norm(self.norm_views, self.state, self.buffers.shard) / self._scale

    def step(self, lr: float, norm: float, loss_is_finite: bool) -> bool:
        """Fused AdamW on the fp32 masters, its gradient divisor the loss scale times the
        clipping factor; a non-finite loss or norm skips it (and backs the fp16 scale off)."""
        ok = loss_is_finite and math.isfinite(norm)
        if self.scaler is not None:
            self.scaler.update(not ok)
        if ok:
            self.reducer.optimizer_step(self.optimizer, lr, self._scale,
                                        clip_divisor(norm, self.cfg.clip_grad), self.steps)
        else:
            self.reducer.skip_step()
        return ok

    def comm_stats(self) -> dict:
        return self.reducer.comm_stats()

    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler else 1.0

    def reported_loss_scale(self) -> float | None:
        return self.scaler.scale if self.scaler else None

    def wait_params(self) -> None:
        self.optimizer.wait_params()

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
        from ...checkpoint import save_checkpoint

        full = self.optimizer.full_state()
        aux = {k: self._as_params(full[k]) for k in MOMENTS}
        engine = {"steps": self.steps, "adam_step": self.optimizer.adam_step,
                  "scaler": self.scaler.state_dict() if self.scaler else None}
        compression, rank_files = self.reducer.checkpoint(self.state.global_rank)
        if compression is not None:
            engine["compression"] = compression
        old = self._swap_params(full["master"])
        try:
            save_checkpoint(self.model, path, state=self.state, rank_files=rank_files,
                            extra={**extra, "engine": engine}, aux=aux)
        finally:
            self._swap_params(None, old)

    def load(self, path: str) -> dict:
        from ...checkpoint import load_model_weights
        from ...checkpoint.load import CheckpointReader
        from ..run_checks import read_options

        # Weights-only checkpoints (converted from HF, say) start a fresh optimizer (this
        # reader only looks at the metadata; load_model_weights checks the tensors).
        stored = set(CheckpointReader(path, verify_checksums=False).aux_prefixes)
        prefixes = MOMENTS if stored.issuperset(MOMENTS) else ()
        self.optimizer.wait_params()
        master = torch.zeros(self.buffers.numel, dtype=torch.float32,
                             device=getattr(self.optimizer, "state_device", self.device))
        old = self._swap_params(master)
        try:
            meta, aux = load_model_weights(self.model, path, state=self.state,
                                           aux_prefixes=prefixes, **read_options(self.config))
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
        self.resume_notes = self.reducer.load(path, engine.get("compression"),
                                              self.state.global_rank, self.device,
                                              **read_options(self.config))
        return extra
