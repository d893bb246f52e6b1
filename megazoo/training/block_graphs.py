"""The transformer blocks' training forward and backward as CUDA graphs (`--enable-cuda-graph`).

Under tensor or sequence parallelism a block's micro-batch is hundreds of kernel launches and
a dozen collective calls, each a few to a few hundred microseconds of Python and driver time;
at gpt-1.3b the host then needs longer to issue a micro-batch than the GPUs need to run it,
and the GPUs wait. Here each block's forward and backward are captured once, at the first
training micro-batch, as two CUDA graphs, and every later micro-batch replays them: one
launch per block and direction.

Capture (PyTorch's recipe for graphed callables): each block runs forward and backward twice
on a side stream first (NCCL communicators, cuBLAS handles and Triton kernels are created
there, not under capture); then the forwards are captured in block order and the backwards
in reverse order into one memory pool, the order they replay in, so memory the capture
reused is reused at replay exactly as captured. The graphs chain: block i + 1's static input
is block i's static output, and block i's output gradient is block i + 1's input gradient,
so nothing is copied between blocks; only the first block's input and the last block's
output gradient are copied in.

Gradients (`GradBuffer.graph_weights`): the weights whose gradient the linears sum into
`main_grad` (`megazoo.layers.wgrad`) accumulate inside the backward graph, always adding;
the buffer zeroes their ranges at the start of each step. Their placeholder gradients
(`wgrad._delivered`, never read) are dropped after capture, so the graphs keep no
weight-sized output for them; at replay the backward hands autograd None for them and tells
the buffer itself (`GradBuffer.graph_delivered`), which counts the micro-batch as its hook
would. The other parameters' gradients (norms, biases) are outputs of the backward graph
that autograd hands to the buffer's hook as without graphs. The buckets' reductions are
launched from there, outside the graphs, after the replay that filled them.

`release` frees the graphs; the run calls it before it destroys the process group.

A block's output is its graph's output buffer, which the next micro-batch's forward
rewrites: with one pipeline stage each micro-batch's backward ends before the next forward
starts, so nothing reads a rewritten buffer. `check_args` refuses the layouts and features
this does not cover (`config.validate.check_cuda_graph`).
"""
from __future__ import annotations

import torch
from torch import nn

WARMUP_RUNS = 2


class _Captured:
    """One block's two graphs and their static tensors."""

    def __init__(self, params: list[nn.Parameter], x: torch.Tensor):
        self.params, self.x = params, x
        self.forward = self.backward = None
        self.y = self.dy = None
        self.grads: tuple = ()  # (dx, one per parameter; None for the fused weights)
        self.fused: list[nn.Parameter] = []  # delivered into main_grad by the graph
        self.delivered = None  # GradBuffer.graph_delivered


class _Replay(torch.autograd.Function):
    """y = block(x) by replaying the block's forward graph; backward replays its backward
    graph and returns the static input and parameter gradients."""

    @staticmethod
    def forward(ctx, graph: _Captured, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        if x.data_ptr() != graph.x.data_ptr():
            graph.x.copy_(x)
        graph.forward.replay()
        ctx.graph = graph
        return graph.y.detach()

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        graph = ctx.graph
        if dy.data_ptr() != graph.dy.data_ptr():
            graph.dy.copy_(dy)
        graph.backward.replay()
        graph.delivered(graph.fused)
        return None, *(g.detach() if g is not None else None for g in graph.grads)


class BlockGraphs:
    """Captures `blocks` (one pipeline stage's, in forward order) at their first training
    call and replays them after. `buffers` owns the gradients: `graph_weights(weights)` is
    called once, after capture, with the fused weights inside the graphs, and
    `graph_delivered(weights)` after each backward replay with that block's."""

    def __init__(self, blocks: list[nn.Module], buffers):
        self.blocks, self.buffers = blocks, buffers
        self.params = [[p for p in b.parameters() if p.requires_grad] for b in blocks]
        hooked = [n for b in blocks for n, p in b.named_parameters() if p._backward_hooks]
        if hooked:  # (check_cuda_graph refuses the layouts that have one)
            raise ValueError(f"a gradient hook on {hooked[0]} would not run at replay")
        self.captured: list[_Captured] | None = None
        self._made: list[torch.cuda.CUDAGraph] = []  # every graph made, captured or not
        for index, block in enumerate(blocks):
            block.replay = lambda x, i=index: self.run(i, x)

    def run(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if self.captured is None:
            if index != 0:
                raise RuntimeError("the first graphed call must be the first block's")
            self.captured = self._capture(x)
        graph = self.captured[index]
        if x.shape != graph.x.shape or x.dtype != graph.x.dtype:
            raise ValueError(f"--enable-cuda-graph captured blocks for {tuple(graph.x.shape)} "
                             f"{graph.x.dtype} activations, got {tuple(x.shape)} {x.dtype}: "
                             f"every micro-batch must have the first one's shape")
        return _Replay.apply(graph, x, *graph.params)

    def _capture(self, x: torch.Tensor) -> list[_Captured]:
        fused = [p for params in self.params for p in params if getattr(p, "fuse_wgrad", False)]
        for p in fused:  # inside a graph a fused weight's gradient always adds
            p.main_grad_fresh = False
        sample = x.detach().clone()
        self._warm_up(sample)
        pool = torch.cuda.graph_pool_handle()
        captured, inp = [], sample.requires_grad_(True)
        for block, params in zip(self.blocks, self.params):
            graph = _Captured(params, inp)
            graph.forward = self._new_graph()
            with torch.cuda.graph(graph.forward, pool=pool, capture_error_mode="thread_local"):
                graph.y = block._forward(inp)
            captured.append(graph)
            inp = graph.y.detach().requires_grad_(True)
        dy = torch.zeros_like(captured[-1].y)
        for graph in reversed(captured):
            graph.dy, graph.backward = dy, self._new_graph()
            with torch.cuda.graph(graph.backward, pool=pool, capture_error_mode="thread_local"):
                grads = torch.autograd.grad(graph.y, [graph.x, *graph.params], dy,
                                            allow_unused=True)
            graph.fused = [p for p in graph.params if getattr(p, "fuse_wgrad", False)]
            graph.grads = (grads[0], *(None if getattr(p, "fuse_wgrad", False) else g
                                       for p, g in zip(graph.params, grads[1:])))
            graph.delivered = self.buffers.graph_delivered
            graph.y = graph.y.detach()  # the autograd graph of the capture is done with
            dy = graph.grads[0]
        for p in fused:
            p.grad_added_to_main_grad = False
        self.buffers.graph_weights(fused)  # zeroes what warm-up and capture summed into them
        return captured

    def _new_graph(self) -> torch.cuda.CUDAGraph:
        self._made.append(torch.cuda.CUDAGraph())
        return self._made[-1]

    def release(self) -> None:
        """Free the graphs (those of a capture that failed half-way too) and run the blocks
        eagerly again. Call it before the process group is destroyed: NCCL's communicator
        destroy waits forever on a communicator that a live graph still holds work of."""
        if self._made:
            torch.cuda.synchronize()
        for graph in self._made:
            graph.reset()
        self._made, self.captured = [], None
        for block in self.blocks:
            block.replay = None

    def _warm_up(self, sample: torch.Tensor) -> None:
        side = torch.cuda.Stream(sample.device)
        side.wait_stream(torch.cuda.current_stream(sample.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                for block, params in zip(self.blocks, self.params):
                    x = sample.clone().requires_grad_(True)
                    y = block._forward(x)
                    torch.autograd.grad(y, [x, *params], sample, allow_unused=True)
        torch.cuda.current_stream(sample.device).wait_stream(side)


def graph_blocks(model: nn.Module, buffers) -> BlockGraphs:
    """Graph the blocks of `model` (a TransformerModel of one pipeline stage, whose gradients
    `buffers`, the plain engine's GradBuffer, owns)."""
    blocks = [model.layers[str(i)] for chunk in model.chunks for i in chunk]
    return BlockGraphs(blocks, buffers)
