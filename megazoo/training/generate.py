"""Text generation from a trained model, at any tp / sp / Megatron-SP / pp layout.

    text = generate(model, tokenizer, "def ", max_new_tokens=80, top_k=1)   # greedy

Every rank of a tp x sp group runs the same loop: the model returns the same full logits on
each, and sampling draws from a generator seeded identically everywhere, so all ranks pick
the same token with no broadcast. No KV cache: the whole context is recomputed per token
(fine for the short samples shown at the end of training, at every layout and engine,
Ulysses and Megatron SP included); it is also the reference the cached generation of
`megazoo.generation` (`megazoo.generate`, `generate.py`) is tested against. The context is right-padded to
a multiple of the sequence-parallel size; with causal attention the padding cannot change
the logits at the last real position. With pp > 1 every rank runs the forward-only pipeline
schedule; the last stage picks the token and sends it to its pipeline group.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..models.parts import sequence_shard
from ..pipeline.executor import run_pipeline


def last_logits(model, ids: torch.Tensor, position: int) -> torch.Tensor | None:
    """float32 logits [vocab] at `position` of ids [1, s] (None on stages other than the last)."""
    state = model.state
    if state.pp.size == 1:
        return model(ids)[0, position].float().cpu()
    logits = run_pipeline(model, [(ids, None)], state, forward_only=True)  # last stage: [[1, s, V]]
    return logits[0][0, position].float().cpu() if state.is_last_stage else None


def _from_last_stage(token: int | None, state, device) -> int:
    """The token the last pipeline stage chose, on every stage of the pipeline group."""
    if state.pp.size == 1:
        return token
    buf = torch.tensor([-1 if token is None else token], device=device)
    dist.broadcast(buf, src=state.pp.ranks[-1], group=state.pp.group)
    return int(buf)


@torch.no_grad()
def generate_ids(model, ids: list[int], max_new_tokens: int, *, top_k: int = 1,
                 temperature: float = 1.0, seed: int = 0, pad_id: int = 0,
                 max_context: int | None = None, stop_id: int | None = None) -> list[int]:
    """Extend `ids` by up to `max_new_tokens` tokens (top_k=1: greedy)."""
    if not ids:
        raise ValueError("generation needs a non-empty prompt")
    model.eval()
    device = next(model.parameters()).device
    shard = sequence_shard(model.state)
    limit = max_context or model.config.max_position_embeddings
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out = list(ids)
    for _ in range(max_new_tokens):
        context = out[-limit:]
        padded = context + [pad_id] * (-len(context) % shard)
        logits = last_logits(model, torch.tensor([padded], device=device), len(context) - 1)
        token = None if logits is None else _sample(logits, top_k, temperature, gen)
        token = _from_last_stage(token, model.state, device)
        out.append(token)
        if stop_id is not None and token == stop_id:
            break
    return out


def _sample(logits: torch.Tensor, top_k: int, temperature: float, gen: torch.Generator) -> int:
    """Greedy (top_k=1) or a draw among the top_k logits at `temperature`."""
    if top_k == 1:
        return int(logits.argmax())
    values, indices = logits.topk(min(top_k, logits.numel()))
    probs = torch.softmax(values / temperature, dim=-1)
    return int(indices[torch.multinomial(probs, 1, generator=gen)])


def generate(model, tokenizer, prompt: str, max_new_tokens: int, **kwargs) -> str:
    """Prompt plus its continuation, as text."""
    ids = generate_ids(model, tokenizer.encode(prompt), max_new_tokens,
                       pad_id=tokenizer.eod, stop_id=tokenizer.eod, **kwargs)
    return tokenizer.decode(ids)
