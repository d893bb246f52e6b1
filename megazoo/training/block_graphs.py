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

A block's output is its graph's output buffer, which a later micro-batch's forward
rewrites. With one pipeline stage each micro-batch's backward ends before the next forward
starts. A pipeline keeps several micro-batches of a chunk in flight, so each chunk is
captured `graph_slots` times, as many as the stage's schedule keeps in flight in it, each
copy with its own static tensors and memory pool, and micro-batch j replays copy j mod n:
its previous user, micro-batch j - n, has finished its backward by then (the schedules run
a chunk's forwards and backwards in micro-batch order; j counts on across steps, whose
micro-batches all finish before the next step's begin). The buffers sent to the next stage
are read by the send before that; the input gradients sent to the previous stage are handed
out as copies, since a later backward of the same copy could rewrite them while an
asynchronous send still reads them. Every copy's pool stays allocated, so a stage holds
the sum of its chunks' peaks, more than eager's peak of micro-batches in flight (rank 0 at
pp 4, 6 chunks, 16 micro-batches: 36 copies against 27; at 2 chunks 12 against 11).
`check_args` refuses the layouts and features this does not cover
(`config.validate.check_cuda_graph`).
"""
from __future__ import annotations

import torch
from torch import nn

from ..pipeline.schedules import ActionKind

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
        self.copy_dx = False  # dx leaves for another stage: hand out a copy


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
        dx, *grads = (g.detach() if g is not None else None for g in graph.grads)
        return None, dx.clone() if graph.copy_dx else dx, *grads


class BlockGraphs:
    """Captures the blocks of one pipeline stage's `chunks` (each a list of blocks in forward
    order) at their first training call and replays them after: `slots[c]` copies of chunk
    c's graphs (`graph_slots`), micro-batches taking them in turn. `buffers` owns the
    gradients: `graph_weights(weights)` is called once, after capture, with the fused
    weights inside the graphs, and `graph_delivered(weights)` after each backward replay
    with that block's."""

    def __init__(self, chunks: list[list[nn.Module]], buffers, slots: list[int] | None = None,
                 sends_grads: frozenset[int] = frozenset()):
        self.chunks, self.buffers, self.sends_grads = chunks, buffers, frozenset(sends_grads)
        self.slots = slots or [1] * len(chunks)
        if len(self.slots) != len(chunks) or min(self.slots) < 1:
            raise ValueError(f"one slot count >= 1 per chunk, got {self.slots}")
        self.params = [[[p for p in b.parameters() if p.requires_grad] for b in blocks]
                       for blocks in chunks]
        hooked = [n for blocks in chunks for b in blocks for n, p in b.named_parameters()
                  if p._backward_hooks]
        if hooked:  # (check_cuda_graph refuses the layouts that have one)
            raise ValueError(f"a gradient hook on {hooked[0]} would not run at replay")
        self.captured: list[list[list[_Captured]]] | None = None  # [chunk][slot][block]
        self._made: list[torch.cuda.CUDAGraph] = []  # every graph made, captured or not
        self._forwards = [0] * len(chunks)  # forwards started per chunk: the next slot
        self._slot = [0] * len(chunks)  # the slot of each chunk's micro-batch in forward
        for c, blocks in enumerate(chunks):
            for i, block in enumerate(blocks):
                block.replay = lambda x, c=c, i=i: self.run(c, i, x)

    def run(self, chunk: int, index: int, x: torch.Tensor) -> torch.Tensor:
        if self.captured is None:
            if (chunk, index) != (0, 0):
                raise RuntimeError("the first graphed call must be the first block's")
            self.captured = self._capture(x)
        if index == 0:  # a micro-batch enters the chunk: the next slot in turn
            self._slot[chunk] = self._forwards[chunk] % self.slots[chunk]
            self._forwards[chunk] += 1
        graph = self.captured[chunk][self._slot[chunk]][index]
        if x.shape != graph.x.shape or x.dtype != graph.x.dtype:
            raise ValueError(f"--enable-cuda-graph captured blocks for {tuple(graph.x.shape)} "
                             f"{graph.x.dtype} activations, got {tuple(x.shape)} {x.dtype}: "
                             f"every micro-batch must have the first one's shape")
        return _Replay.apply(graph, x, *graph.params)

    def _capture(self, x: torch.Tensor) -> list[list[list[_Captured]]]:
        fused = [p for chunk in self.params for params in chunk for p in params
                 if getattr(p, "fuse_wgrad", False)]
        for p in fused:  # inside a graph a fused weight's gradient always adds
            p.main_grad_fresh = False
        sample = x.detach().clone()
        for blocks, params in zip(self.chunks, self.params):
            self._warm_up(blocks, params, sample)
        captured = [[self._capture_chunk(blocks, params, sample, c in self.sends_grads)
                     for _ in range(n)]
                    for c, (blocks, params, n) in enumerate(zip(self.chunks, self.params,
                                                                self.slots))]
        for p in fused:
            p.grad_added_to_main_grad = False
        self.buffers.graph_weights(fused)  # zeroes what warm-up and capture summed into them
        return captured

    def _capture_chunk(self, blocks: list[nn.Module], params: list[list[nn.Parameter]],
                       sample: torch.Tensor, sends_dx: bool) -> list[_Captured]:
        """One slot of one chunk: forwards in block order, backwards in reverse, in a pool
        of its own (another slot's replays come between this slot's forward and backward)."""
        pool = torch.cuda.graph_pool_handle()
        captured, inp = [], sample.clone().requires_grad_(True)
        for block, block_params in zip(blocks, params):
            graph = _Captured(block_params, inp)
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
        # the chunk's input gradient goes to the previous stage by an asynchronous send,
        # which may still read it when this copy's next backward would rewrite it
        captured[0].copy_dx = sends_dx
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
        for blocks in self.chunks:
            for block in blocks:
                block.replay = None

    def _warm_up(self, blocks: list[nn.Module], params: list[list[nn.Parameter]],
                 sample: torch.Tensor) -> None:
        side = torch.cuda.Stream(sample.device)
        side.wait_stream(torch.cuda.current_stream(sample.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                for block, block_params in zip(blocks, params):
                    x = sample.clone().requires_grad_(True)
                    y = block._forward(x)
                    torch.autograd.grad(y, [x, *block_params], sample, allow_unused=True)
        torch.cuda.current_stream(sample.device).wait_stream(side)


def graph_slots(program) -> list[int]:
    """Copies of each chunk's graphs a stage's pipeline `program` (its actions,
    `megazoo.pipeline.schedules.build_schedule`) needs: the most micro-batches in flight in
    the chunk at once (forward run, backward not yet). Micro-batch j takes copy j mod n of
    its chunk, which is free again when its forward starts only if the chunk's forwards and
    backwards both run in micro-batch order; a program that does not is refused."""
    chunks = 1 + max(a.chunk for a in program if a.kind in (ActionKind.F, ActionKind.B))
    live, peak = [0] * chunks, [1] * chunks
    order = {ActionKind.F: [[] for _ in range(chunks)], ActionKind.B: [[] for _ in range(chunks)]}
    for action in program:
        if action.kind not in order:
            continue
        order[action.kind][action.chunk].append(action.microbatch)
        live[action.chunk] += 1 if action.kind == ActionKind.F else -1
        peak[action.chunk] = max(peak[action.chunk], live[action.chunk])
    for kind, per_chunk in order.items():
        if any(seq != sorted(seq) for seq in per_chunk):
            raise ValueError(f"--enable-cuda-graph: the schedule runs a chunk's {kind.value} "
                             f"out of micro-batch order, which the graphs' copies cannot follow")
    return peak


def graph_blocks(model: nn.Module, buffers, program) -> BlockGraphs:
    """Graph the blocks of `model` (one pipeline stage's TransformerModel, whose gradients
    `buffers`, the plain engine's GradBuffer, owns) for the stage's pipeline `program`."""
    chunks = [[model.layers[str(i)] for i in chunk] for chunk in model.chunks]
    return BlockGraphs(chunks, buffers, graph_slots(program), sends_grads=grad_senders(program))


def grad_senders(program) -> frozenset[int]:
    """The chunks of a stage's pipeline `program` whose input gradient is sent to another
    stage (the first stage's first chunk hands its own to the embedding)."""
    return frozenset(a.chunk for a in program if a.kind == ActionKind.SEND_B)
