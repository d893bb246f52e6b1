"""Count the collectives and host synchronisations a piece of code issues.

    with CommCounter(groups={"tp": state.tp.group}) as counts:
        loss = model(ids, labels=labels); loss.backward()
    counts.summary()        # {("all_gather", "tp"): 4, ("reduce_scatter", "tp"): 4, ...}
    counts.calls            # every call: kind, group name, elements, dtype, async_op
    counts.host_syncs       # tensor values read back to the host (.item(), float(t), ...)

How: a `TorchDispatchMode`. Every torch.distributed collective goes through a `c10d::` op of
the dispatcher, whatever Python name called it (all_gather_into_tensor, its renamed
all_gather_single, a function bound at import time, DTensor's funcol), and so does every
read of a tensor's value to the host (`aten::_local_scalar_dense`: `.item()`, `float(t)`,
`bool(t)`, `.tolist()` of one value). Patching `torch.distributed` names would miss the
ones bound before the patch. The mode is thread-local: it sees what runs on this thread,
which for CPU tensors includes autograd's backward (CPU autograd runs on the caller's
thread); on CUDA the backward runs on autograd's device threads, so count GPU backwards
with the mode entered inside them or read a profiler instead.

Also counted, by patching the two Python entry points for them: `torch.cuda.synchronize`
and `torch.cuda.Event.query` / `.synchronize` calls (`events`) - the event polling a
training step should not do.

`elements` is the size of the full side of a collective: the output of an all-gather, the
input of a reduce-scatter, the tensor of an all-reduce or broadcast, the send buffer of an
all-to-all or a point-to-point send.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# c10d op name -> (kind, the argument holding the full side)
_COLLECTIVES = {
    "allreduce_": ("all_reduce", "tensors"),
    "allreduce_coalesced_": ("all_reduce", "tensors"),
    "_allgather_base_": ("all_gather", "output_tensor"),
    "allgather_": ("all_gather", "output_tensors"),
    "allgather_into_tensor_coalesced_": ("all_gather", "outputs"),
    "_reduce_scatter_base_": ("reduce_scatter", "input_tensor"),
    "reduce_scatter_": ("reduce_scatter", "input_tensors"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs"),
    "alltoall_base_": ("all_to_all", "input"),
    "alltoall_": ("all_to_all", "input_tensors"),
    "broadcast_": ("broadcast", "tensors"),
    "send": ("send", "tensors"),
    "recv_": ("recv", "tensors"),
    "barrier": ("barrier", "tensor"),
}


@dataclass(frozen=True)
class Call:
    """One collective: kind, group name, elements and dtype of its full side, async_op."""
    kind: str
    group: str
    elements: int
    dtype: torch.dtype
    async_op: bool

    @property
    def bytes(self) -> int:
        return self.elements * self.dtype.itemsize


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


class CommCounter(TorchDispatchMode):
    """Record collectives and host reads while active (module docstring). `groups` names
    process groups ({"tp": pg}); any other group is named "size N"."""

    def __init__(self, groups: dict | None = None):
        super().__init__()
        self._names = [(pg, name) for name, pg in (groups or {}).items() if pg is not None]
        self.calls: list[Call] = []
        self.host_syncs = 0
        self.events = 0
        self._patched: list = []

    def _group_name(self, boxed) -> str:
        pg = dist.ProcessGroup.unbox(boxed)  # the dispatcher hands over a script object
        for known, name in self._names:
            if pg.group_name == known.group_name:
                return name
        return f"size {pg.size()}"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d" and func._opname in _COLLECTIVES:
            kind, full = _COLLECTIVES[func._opname]
            named = {a.name: v for a, v in zip(func._schema.arguments, args)} | kwargs
            tensors = _tensors(named[full])
            self.calls.append(Call(kind, self._group_name(named["process_group"]),
                                   sum(t.numel() for t in tensors), tensors[0].dtype,
                                   bool(named.get("async_op", False))))
        elif func is torch.ops.aten._local_scalar_dense.default:
            self.host_syncs += 1
        return func(*args, **kwargs)

    def _count_event(self, original):
        def counted(*a, **k):
            self.events += 1
            return original(*a, **k)
        return counted

    def __enter__(self):
        for owner, name in ((torch.cuda, "synchronize"), (torch.cuda.Event, "query"),
                            (torch.cuda.Event, "synchronize")):
            original = getattr(owner, name)
            self._patched.append((owner, name, original))
            setattr(owner, name, self._count_event(original))
        return super().__enter__()

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)
        self._patched = []
        return super().__exit__(*exc)

    def summary(self, *, group: str | None = None) -> Counter:
        """{(kind, group): calls}, or {kind: calls} of one group."""
        if group is not None:
            return Counter(c.kind for c in self.calls if c.group == group)
        return Counter((c.kind, c.group) for c in self.calls)

    def bytes_by_kind(self) -> Counter:
        """{(kind, group): bytes of the full sides}."""
        out: Counter = Counter()
        for c in self.calls:
            out[c.kind, c.group] += c.bytes
        return out

    def reset(self) -> None:
        self.calls, self.host_syncs, self.events = [], 0, 0


def named_groups(state) -> dict:
    """{"tp": pg, "sp": ..., "dp": ..., "dp_sp": ..., "pp": ...}: the groups of more than one
    rank of a ParallelState, for `CommCounter(groups=...)`; where two names hold the same
    group, the earlier one names it."""
    names = {}
    for name in ("tp", "sp", "dp", "dp_sp", "pp"):
        info = getattr(state, name, None)
        if info is not None and info.size > 1 and info.group is not None:
            names[name] = info.group
    return names
