"""Generation without a cache: every new token runs the whole context through the model.

Slower than the cached loop (loop.py), but it runs wherever the model's own forward runs:
every layout (Ulysses and Megatron SP shard the sequence, which a one-token cached step does
not have) and every engine's model (FSDP2 and ZeRO-3 gather parameters in forward hooks,
which the cached step's direct calls of a block's parts would skip). `generate_ids(...,
cache=False)` runs it; the end-of-training sample does, and the cached loop is tested
against it.

Every rank of a tp x sp group runs the same loop: the model returns the same full logits on
each, and sampling draws from a generator seeded identically everywhere, so all ranks pick
the same token with no broadcast. The context is at most `max_context` tokens (a sliding
window), right-padded to a multiple of what the layout's sequence splits need (a block-sparse model's to
`max_context`, the run's sequence length its layout is defined for); with causal attention the
padding cannot change the logits at the last real position. With pp > 1 every rank runs the
forward-only pipeline (`megazoo.pipeline.forward`); the last stage picks the token and sends
it to its pipeline group.
"""
from __future__ import annotations

import torch

from ..models.parts import sequence_multiple_of
from ..pipeline.forward_only import forward
from .sampling import Sampling, choose


def recompute_ids(model, prompts: list[list[int]], max_new_tokens: int, sampling: Sampling, *,
                  seed: int = 0, stop_id: int | None = None,
                  max_context: int | None = None) -> list[list[int]]:
    """The new tokens of each prompt, one prompt at a time (a row stops before `stop_id`)."""
    model.eval()
    device = next(model.parameters()).device
    shard = sequence_multiple_of(model.state)
    sparse = model.config.sparse is not None
    limit = max_context or model.config.max_position_embeddings
    generator = torch.Generator(device=device).manual_seed(seed)
    out = []
    for prompt in prompts:
        ids, new = [int(i) for i in prompt], []
        for _ in range(max_new_tokens):
            context = (ids + new)[-limit:]
            # block-sparse layouts are defined for whole sequences of this length (a window
            # of 3 blocks needs 3 blocks): pad to it; dense attention: to the sp shards
            length = limit if sparse else -(-len(context) // shard) * shard
            padded = context + [0] * (length - len(context))
            logits = forward(model, torch.tensor([padded], device=device))  # last stage: [1, s, V]
            last = None if logits is None else logits[:, len(context) - 1].float()
            token = int(choose(last, sampling, generator, model.state, 1, device)[0])
            if token == stop_id:
                break
            new.append(token)
        out.append(new)
    return out
