"""`forward`: token ids through every pipeline stage, at any layout, without gradients.

    from megazoo.pipeline import forward
    logits = forward(model, ids, state)                 # [b, s, vocab] on the last stage
    loss = forward(model, ids, state, labels=ids)       # mean token loss on the last stage
    logits = forward(model, ids, state, broadcast=True)  # the same on every rank

`model(ids)` runs this rank's pipeline stage only; `forward` runs the forward-only schedule
over all stages (the interleaved one on micro-batches padded to a multiple of pp with copies
whose outputs are dropped). At pp = 1 it is `model(ids, labels)` under `torch.no_grad()`.
Every rank passes the same ids (and labels); tp / sp ranks shard them inside the model.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel.state import ParallelState
from .executor import run_schedule


def forward(model, input_ids: torch.Tensor, state: ParallelState | None = None,
            labels: torch.Tensor | None = None, *, num_microbatches: int = 1,
            broadcast: bool = False) -> torch.Tensor | None:
    """Logits [b, s, vocab] (no labels) or the mean token loss (labels [b, s]) of `input_ids`
    [b, s] through the whole model: on the last pipeline stage, None elsewhere unless
    `broadcast`. `num_microbatches` splits the batch for the schedule (it must divide b);
    the loss is then the mean of the micro-batches' mean token losses (with m = 1, exactly
    the one-process model's)."""
    state = state or model.state
    _check_inputs(input_ids, labels, num_microbatches)
    if state.pp.size == 1:
        with torch.no_grad():
            return model(input_ids, labels)
    m = num_microbatches
    pairs = list(zip(input_ids.chunk(m), labels.chunk(m) if labels is not None else [None] * m))
    # The interleaved schedule runs multiples of pp micro-batches: pad with copies, drop them.
    padded = m if len(model.chunks) == 1 else -(-m // state.pp.size) * state.pp.size
    outs = run_schedule(model, pairs + pairs[:1] * (padded - m), state, forward_only=True)
    out = None
    if outs is not None and labels is None:
        out = torch.cat(outs[:m], dim=0)  # per micro-batch logits -> [b, s, vocab]
    elif outs is not None:  # each loss came divided by `padded`
        out = torch.stack(outs[:m]).sum() * (padded / m)
    return _broadcast_from_last(out, state) if broadcast else out


def _check_inputs(ids: torch.Tensor, labels: torch.Tensor | None, m: int) -> None:
    """ValueErrors before any collective: the same check on every rank."""
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(ids.shape)}")
    if labels is not None and labels.shape != ids.shape:
        raise ValueError(f"labels {tuple(labels.shape)} must have the shape of input_ids "
                         f"{tuple(ids.shape)}")
    if m < 1 or ids.shape[0] % m:
        raise ValueError(f"num_microbatches {m} must be >= 1 and divide the batch {ids.shape[0]}")


def _broadcast_from_last(out: torch.Tensor | None, state: ParallelState) -> torch.Tensor:
    """The last stage's tensor on every rank of this pipeline (shape and dtype sent first)."""
    src = state.pp.ranks[-1]
    meta = [None if out is None else (tuple(out.shape), out.dtype, out.device.type)]
    dist.broadcast_object_list(meta, src=src, group=state.pp.group)
    shape, dtype, device_type = meta[0]
    if out is None:
        device = torch.device(device_type, torch.accelerator.current_device_index()) \
            if device_type != "cpu" else torch.device("cpu")
        out = torch.empty(shape, dtype=dtype, device=device)
    dist.broadcast(out.contiguous(), src=src, group=state.pp.group)
    return out
