"""`Reducer`: how a data-parallel engine sums its gradient buckets over dp x sp, dense or
compressed, and what the compression needs around the optimizer step and in checkpoints.

    reducer = Reducer(state, compression, training)         # compression: CompressionConfig
    buffers = GradBuffer(..., reducer=reducer)              # calls reducer.bind(buffers)
    reducer.start_step(step, optimizer, loss_scale)         # engine, before the backwards
    handle = reducer.reduce(bucket, data, shard)            # grad buffer, per bucket
    reducer.finish(main_grad)                               # grad buffer, once all waited
    reducer.optimizer_step(optimizer, lr, loss_scale, clip, step)    # or skip_step()
    meta, write = reducer.checkpoint(rank); notes = reducer.load(path, meta, rank, device)

`reduce` gets a bucket already divided by dp; afterwards the bucket (or its `shard`) holds
the sum: dense (`reduce.DenseReduction`, in `communication_data_type` when given) before
`compression_start_step`, then compressed with error feedback (`reduce`), whose residuals
go into checkpoints (`state`).

1-bit Adam (Tang et al. 2021; `freeze_variance`): v is floored once and frozen when
compression starts (`frozen_adam`), and each rank compresses its local momentum instead of
its gradient: `reduce` adds alpha / n times the flat momentum m to each bucket and `finish`
takes alpha m off the sum (the same on every rank, so the sum is unchanged while the codec
sees the smooth signal). alpha = share x beta1 / (1 - beta1) (times the loss scale) makes a
bucket proportional to share x beta1 m + (1 - beta1) g_local; AdamW keeps (1 - share) beta1 m
on every entry. Not with the distributed optimizer (one momentum shard per rank).
Recipe internals: `select_by_update` has topk send the entries whose AdamW step is largest
(weight 1 / (sqrt(v) + eps)); `local_clipping` (Deep Gradient Compression) clips each rank's
bucket to clip_grad x sqrt(dp) x sqrt(bucket share) before compression and skips clipping
the reduced gradient, whose norm topk's bursts inflate.

Padding rows of the vocabulary (`tp_unpadded`) get no gradient; a codec would hand them noise
that checkpoints (which drop padding) cannot resume, so `finish` zeroes them.
"""
from __future__ import annotations

import math

import torch

from . import state as saved_state
from .frozen_adam import floor_variance, frozen_variance_step
from .reduce import DenseReduction, build_reduction

# when v freezes, each parameter's v is raised to at least this fraction (on the root scale)
# of its RMS, so no frozen coordinate divides by ~eps
VARIANCE_FLOOR = 0.1


def padding_ranges(params: list, offsets: dict, tp_rank: int) -> list[tuple[int, int]]:
    """Flat ranges of this tp rank's padded rows: parameters split along dim 0 with
    `tp_unpadded` real rows in the full tensor (the vocabulary)."""
    out = []
    for p in params:
        unpadded = getattr(p, "tp_unpadded", None)
        if unpadded is None or getattr(p, "tp_dim", None) != 0:
            continue
        rows, width = p.shape[0], p[0].numel()
        real = min(max(unpadded - tp_rank * rows, 0), rows)
        if real < rows:
            out.append((offsets[id(p)] + real * width, offsets[id(p)] + rows * width))
    return out


class Reducer:
    """See the module docstring. `compression`: the run's CompressionConfig, `training`: its
    TrainingConfig (AdamW's betas and eps, clip_grad)."""

    def __init__(self, state, compression, training):
        self.state, self.group = state, state.dp_sp
        comp, algorithm = compression, compression.algorithm
        self.dense = DenseReduction(self.group, comp.wire_dtype)
        self.compressed = None if algorithm is None else build_reduction(
            algorithm, self.group, topk_ratio=comp.value("topk_ratio"),
            block=comp.value("compression_block_size"), wire_dtype=comp.wire_dtype)
        self.start = 0 if algorithm is None else comp.value("compression_start_step")
        self.freeze_at = self.start if algorithm and comp.freeze_variance else None
        internals = comp.internals if algorithm else {}
        self.momentum_share = internals.get("momentum_share", 1.0)
        self.select_by_update = internals.get("topk_selection") == "update"
        # at dp x sp = 1 nothing is reduced: the usual clipping stays
        self.local_clipping = bool(internals.get("local_clipping")) and self.group.size > 1
        self.adam = (training.adam_beta1, training.adam_beta2, training.adam_eps)
        self.clip_grad = training.clip_grad
        self.current, self.buffers = self.dense, None
        self._offset = self._select = self._clip = None
        self._frozen_selection = None  # the selection weight once v no longer changes

    def bind(self, buffers) -> None:
        """The grad buffer whose buckets this reducer sums (its layout and padding)."""
        self.buffers = buffers
        self.padding = padding_ranges(buffers.params, buffers.offsets, self.state.tp.rank)

    # -- one step -------------------------------------------------------------------------
    def start_step(self, step: int, optimizer, loss_scale: float = 1.0) -> None:
        """Pick the reduction of the step after `step` optimizer steps, and the per-step
        inputs of a compressed one."""
        use = self.compressed is not None and step >= self.start
        self.current = self.compressed if use else self.dense
        self.current.reset_bytes()
        self._offset = self._select = self._clip = None
        if not use or self.group.size == 1:
            return
        beta1 = self.adam[0]
        if self.freeze_at is not None and not self.buffers.shard:
            alpha = self.momentum_share * beta1 / (1.0 - beta1)
            self._offset = optimizer.moments["exp_avg"], alpha * loss_scale
        if self.select_by_update and self.freeze_at is not None:
            self._select = self._selection_weight(step, optimizer)
        clip = self.clip_grad * loss_scale * math.sqrt(self.state.dp.size)
        if self.local_clipping and clip > 0:
            self._clip = clip / self.state.dp.size  # the buckets arrive divided by dp

    def _selection_weight(self, step: int, optimizer) -> torch.Tensor:
        """1 / (the frozen AdamW denominator). (On the first compressed step v is not floored
        yet: an entry whose v is ~0 and whose momentum is not is then picked first.) After
        that step v is floored and frozen, so the weight is kept instead of recomputed."""
        if self._frozen_selection is not None:
            return self._frozen_selection
        _, beta2, eps = self.adam
        v = optimizer.moments["exp_avg_sq"]
        correction = math.sqrt(1.0 - beta2 ** self.freeze_at)
        weight = (v.sqrt() / correction).add_(eps).reciprocal_()
        if step > self.freeze_at:
            self._frozen_selection = weight
        return weight

    def reduce(self, bucket, data: torch.Tensor, shard: torch.Tensor | None):
        """Start summing one bucket (`data`, divided by dp) over dp x sp; returns the pending
        reduction. With `shard` only that view of `data` is guaranteed afterwards."""
        if self._clip is not None:
            limit = self._clip * (bucket.numel / self.buffers.numel) ** 0.5
            data.mul_(limit / torch.linalg.vector_norm(data).clamp(min=limit))
        if self._offset is not None:
            flat, alpha = self._offset
            data.add_(flat[bucket.start:bucket.end], alpha=alpha / self.group.size)
        extra = {} if self._select is None else {"weight": self._select[bucket.start:bucket.end]}
        return self.current.launch(f"bucket{bucket.index}", data, shard, **extra)

    def finish(self, main_grad: torch.Tensor) -> None:
        """After every bucket's wait: take the momentum offset off, zero the padding."""
        if self._offset is not None:
            flat, alpha = self._offset
            main_grad.sub_(flat, alpha=alpha)
        if self.current.compressed:
            for lo, hi in self.padding:
                main_grad[lo:hi].zero_()

    def optimizer_step(self, optimizer, lr: float, loss_scale: float, clip: float,
                       step: int) -> None:
        """The optimizer's step on the reduced gradient (divided by loss scale x `clip`, the
        clipping factor); with the variance frozen, AdamW with v read only."""
        compressed = self.current.compressed
        if compressed and self.local_clipping:
            clip = 1.0  # each rank's gradient was clipped before the reduction
        if not compressed or self.freeze_at is None:
            optimizer.step(lr, loss_scale * clip)
            return
        if step == self.freeze_at:
            floor_variance(optimizer.optimizer, VARIANCE_FLOOR)
        frozen = self.freeze_at
        optimizer.step(lr, loss_scale * clip,
                       lambda opt, lr_, divisor: frozen_variance_step(opt, lr_, divisor, frozen))

    def skip_step(self) -> None:
        """A skipped step (non-finite loss or norm): the residuals took its inf / nan in."""
        if self.compressed is not None:
            self.compressed.reset_errors()

    def comm_stats(self) -> dict:
        """Bytes this rank sent for the last step's reduction, and the ratio of an fp32
        all-reduce's bytes (reduce-scatter's, with the distributed optimizer) to them."""
        red = self.current
        if self.group.size == 1 or not red.sent_bytes:
            return {}
        return {"comm_bytes": red.sent_bytes, "compression_ratio": red.dense_bytes / red.sent_bytes}

    # -- checkpoints: this rank's residuals (see `state`) ----------------------------------
    def checkpoint(self, rank: int) -> tuple[dict | None, object]:
        """(what the residuals depend on, the save hook writing this rank's file), or
        (None, None) when there are none (no compression, or before it started)."""
        errors = {} if self.compressed is None else self.compressed.errors
        if not errors:
            return None, None
        meta = saved_state.describe(self.compressed, self.buffers, self.state)
        return meta, lambda tmp: saved_state.write_errors(errors, tmp, rank)

    def load(self, path: str, saved: dict | None, rank: int, device, **read_options) -> list[str]:
        """Restore this rank's residuals from a checkpoint; returns the notes for the user.
        `read_options`: the run's verify_checksums / allow_nonfinite, as for its weights."""
        self._frozen_selection = None  # v is replaced by the checkpoint's
        if self.compressed is None:
            return [] if saved is None else [
                "the checkpoint holds gradient-compression residuals; this run does not "
                "compress, so they are not used"]
        here = saved_state.describe(self.compressed, self.buffers, self.state)
        errors, note = saved_state.read_errors(path, saved, here, rank, device, **read_options)
        self.compressed.reset_errors()
        self.compressed.errors.update(errors)
        return [note] if note else []
