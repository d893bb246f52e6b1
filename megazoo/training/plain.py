"""`PlainEngine`: data parallel by all-reduce, with tp / sp / pp from the model itself.

One `train_step` = forward/backward over the step's micro-batches (pp = 1: a loop, each loss
scaled by 1/m; pp > 1: `megazoo.pipeline.executor.run_pipeline`), then
`allreduce_gradients` (dp mean, sp sum, Megatron-SP and tied-embedding sums), the fp16
overflow check (every rank skips together), the global-norm clip, the learning rate of this
step and AdamW.

Precision: weights, gradients and AdamW moments are fp32 in every mode; bf16 / fp16 run the
forward and backward under `torch.autocast`. So the fp32 weights *are* the master weights:
no second copy to keep in sync, checkpoints and resharding see one dtype, and the other
engines (DeepSpeed, FSDP2) receive the same fp32 model. The cost is fp32 weights in memory
(4 bytes per parameter instead of 2 + 4 split across a bf16 model and fp32 masters, which
matters only for models that do not fit anyway without ZeRO).
"""
from __future__ import annotations

import contextlib
import math

import torch

from ..models.params import allreduce_gradients
from ..parallel.state import ParallelState
from ..pipeline.executor import run_pipeline
from .config import PretrainArgs
from .engine import Engine, StepResult, dp_mean, last_stage_loss, mean_eval_loss
from .optim import build_optimizer, clip_gradients, global_grad_norm
from .scaler import DynamicLossScaler
from .schedule import learning_rate

AUX_PREFIXES = ("exp_avg", "exp_avg_sq")


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


class PlainEngine(Engine):
    """Plain data-parallel engine: `PlainEngine(model, state, config)` (config: PretrainArgs)."""

    def __init__(self, model: torch.nn.Module, state: ParallelState, config: PretrainArgs):
        self.model, self.state, self.config = model, state, config
        self.cfg = config.training
        self.optimizer = build_optimizer(model, self.cfg)
        self.scaler = (DynamicLossScaler(self.cfg.initial_loss_scale, self.cfg.loss_scale_window,
                                         self.cfg.min_loss_scale) if self.cfg.fp16 else None)
        self.steps = 0  # optimizer steps taken (fp16-skipped ones not, as in Megatron): the schedule's clock
        self.device = next(model.parameters()).device

    # -- forward / backward -------------------------------------------------------------
    def autocast(self):
        dtype = torch.bfloat16 if self.cfg.bf16 else torch.float16 if self.cfg.fp16 else None
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def _forward_backward(self, micro_batches, scale: float) -> torch.Tensor:
        """Mean loss over the micro-batches (unscaled; this replica, every stage)."""
        m = len(micro_batches)
        if self.state.pp.size > 1:
            pairs = [(b["input_ids"], b["labels"]) for b in micro_batches]
            stage = _ScaledLossStage(self.model, scale) if scale != 1.0 else self.model
            with self.autocast():
                loss = run_pipeline(stage, pairs, self.state)
            loss = (loss / scale) if loss is not None else None
            return last_stage_loss(loss, self.state, self.device)
        total = torch.zeros((), device=self.device)
        for b in micro_batches:
            with self.autocast():
                loss = self.model(b["input_ids"], labels=b["labels"])
            (loss.float() * (scale / m)).backward()
            total += loss.detach().float() / m
        return total

    # -- Engine interface ---------------------------------------------------------------
    def train_step(self, micro_batches) -> StepResult:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        lr = learning_rate(self.steps, self.cfg)
        scale = self.scaler.scale if self.scaler else 1.0
        loss = dp_mean(self._forward_backward(micro_batches, scale), self.state)
        allreduce_gradients(self.model, self.state)
        if self.scaler is not None:
            found_inf = self.scaler.unscale_and_check(self.model)
            self.scaler.update(found_inf)
            if found_inf:
                self.optimizer.zero_grad(set_to_none=True)
                return StepResult(loss, math.nan, lr, self.scaler.scale, skipped=True)
        norm = global_grad_norm(self.model, self.state)
        clip_gradients(self.model, norm, self.cfg.clip_grad)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.steps += 1
        return StepResult(loss, norm, lr, self.scaler.scale if self.scaler else None)

    @torch.no_grad()
    def eval_loss(self, micro_batches) -> float:
        self.model.eval()
        with self.autocast():
            return mean_eval_loss(self.model, micro_batches, self.state, self.device)

    def save(self, path: str, extra: dict) -> None:
        from ..checkpoint import save_checkpoint

        named = dict(self.model.named_parameters())
        aux = {prefix: {} for prefix in AUX_PREFIXES}
        for name, p in named.items():
            st = self.optimizer.state.get(p, {})
            for prefix in AUX_PREFIXES:
                aux[prefix][name] = st[prefix] if prefix in st else torch.zeros_like(p)
        engine = {"steps": self.steps, "adam_step": self._adam_step(),
                  "scaler": self.scaler.state_dict() if self.scaler else None}
        save_checkpoint(self.model, path, state=self.state, extra={**extra, "engine": engine},
                        aux=aux)

    def _adam_step(self) -> int:
        for st in self.optimizer.state.values():
            return int(st["step"])
        return 0

    def load(self, path: str) -> dict:
        from ..checkpoint import load_model_weights

        from ..checkpoint.load import CheckpointReader
        from .run_checks import read_options

        # Weights-only checkpoints (converted from HF, say) start a fresh optimizer.
        stored = set(CheckpointReader(path).aux_prefixes)
        prefixes = AUX_PREFIXES if stored.issuperset(AUX_PREFIXES) else ()
        meta, aux = load_model_weights(self.model, path, state=self.state, aux_prefixes=prefixes,
                                       **read_options(self.config))
        extra = meta.get("extra") or {}
        engine = extra.get("engine", {})
        self.steps = int(engine.get("steps", 0))
        step = int(engine.get("adam_step", 0))
        if step > 0 and prefixes:
            for name, p in self.model.named_parameters():
                self.optimizer.state[p] = {
                    "step": torch.tensor(float(step)),
                    "exp_avg": aux["exp_avg"][name].to(p.device, p.dtype).contiguous(),
                    "exp_avg_sq": aux["exp_avg_sq"][name].to(p.device, p.dtype).contiguous()}
        if self.scaler is not None and engine.get("scaler"):
            self.scaler.load_state_dict(engine["scaler"])
        return extra
