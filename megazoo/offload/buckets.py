"""The gradient buckets of the plain engine and which of them the optimizer offload puts on
the host: rules over element counts, which the engine (`grad_buffer.GradBuffer`,
`cpu_offload.bucket_slots`) and the planner (`plan/engines.py`) both apply.

The parameters are laid out in reverse (the order backward produces their gradients); a
bucket closes once it holds `bucket_numel` elements, and its end is padded to a multiple of
`pad_to` (dp x sp: each rank's shard is whole). A parameter whose gradient waits for a sum
outside the bucket (a tied embedding's copy on a pipeline end: "deferred") gets a bucket of
its own.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BucketSpan:
    """One bucket: elements [start, end) of the flat buffer (end padded), holding items
    [first, stop) of the given order."""

    start: int
    end: int
    first: int
    stop: int
    deferred: bool

    @property
    def numel(self) -> int:
        return self.end - self.start


def bucket_spans(numels: list[int], bucket_numel: int, pad_to: int,
                 deferred: frozenset | set = frozenset()) -> list[BucketSpan]:
    """The buckets of items of `numels` elements in the given (backward) order; `deferred`:
    indices of items that get a bucket of their own (module docstring)."""
    spans, start, pos, first = [], 0, 0, 0

    def close(stop: int, alone: bool = False) -> None:
        nonlocal start, pos, first
        if stop == first:
            return
        pos = start + -(-(pos - start) // pad_to) * pad_to
        spans.append(BucketSpan(start, pos, first, stop, alone))
        start, first = pos, stop

    for i, numel in enumerate(numels):
        alone = i in deferred
        if alone:
            close(i)
        pos += numel
        if alone or pos - start >= bucket_numel:
            close(i + 1, alone)
    close(len(numels))
    return spans


def bucket_elements_of(tensors: list[int], bucket_elements: int, pad_to: int,
                       deferred: frozenset | set = frozenset()) -> list[int]:
    """Elements of the engine's buckets for parameters of `tensors` elements in forward order
    (`deferred`: their indices in that order)."""
    n = len(tensors)
    spans = bucket_spans(tensors[::-1], bucket_elements, pad_to, {n - 1 - i for i in deferred})
    return [s.numel for s in spans]


def host_share(buckets: list[int], fraction: float) -> list[int]:
    """Indices of the buckets (elements each, in layout order) whose state goes to the host:
    the lowest indices first (the last the forward uses, the ones it can wait for longest),
    each taken while that brings the share nearer `fraction` of all elements."""
    target, taken, out = fraction * sum(buckets), 0, []
    for i, numel in enumerate(buckets):
        if taken + numel / 2 > target:
            break
        out.append(i)
        taken += numel
    return out


def host_slots(buckets: list[int], fraction: float, shard: int) -> list[float]:
    """Elements per rank (/ `shard`) of each bucket whose state goes to the host
    (`host_share`), in layout order."""
    return [buckets[i] / shard for i in host_share(buckets, fraction)]
