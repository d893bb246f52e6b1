"""fp32 master parameters and AdamW moments over this rank's shard of a `GradBuffer`.

    opt = MasterAdamW(model, buffers, training_config)
    opt.step(lr, grad_divisor)        # AdamW on the fp32 shard, then masters -> model params
    opt.wait_params()                 # (overlapped gather) before touching the parameters

Megatron's `Float16OptimizerWithFloat16Params` / distributed optimizer semantics: the model's
parameters are views of the flat parameter buffer; the fp32 masters are a copy of it, or of
this rank's shard of every bucket with `buffers.shard` (1/(dp x sp) of masters and moments
each), or, in fp32 without sharding, the buffer itself. AdamW is torch's fused kernel over
"pieces" (each parameter's part of the owned ranges, as views of the flat master, moment and
main-gradient buffers): one multi-tensor kernel family per step, weight decay still per
parameter, `grad_divisor` (loss scale times clipping factor) applied inside. After the step
the masters are copied into the parameter buffer and, with sharding, each bucket is
all-gathered over dp x sp, at once or (`overlap_param_gather`) asynchronously, waited for by
a forward pre-hook of the modules whose forward reads the bucket's parameters
(`hook_bucket_waits`).

Checkpoints hold full fp32 tensors per parameter (`full_state` gathers the shards), so the
files are the same with or without sharding and load at any dp.
"""
from __future__ import annotations

import torch
from torch import nn

from ...parallel.collectives import all_gather_flat
from .grad_buffer import GradBuffer
from ..optim import build_optimizer

MOMENTS = ("exp_avg", "exp_avg_sq")


def _pieces(buffers: GradBuffer) -> list[tuple[torch.Tensor, int, int, int]]:
    """(parameter, flat lo, flat hi, shard offset) of each parameter's owned part."""
    out, shard_pos = [], 0
    for (lo, hi), bucket in zip(buffers.shard_ranges(), buffers.buckets):
        out += [(p, a, b, shard_pos + a - lo) for p, a, b in buffers.pieces(bucket, lo, hi)]
        shard_pos += hi - lo
    return out


def hook_bucket_waits(model: nn.Module, buffers: GradBuffer, wait) -> None:
    """Forward pre-hooks that call `wait(indices)` (bucket indices, in forward order) before a
    module reads parameters of `buffers` whose new values arrive asynchronously (an
    all-gather, or the offloaded optimizer's copy up).

    A module's forward may read its children's parameters without calling them (the fused
    GeLU MLP reads fc1 and fc2, the embedding's check-free lookup reads the word embedding),
    so every module below `model` waits for the buckets of its whole subtree; `model` itself
    for its own parameters (its forward calls the head as a module, so no weight is read
    past a hook). Waiting is per top-level block at the finest, and never too late."""
    bucket_of = {id(p): b.index for b in buffers.buckets for p in b.params}
    for module in model.modules():
        params = module.parameters(recurse=module is not model)
        indices = sorted({bucket_of[id(p)] for p in params if id(p) in bucket_of},
                         reverse=True)  # (the forward uses the highest index first)
        if indices:
            module.register_forward_pre_hook(lambda _m, _a, ix=tuple(indices): wait(ix))


class MasterAdamW:
    """See the module docstring. `cfg`: TrainingConfig (weight_decay, adam_*, lr)."""

    def __init__(self, model: nn.Module, buffers: GradBuffer, cfg):
        self.buffers, self.cfg = buffers, cfg
        self.ranges = buffers.shard_ranges()
        data = buffers.param_data
        alias = not buffers.shard and data.dtype == torch.float32
        self.master = data if alias else self._to_shard(data.float())
        self.moments = {k: torch.zeros_like(self.master) for k in MOMENTS}
        decay, no_decay, states = [], [], {}
        for p, lo, hi, at in _pieces(buffers):
            view = self.master[at:at + hi - lo]
            view.grad = buffers.main_grad[lo:hi]
            (decay if p.ndim >= 2 else no_decay).append(view)
            # views of the flat moments and a step counter per piece (the fused kernel
            # advances each piece's counter once per step)
            states[view] = {"step": torch.zeros((), dtype=torch.float32, device=view.device),
                            **{k: m[at:at + hi - lo] for k, m in self.moments.items()}}
        groups = [{"params": decay, "weight_decay": cfg.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        self.optimizer = build_optimizer([g for g in groups if g["params"]], cfg, fused=True)
        self.optimizer.state.update(states)
        self._divisor = torch.ones((), dtype=torch.float32, device=data.device)
        self.overlap_param_gather = cfg.overlap_param_gather and buffers.shard
        self._gathers: dict[int, object] = {}
        if self.overlap_param_gather:
            hook_bucket_waits(model, buffers, self.wait_params)

    # -- shard <-> full flat ----------------------------------------------------------------
    def _to_shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's owned ranges of a full flat tensor, concatenated (a copy)."""
        if not self.buffers.shard:
            return full
        return torch.cat([full[lo:hi] for lo, hi in self.ranges])

    def _to_full(self, shard: torch.Tensor, out: torch.Tensor, async_op: bool = False) -> dict:
        """Gather a shard-space tensor into the full flat tensor `out` (collective with
        sharding, bucket by bucket in forward order: first needed first; a copy without).
        With `async_op`: {bucket index: its all-gather in flight}."""
        if not self.buffers.shard:
            if out.data_ptr() != shard.data_ptr():
                out.copy_(shard)
            return {}
        pos, group = 0, self.buffers.group
        for lo, hi in self.ranges:
            out[lo:hi].copy_(shard[pos:pos + hi - lo])
            pos += hi - lo
        if group.size == 1:
            return {}
        pending = {}
        for (lo, hi), bucket in reversed(list(zip(self.ranges, self.buffers.buckets))):
            pending[bucket.index] = all_gather_flat(out[bucket.start:bucket.end], out[lo:hi],
                                                    group=group.group, async_op=async_op)
        return pending if async_op else {}

    # -- the step ---------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, lr: float, grad_divisor: float = 1.0, update=None) -> None:
        """AdamW at `lr`; `update(optimizer, lr, grad_divisor)`, when given, replaces the fused
        step (a rule of its own over the same torch optimizer and per-piece state)."""
        if update is not None:
            update(self.optimizer, lr, grad_divisor)
        else:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.grad_scale = None
            if grad_divisor != 1.0:  # a device scalar reused every step: no host-to-device copy
                self.optimizer.grad_scale = self._divisor.fill_(grad_divisor)
            self.optimizer.step()
        self._publish()

    def _publish(self) -> None:
        """Masters -> the model's parameter buffer (and the other ranks' shards)."""
        self._gathers = self._to_full(self.master, self.buffers.param_data,
                                      async_op=self.overlap_param_gather)

    def wait_params(self, indices=None) -> None:
        """Wait for the overlapped all-gathers of `indices` (None: all of them)."""
        for index in list(self._gathers) if indices is None else indices:
            handle = self._gathers.pop(index, None)
            if handle is not None:
                handle.wait()

    # -- checkpoints ------------------------------------------------------------------------
    def full_state(self) -> dict[str, torch.Tensor]:
        """{"master", "exp_avg", "exp_avg_sq"}: full flat fp32 tensors (collective when
        sharded; without sharding the masters and moments themselves)."""
        self.wait_params()
        if not self.buffers.shard:
            return {"master": self.master, **self.moments}
        out = {}
        for key, shard in (("master", self.master), *self.moments.items()):
            out[key] = torch.zeros(self.buffers.numel, dtype=torch.float32, device=shard.device)
            self._to_full(shard, out[key])
        return out

    def load_full_state(self, full: dict[str, torch.Tensor], step: int) -> None:
        """Set masters (and moments, when given) from full flat fp32 tensors; publish."""
        with torch.no_grad():
            for key, target in (("master", self.master), *self.moments.items()):
                if key not in full:
                    target.zero_()  # weights only: a fresh optimizer
                elif full[key].data_ptr() != target.data_ptr():
                    target.copy_(self._to_shard(full[key]))
            for st in self.optimizer.state.values():
                st["step"].fill_(float(step))
            self.wait_params()
            self._publish()
            self.wait_params()

    @property
    def adam_step(self) -> int:
        states = self.optimizer.state
        return int(next(iter(states.values()))["step"]) if states else 0
