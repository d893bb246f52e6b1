"""Contiguous parameter and main-gradient buffers in buckets, reduced over dp x sp.

    buffers = GradBuffer(model, state, bucket_numel=..., overlap=True, shard=False, reducer=r)
    buffers.start_step(num_microbatches)     # before the micro-batches' backwards
    ... backward ...                         # hooks accumulate grads into p.main_grad and
                                             # launch each bucket's reduction once it is ready
    buffers.finish()                         # launch what is left, wait for everything

Layout (Megatron's DDP): every trainable parameter of the stage becomes a view of one flat
parameter buffer (the model's dtype) and owns the same range of one flat gradient buffer,
`p.main_grad` (fp32, or bf16 with `grad_dtype`). Parameters are laid out in reverse
registration order (roughly the order backward produces their gradients) and cut into
buckets of about `bucket_numel` elements, each padded to a multiple of the reduction group's
size so that it splits into equal shards (the distributed optimizer's unit of ownership).

Accumulation: a post-accumulate-grad hook adds the parameter's `.grad` into `main_grad` and
drops `.grad`, once per micro-batch; the weights given as `fused` skip the add (their
linears' backward summed into `main_grad` already: `megazoo.layers.wgrad`). Fused weights
inside CUDA graphs (`graph_weights`) always add, their ranges zeroed at each step's start:
a replayed graph cannot tell the step's first micro-batch from the others; the replay
reports their gradients (`graph_delivered`) in place of the hook. A parameter's
gradient is final after its `num_microbatches`-th call; a bucket is ready when all its
parameters are final.

Megatron-SP parameters (tagged `sequence_parallel`: norms, row-parallel biases) saw only
their tp rank's sequence shard, so their gradient is also summed over tp: once per step, in
ONE all-reduce per bucket over the bucket's SP parameters (`_sum_over_tp`), right before
the bucket's dp x sp reduction (the two sums commute), never per micro-batch. In the
gpt-1.3b shape that is a handful of small all-reduces per step where a per-micro-batch
hook per parameter issued six per layer per micro-batch.

Reduction (the dp x sp part of the gradient contract, `megazoo.training.gradients`): each
bucket is divided by dp and summed over `state.dp_sp` by the `reducer`
(`megazoo.compress.Reducer`: a dense all-reduce, or with `shard=True` a reduce-scatter
leaving each rank its shard in place, or a compressed one). With `overlap=True` it is
launched from the hook as soon as the bucket is ready, while backward continues. `finish`
launches the rest, waits, and hands the buffer to `reducer.finish`. Buckets holding a tied
embedding copy (`deferred`) are launched only by `finish`, after the caller's sum over the
embedding group. `on_final` (set by the offloaded optimizer) is called with each bucket once
its reduced gradient is complete.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from ...offload.buckets import bucket_spans
from ...parallel.state import ParallelState


class Bucket:
    """A contiguous range [start, end) of the flat buffers and the parameters inside it."""

    def __init__(self, index: int, start: int, end: int, params: list, deferred: bool):
        self.index, self.start, self.end = index, start, end
        self.params, self.deferred = params, deferred
        self.ready = 0
        self.handle = None
        self.launch_time: float | None = None

    @property
    def numel(self) -> int:
        return self.end - self.start

    def shard_range(self, rank: int, size: int) -> tuple[int, int]:
        """[lo, hi) in flat coordinates of the shard of this bucket that `rank` owns."""
        k = self.numel // size
        return self.start + rank * k, self.start + (rank + 1) * k


def _layout(params: list, bucket_numel: int, pad_to: int, deferred_ids: set) -> tuple:
    """Offsets of `params` (in the given order) and the buckets, padded to `pad_to`
    (`offload.buckets.bucket_spans`: the rule the planner applies too)."""
    deferred = {i for i, p in enumerate(params) if id(p) in deferred_ids}
    spans = bucket_spans([p.numel() for p in params], bucket_numel, pad_to, deferred)
    offsets, buckets = {}, []
    for span in spans:
        pos = span.start
        for p in params[span.first:span.stop]:
            offsets[id(p)] = pos
            pos += p.numel()
        buckets.append(Bucket(len(buckets), span.start, span.end, params[span.first:span.stop],
                              span.deferred))
    return offsets, buckets, spans[-1].end if spans else 0


class GradBuffer:
    """Flat parameter and main-gradient buffers of a model; see the module docstring."""

    def __init__(self, model: nn.Module, state: ParallelState, *, bucket_numel: int,
                 overlap: bool, shard: bool, reducer, deferred: tuple = (), fused=(),
                 grad_dtype: torch.dtype = torch.float32, device=None, dtype=None):
        self.state, self.overlap, self.shard = state, overlap, shard
        self.group = state.dp_sp
        params = [p for p in model.parameters() if p.requires_grad][::-1]
        self.params = params
        self.offsets, self.buckets, self.numel = _layout(
            params, max(int(bucket_numel), 1), self.group.size, {id(p) for p in deferred})
        device, dtype = device or params[0].device, dtype or params[0].dtype  # (lean_build)
        self.param_data = torch.zeros(self.numel, dtype=dtype, device=device)
        self.main_grad = torch.zeros(self.numel, dtype=grad_dtype, device=device)
        self.on_final = None  # callable(bucket): its reduced gradient is complete
        self._bucket_of = {}
        with torch.no_grad():
            for bucket in self.buckets:
                for p in bucket.params:
                    self._bucket_of[id(p)] = bucket
                    view = self.view(self.param_data, p)
                    view.copy_(p.detach())
                    p.data = view
                    p.main_grad = self.view(self.main_grad, p)
        self._calls = {id(p): 0 for p in params}
        over_tp = state.tp.size > 1 and state.config.megatron_sp
        self._tp_summed = {b.index: [p for p in b.params if over_tp
                                     and getattr(p, "sequence_parallel", False)]
                           for b in self.buckets}
        self.fused = list(fused)
        if any(id(p) not in self.offsets for p in self.fused):
            raise ValueError("a fused weight must be a trainable parameter of the model")
        fused_ids = {id(p) for p in self.fused}
        for p in params:  # (a model wrapped before keeps no stale flag)
            p.fuse_wgrad, p.main_grad_fresh = id(p) in fused_ids, True
            p.grad_added_to_main_grad = False
        self._expected = 1
        self._in_graph: set[int] = set()
        self._graph_grads: list[torch.Tensor] = []
        self.reducer = reducer  # `megazoo.compress.Reducer`
        self.reducer.bind(self)
        self._handles = {id(p): p.register_post_accumulate_grad_hook(self._on_grad)
                         for p in params}

    def cast_params(self, dtype: torch.dtype) -> None:
        """Re-point every parameter at a new flat buffer of `dtype` holding its values."""
        if dtype == self.param_data.dtype:
            return
        self.param_data = self.param_data.to(dtype)
        for p in self.params:
            p.data = self.view(self.param_data, p)

    # -- layout ---------------------------------------------------------------------------
    def view(self, flat: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """`p`'s range of a flat buffer laid out like this one, shaped like `p`."""
        off = self.offsets[id(p)]
        return flat[off:off + p.numel()].view(p.shape)

    def pieces(self, bucket: Bucket, lo: int, hi: int):
        """(parameter, a, b): the range [a, b) of each of `bucket`'s parameters within [lo, hi)."""
        for p in bucket.params:
            start = self.offsets[id(p)]
            a, b = max(lo, start), min(hi, start + p.numel())
            if a < b:
                yield p, a, b

    def shard_ranges(self) -> list[tuple[int, int]]:
        """The flat ranges this rank owns (one per bucket; everything without sharding)."""
        if not self.shard:
            return [(b.start, b.end) for b in self.buckets]
        return [b.shard_range(self.group.rank, self.group.size) for b in self.buckets]

    def graph_weights(self, weights: list) -> None:
        """`weights` (fused ones) accumulate into `main_grad` inside CUDA graphs for the rest
        of the run: always adding, so their ranges are zeroed now and at the start of every
        step. Autograd gets no gradient for them; the replay reports each one
        (`graph_delivered`), so their hooks go."""
        fused = {id(f) for f in self.fused}
        if any(id(p) not in fused for p in weights):
            raise ValueError("only fused weights accumulate inside a graph")
        self._in_graph = {id(p) for p in weights}
        self._graph_grads = [p.main_grad for p in weights]
        for p in weights:
            self._handles.pop(id(p)).remove()
            p.main_grad_fresh = False
        if self._graph_grads:
            torch._foreach_zero_(self._graph_grads)

    def graph_delivered(self, weights: list) -> None:
        """A backward graph has summed these graphed weights' gradients into `main_grad`:
        each counts as one micro-batch's gradient (what the hook does for the others)."""
        for p in weights:
            if id(p) not in self._in_graph:
                raise ValueError("graph_delivered takes graphed weights only")
            self._on_grad(p)

    # -- one step -------------------------------------------------------------------------
    def start_step(self, num_microbatches: int) -> None:
        """Start counting; each parameter's gradient is final after this many backward calls.

        The main gradients are not zeroed here: a parameter's first gradient of the step is
        copied into its range and later ones added (one pass less over the fp32 buffer than
        zero + add); `finish` zeroes the ranges of parameters that got no gradient."""
        self.wait()
        self._expected = num_microbatches
        for p in self.fused:
            p.main_grad_fresh = id(p) not in self._in_graph
        if self._graph_grads:
            torch._foreach_zero_(self._graph_grads)
        for key in self._calls:
            self._calls[key] = 0
        for bucket in self.buckets:
            bucket.ready, bucket.handle, bucket.launch_time = 0, None, None

    def _on_grad(self, p: torch.Tensor) -> None:
        calls = self._calls[id(p)] = self._calls[id(p)] + 1
        if getattr(p, "grad_added_to_main_grad", False) or id(p) in self._in_graph:
            p.grad_added_to_main_grad = False
        else:
            if calls == 1:
                p.main_grad.copy_(p.grad)
            else:
                p.main_grad.add_(p.grad)
            p.main_grad_fresh = False  # a fused weight's next accumulation adds
        p.grad = None
        if calls != self._expected:
            if calls > self._expected:  # its bucket may have been reduced already
                raise RuntimeError("a parameter received more gradients than there are "
                                   "micro-batches: reentrant checkpointing or a second "
                                   "backward per micro-batch is not supported here")
            return
        bucket = self._bucket_of[id(p)]
        bucket.ready += 1
        if self.overlap and bucket.ready == len(bucket.params) and not bucket.deferred:
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        if bucket.launch_time is not None:
            return
        bucket.launch_time = time.perf_counter()
        self._sum_over_tp(bucket)
        if self.group.size == 1:
            if self.on_final is not None:
                self.on_final(bucket)
            return
        data = self.main_grad[bucket.start:bucket.end]
        if self.state.dp.size > 1:
            data.div_(self.state.dp.size)
        shard = None
        if self.shard:
            lo, hi = bucket.shard_range(self.group.rank, self.group.size)
            shard = self.main_grad[lo:hi]
        bucket.handle = self.reducer.reduce(bucket, data, shard)

    def _sum_over_tp(self, bucket: Bucket) -> None:
        """Sum the step's gradients of the bucket's Megatron-SP parameters over tp: one
        all-reduce of their concatenation (module docstring)."""
        grads = [p.main_grad for p in self._tp_summed[bucket.index]]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.state.tp.group)
        torch._foreach_copy_(grads, [f.view_as(g) for f, g in
                                     zip(flat.split([g.numel() for g in grads]), grads)])

    def finish(self, before_deferred=None) -> None:
        """Launch every bucket not launched yet (deferred ones after `before_deferred()`,
        the caller's tied-embedding sum), then wait for all of them."""
        for bucket in self.buckets:
            for p in bucket.params:
                if self._calls[id(p)] == 0:  # no gradient this step: its range is stale
                    p.main_grad.zero_()
        for bucket in self.buckets:
            if not bucket.deferred:
                self._launch(bucket)
        if before_deferred is not None:
            before_deferred()
        for bucket in self.buckets:
            if bucket.deferred:
                self._launch(bucket)
        self.wait()
        self.reducer.finish(self.main_grad)
        if self.on_final is not None and self.group.size > 1:
            for bucket in self.buckets:
                self.on_final(bucket)

    def wait(self) -> None:
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
                bucket.handle = None
