"""Text generation from a trained model (pp = 1, any tp / sp / Megatron-SP layout).

    text = generate(model, tokenizer, "def ", max_new_tokens=80, top_k=1)   # greedy

Every rank of a tp x sp group runs the same loop: the model returns the same full logits on
each, and sampling draws from a generator seeded identically everywhere, so all ranks pick
the same token with no broadcast. No KV cache: the whole context is recomputed per token
(fine for the short samples shown at the end of training). The context is right-padded to
a multiple of the sequence-parallel size; with causal attention the padding cannot change
the logits at the last real position.
"""
from __future__ import annotations

import torch

from ..models.parts import sequence_shard


@torch.no_grad()
def generate_ids(model, ids: list[int], max_new_tokens: int, *, top_k: int = 1,
                 temperature: float = 1.0, seed: int = 0, pad_id: int = 0,
                 max_context: int | None = None, stop_id: int | None = None) -> list[int]:
    """Extend `ids` by up to `max_new_tokens` tokens (top_k=1: greedy)."""
    if model.state.pp.size > 1:
        raise ValueError("generation needs pipeline-parallel size 1; reload the checkpoint "
                         "with --pipeline-model-parallel-size 1")
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
        logits = model(torch.tensor([padded], device=device))[0, len(context) - 1].float().cpu()
        if top_k == 1:
            token = int(logits.argmax())
        else:
            values, indices = logits.topk(min(top_k, logits.numel()))
            probs = torch.softmax(values / temperature, dim=-1)
            token = int(indices[torch.multinomial(probs, 1, generator=gen)])
        out.append(token)
        if stop_id is not None and token == stop_id:
            break
    return out


def generate(model, tokenizer, prompt: str, max_new_tokens: int, **kwargs) -> str:
    """Prompt plus its continuation, as text."""
    ids = generate_ids(model, tokenizer.encode(prompt), max_new_tokens,
                       pad_id=tokenizer.eod, stop_id=tokenizer.eod, **kwargs)
    return tokenizer.decode(ids)
