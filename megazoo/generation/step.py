"""One forward step of a model with a KV cache: the new tokens through this rank's layers.

The model's own modules compute everything (the QKV and output projections with their tp
collectives, norms, MLPs, embedding tables and the vocab-parallel head); only the middle of
attention differs from `TransformerModel.forward`: keys and values of the new tokens go into
the cache, and the queries attend to the whole static cache under the step's mask.

GQA without expanding the cache: the GL query heads of one kv group are laid out as GL x s
query rows of that group, q [b, KL, GL s, d], against k, v [b, KL, L, d]; one SDPA call
covers every group (cache.py builds the mask in the same row order).

| tensor | shape |
|---|---|
| ids | [b, s] new token ids, the same on every tp rank |
| x (hidden) | [s, b, h] (the package's layout; no sequence sharding while generating) |
| qkv | [s, b, KL (GL + 2) d] this tp rank's fused projection (heads.py) |
| logits | [b, vocab] at the last new token, the same on every tp rank |
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..layers.positions import apply_rope
from ..models.parts import full_logits
from ..pipeline.p2p import Channel
from .cache import KVCache, StepInputs


def check_sequence_unsharded(model) -> None:
    """ValueError for layouts the cached step does not run: Ulysses or Megatron SP shard the
    sequence, which a one-token decode step does not have."""
    cfg = model.state.config
    if model.state.sp.size > 1 or model.state.cp.size > 1 or cfg.megatron_sp:
        raise ValueError("generation runs without sequence parallelism: load the model with "
                         "sp=1, cp=1 and megatron_sp=False (any tp and pp)")


def embed(model, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """ids, positions [b, s] -> x [s, b, h], as `Embedding.forward` at per-row positions.
    No host read: prompt ids were checked by `check_request`, sampled ids are < vocab."""
    emb = model.embedding
    x = emb.word_embeddings.lookup(ids.t())  # [s, b, h] contiguous; ids checked before
    if emb.position_embeddings is not None:
        x = x + emb.position_embeddings[positions.t()]  # [s, b, h]
    return x if emb.norm is None else emb.norm(x)


def attention_step(attn, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   inp: StepInputs) -> torch.Tensor:
    """ParallelAttention `attn` on x [s, b, h] with the cache of its layer -> [s, b, h]."""
    lay = attn.layout
    kl, gl = lay.tp_groups
    d = lay.head_dim
    qkv = attn.qkv(x)  # [s, b, KL (GL+2) d]
    s, b = qkv.shape[0], qkv.shape[1]
    q, k, v = qkv.view(s, b, kl, gl + 2, d).split([gl, 1, 1], dim=3)
    q, k, v = q.reshape(s, b, kl * gl, d), k.squeeze(3), v.squeeze(3)  # [s, b, heads, d]
    if inp.rope is not None:
        q, k = apply_rope(q, k, *inp.rope)
    k_cache.index_copy_(2, inp.slots, k.permute(1, 2, 0, 3).to(k_cache.dtype))  # [b, KL, s, d]
    v_cache.index_copy_(2, inp.slots, v.permute(1, 2, 0, 3).to(v_cache.dtype))
    q = q.view(s, b, kl, gl, d).permute(1, 2, 3, 0, 4).reshape(b, kl, gl * s, d)
    out = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=inp.mask)
    out = out.view(b, kl, gl, s, d).permute(3, 0, 1, 2, 4).reshape(s, b, kl * gl * d)
    return attn.dense(out)  # row-parallel: all-reduce over tp


def block_step(block, x: torch.Tensor, cache: KVCache, inp: StepInputs) -> torch.Tensor:
    """`TransformerBlock` (eval: no dropout) with its layer's cache."""
    i = block.layer_number
    x = x + attention_step(block.attention, block.input_norm(x), cache.k[i], cache.v[i], inp)
    return x + block.mlp(block.post_attention_norm(x))


def head(model, x: torch.Tensor) -> torch.Tensor:
    """x [s, b, h] -> logits [b, vocab] of the last token (gathered over tp)."""
    shard = model.logits(model.final_norm(x[-1:]))
    return full_logits(shard, model.config.vocab_size, model.state)[:, -1]


def model_step(model, ids: torch.Tensor, cache: KVCache, inp: StepInputs) -> torch.Tensor | None:
    """ids [b, s] through this rank's chunks -> logits [b, vocab] on the last pipeline stage,
    None on the others. With pp > 1 the hidden states [s, b, h] go from stage to stage and
    chunk to chunk (the last stage's chunk c feeds the first stage's chunk c + 1)."""
    state = model.state
    pp, rank = state.pp.size, state.pp.rank
    prev, nxt = state.pp.ranks[(rank - 1) % pp], state.pp.ranks[(rank + 1) % pp]
    shape = (ids.shape[1], ids.shape[0], model.config.hidden_size)  # [s, b, h]
    channel, last, logits = Channel(state.pp.group), len(model.chunks) - 1, None
    for c in range(last + 1):
        if c == 0 and model.pre_process:
            x = embed(model, ids, inp.positions)
        elif pp > 1:
            x = channel.recv(shape, cache.dtype, cache.device, prev)
        for i in model.chunks[c]:
            x = block_step(model.layers[str(i)], x, cache, inp)
        if c == last and model.post_process:
            logits = head(model, x)
        elif pp > 1:
            channel.send(x, nxt)
    channel.drain()
    return logits
