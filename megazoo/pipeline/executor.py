"""Run a pipeline schedule (`megazoo.pipeline.schedules`) on one rank.

    loss = run_pipeline(model, microbatches, state)          # training: forward + backward
    out = run_pipeline(model, microbatches, state, forward_only=True)

`model` is this rank's stage (`TransformerModel` with one chunk, or `vpp` chunks for the
interleaved schedule; `model.activation_shape` is the shape it sends):
`model(ids, labels, chunk=c)` on the first chunk of the first stage,
`model(hidden_states=x, labels=..., chunk=c)` elsewhere; the last chunk of the last stage
returns the micro-batch's mean loss (or logits when there are no labels).

Three phases, as the schedule's action list orders them: warm-up forwards, steady 1F1B, and
cool-down backwards; the executor just walks the list. Each micro-batch's loss is scaled by
1/m before its backward, so the gradients are the whole batch's once the training step has
completed them (`megazoo.training.gradients`: tied embedding, sp / dp / Megatron-SP sums).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..parallel.state import ParallelState
from .p2p import Channel, backward_from_freed
from .schedules import ActionKind, build_schedule


@dataclass
class _StageBuffers:
    """Per (chunk, micro-batch): the received input, the output, the received output grad."""

    inputs: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    grads: dict = field(default_factory=dict)
    losses: list = field(default_factory=list)


def run_pipeline(model, microbatches: list[tuple[torch.Tensor, torch.Tensor | None]],
                 state: ParallelState, *, forward_only: bool = False,
                 dtype: torch.dtype | None = None, backward=None):
    """Run this rank's program; return the mean loss (last stage) or None (other stages).

    `microbatches` is the same list of (ids [b, s], labels [b, s] or None) on every rank.
    With forward_only and no labels the last stage returns the list of per-micro-batch logits.
    `backward(loss)` runs the backward of each micro-batch's loss (already divided by m) on
    the last stage (default `loss.backward()`; DeepSpeed passes its engine's own).
    """
    outputs = run_schedule(model, microbatches, state, forward_only=forward_only, dtype=dtype,
                           backward=backward)
    if outputs is None or microbatches[0][1] is None:
        return outputs
    return torch.stack([loss.detach() for loss in outputs]).sum()


def run_schedule(model, microbatches: list[tuple[torch.Tensor, torch.Tensor | None]],
                 state: ParallelState, *, forward_only: bool = False,
                 dtype: torch.dtype | None = None, backward=None) -> list[torch.Tensor] | None:
    """`run_pipeline`'s work: the last stage's output per micro-batch (each loss already
    divided by the number of micro-batches), None on the other stages."""
    pp, vpp, m = state.pp.size, len(model.chunks), len(microbatches)
    ids0 = microbatches[0][0]
    shape = model.activation_shape(ids0.shape[0], ids0.shape[1])  # [s_local, b, h] sent
    dtype = dtype or next(model.parameters()).dtype
    program = build_schedule(pp, vpp, m)[state.pp.rank]
    channel, buffers = Channel(state.pp.group), _StageBuffers()
    for action in program:
        channel.reap()
        key = (action.chunk, action.microbatch)
        if action.kind == ActionKind.F:
            _forward(model, state, microbatches, key, buffers, forward_only)
        elif action.kind == ActionKind.B:
            if not forward_only:
                _backward(state, key, buffers, backward)
        elif action.kind == ActionKind.SEND_F:
            # Training keeps the output (its graph) for the backward but frees its values
            # once sent; forward-only drops it altogether.
            out = buffers.outputs.pop(key) if forward_only else buffers.outputs[key]
            channel.send(out, state.pp.ranks[action.peer], free_after=not forward_only)
        elif action.kind == ActionKind.RECV_F:
            x = channel.recv(shape, dtype, ids0.device, state.pp.ranks[action.peer])
            buffers.inputs[key] = x.requires_grad_(not forward_only)
        elif action.kind == ActionKind.SEND_B and not forward_only:
            channel.send(buffers.inputs.pop(key).grad, state.pp.ranks[action.peer])
        elif action.kind == ActionKind.RECV_B and not forward_only:
            buffers.grads[key] = channel.recv(shape, dtype, ids0.device,
                                              state.pp.ranks[action.peer])
    channel.drain()
    return buffers.losses if state.is_last_stage else None


def _forward(model, state, microbatches, key, buffers: _StageBuffers, forward_only: bool):
    chunk, mb = key
    ids, labels = microbatches[mb]
    last = state.is_last_stage and chunk == len(model.chunks) - 1
    labels = labels if last else None
    with torch.set_grad_enabled(not forward_only):
        if state.is_first_stage and chunk == 0:
            out = model(ids, labels, chunk=0)
        else:
            x = buffers.inputs[key] if not forward_only else buffers.inputs.pop(key)
            out = model(hidden_states=x, labels=labels, chunk=chunk)
    if last and labels is not None:
        out = out / len(microbatches)  # mean over micro-batches
    if last:
        buffers.losses.append(out)
    if not (last and forward_only):
        buffers.outputs[key] = out


def _backward(state, key, buffers: _StageBuffers, backward=None):
    out = buffers.outputs.pop(key)
    if key in buffers.grads:
        backward_from_freed(out, buffers.grads.pop(key))
    elif backward is not None:  # the loss on the last stage
        backward(out)
    else:
        out.backward()
