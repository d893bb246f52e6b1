"""CUDA graphs emulated on CPU, for `megazoo.training.block_graphs` on gloo.

A captured region is recorded op by op (a TorchDispatchMode: every aten and c10d op with its
argument and output tensors). A replay runs the recorded ops again, in order, on the same
tensors: an op that mutates its arguments mutates them again, and a fresh output's new value
is copied into the tensor the capture returned, which later ops and the caller hold. That is
a CUDA graph's contract: the same kernels on the same addresses, and none of the Python
around them (flags, hooks, counters) run again. Views are not re-run: the recorded view
already aliases its base. A re-issued collective is waited for at once (gloo's work is
asynchronous; in a graph NCCL's is stream-ordered), and what waiting runs is not recorded
(`_unrecorded_wait`).

What this cannot show: the memory pool's reuse between graphs (on a GPU, a buffer freed during
capture can be handed to a later capture of the same pool) and stream ordering. The GPU tests
(tests/training/test_layouts_gpu.py) check those.

    with emulated_cuda_graphs():   # torch.cuda's graph, stream and pool calls, on CPU
        ... BlockGraphs captures and replays ...
"""
from __future__ import annotations

import contextlib
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


_work_wait = torch._C._distributed_c10d.Work.wait


def _unrecorded_wait(work, *args, **kwargs):
    """Work.wait with no ops recorded: gloo finishes some collectives with ops of its own
    when waited for (its reduce-scatter splits a buffer it made and copies into the output),
    which belong to the collective, re-run whole at replay."""
    with _disable_current_modes():
        return _work_wait(work, *args, **kwargs)


def _is_view(func) -> bool:
    return any(a.alias_info is not None and not a.alias_info.is_write
               for a in func._schema.returns)


def _wait(result) -> None:
    for item in tree_flatten(result)[0]:
        if hasattr(item, "wait") and not isinstance(item, torch.Tensor):
            item.wait()


class FakeGraph:
    """A recorded region (`torch.cuda.CUDAGraph`'s replay and reset)."""

    def __init__(self):
        self.ops: list | None = None
        self.replays = 0

    def replay(self) -> None:
        with torch.no_grad():
            for func, args, kwargs, out in self.ops:
                if _is_view(func):
                    continue
                result = func(*args, **kwargs)
                _wait(result)
                for old, new in zip(tree_flatten(out)[0], tree_flatten(result)[0]):
                    if isinstance(old, torch.Tensor) and old is not new and old.numel():
                        old.copy_(new)
        self.replays += 1

    def reset(self) -> None:
        self.ops = None


@contextlib.contextmanager
def _capture(graph: FakeGraph, pool=None, capture_error_mode=None):
    recorder = _Recorder()
    with recorder:
        yield
    graph.ops = recorder.ops


class _Stream:
    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass


@contextlib.contextmanager
def emulated_cuda_graphs():
    """torch.cuda's CUDAGraph, graph, graph_pool_handle, Stream, stream, current_stream and
    synchronize as CPU stand-ins, for the duration of the block."""
    patches = {"CUDAGraph": FakeGraph, "graph": _capture, "graph_pool_handle": lambda: None,
               "Stream": _Stream, "stream": lambda s: contextlib.nullcontext(),
               "current_stream": lambda *a: _Stream(), "synchronize": lambda *a: None}
    with contextlib.ExitStack() as stack:
        for name, value in patches.items():
            stack.enter_context(mock.patch.object(torch.cuda, name, value))
        stack.enter_context(mock.patch.object(torch._C._distributed_c10d.Work, "wait",
                                              _unrecorded_wait))
        yield


def _replays_as_scheduled(graphs, forwards: int) -> bool:
    """Whether every copy of every chunk's graphs replayed as often as the chunk's forwards
    k, k + n, k + 2n, ... (copy k of n) came to it, forward and backward alike."""
    want = [[len(range(k, forwards, len(slots))) for k in range(len(slots))]
            for slots in graphs.captured]
    got = [[{(b.forward.replays, b.backward.replays) for b in copy} for copy in slots]
           for slots in graphs.captured]
    return got == [[{(n, n)} for n in chunk] for chunk in want]


def graphed_and_eager(par, training: dict | None = None, steps: int = 3) -> dict:
    """Rank side: `steps` training steps of ddp_checks' tiny GPT at layout `par`, eagerly and
    with its blocks graphed (`block_graphs.graph_blocks`, emulated); the losses, the final
    parameters, and how often each graph replayed."""
    from helpers import ddp_checks as checks
    from megazoo.pipeline.schedules import build_schedule
    from megazoo.training.block_graphs import graph_blocks

    out = {}
    for graphed in (False, True):
        engine, state = checks.engine_for(par, **(training or {}))
        micro_batches = checks.GLOBAL_MB // state.dp.size
        program = build_schedule(state.pp.size, len(engine.model.chunks),
                                 micro_batches)[state.pp.rank]
        with emulated_cuda_graphs():
            graphs = graph_blocks(engine.model, engine.buffers, program) if graphed else None
            losses = checks.train(engine, state, range(steps))
            replays = _replays_as_scheduled(graphs, steps * micro_batches) if graphed else None
            if graphed:
                graphs.release()
        params = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
        out["graphed" if graphed else "eager"] = {"losses": losses, "params": params,
                                                  "replays": replays}
    return out
