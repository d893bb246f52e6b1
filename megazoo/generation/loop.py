"""The generation loop: left-pad the prompts, prefill the cache, decode token by token.

    new = generate_ids(model, [[5, 17, 3], [8]], 20, Sampling(greedy=True))  # per prompt

`model` is a `TransformerModel` at any tp x pp layout (sp = 1, no Megatron SP; with
`cache=False` any layout, see recompute.py); every rank of the model calls this with the same
arguments. Prefill runs the padded prompts through the model once (`step.model_step`),
writing the cache; each decode step then runs one token per row. The last stage picks the
tokens and broadcasts them to its pipeline group; tp ranks hold the same gathered logits and
the same seeded generator, so they pick the same tokens.

The decode step has fixed shapes (the static cache of cache.py, the slot a device tensor);
on CUDA at tp = pp = 1 it is captured once as a CUDA graph and replayed per token
(graphs.py), unless `cuda_graphs=False`.
"""
from __future__ import annotations

import torch

from .cache import KVCache
from .graphs import DecodeStep
from .recompute import recompute_ids
from .sampling import Sampling, choose
from .step import check_sequence_unsharded, model_step

STOP_CHECK = 8  # decode steps between checks whether every row has stopped


def check_request(prompts, max_new_tokens: int, config, window: bool = False) -> None:
    """ValueError (one line, naming what to change) for prompts or lengths the model cannot
    take (with a sliding `window` any length); no collective, so every rank fails alike."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("no prompt given: pass at least one --prompt")
    for n, ids in enumerate(prompts):
        if len(ids) == 0:
            raise ValueError(f"prompt {n + 1} is empty (no tokens): give it some text")
        bad = [i for i in ids if not 0 <= int(i) < config.vocab_size]
        if bad:
            raise ValueError(f"prompt {n + 1} holds token id {bad[0]} outside the model's "
                             f"vocabulary of {config.vocab_size}: use the checkpoint's tokenizer")
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    longest = max(len(ids) for ids in prompts)
    if not window and longest + max_new_tokens > config.max_position_embeddings:
        room = config.max_position_embeddings - longest
        fix = (f"shorten the prompt or lower --max-new-tokens to {room}" if room >= 1 else
               f"shorten the prompt to at most {config.max_position_embeddings - 1} tokens")
        raise ValueError(f"a prompt of {longest} tokens plus --max-new-tokens {max_new_tokens} "
                         f"exceeds the model's {config.max_position_embeddings} positions "
                         f"(max_position_embeddings): {fix}")


def cache_length(total: int, config) -> int:
    """Slots of the static cache: the total length rounded up to the sparse block, or to a
    multiple of 8 (aligned rows of the attention mask for SDPA's fused kernels; the slots past
    the total are never written and, being in every query's future, never seen)."""
    sparse = config.sparse
    unit = 8 if sparse is None else sparse.block
    return -(-total // unit) * unit


def build_cache(model, pad: torch.Tensor, total: int) -> KVCache:
    """A KVCache for this rank's layers, in the model's dtype and device."""
    held = [i for chunk in model.chunks for i in chunk]
    first = model.layers[str(held[0])].attention
    weight = first.qkv.weight
    return KVCache(first.attention, held, pad, cache_length(total, model.config),
                   dtype=weight.dtype, device=weight.device)


def left_pad(prompts: list[list[int]], device, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [b, P] left-padded with pad_id, pad [b]: how many pads each row has)."""
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.int64)
    for row, p in enumerate(prompts):
        ids[row, longest - len(p):] = torch.tensor([int(i) for i in p], dtype=torch.int64)
    pad = torch.tensor([longest - len(p) for p in prompts], dtype=torch.int64)
    return ids.to(device), pad.to(device)


@torch.no_grad()
def generate_ids(model, prompts: list[list[int]], max_new_tokens: int,
                 sampling: Sampling = Sampling(greedy=True), *, seed: int = 0,
                 stop_id: int | None = None, cuda_graphs: bool | None = None,
                 cache: bool = True, max_context: int | None = None) -> list[list[int]]:
    """The new tokens of each prompt (up to `max_new_tokens`; a row stops before `stop_id`).

    cuda_graphs: None captures the decode step on CUDA at tp = pp = 1 (falling back to eager
    with a warning if capture fails), True asks for it (also at tp > 1, NCCL collectives
    inside the graph; never at pp > 1), False never captures.
    cache=False: no KV cache, the whole context (its last `max_context` tokens, default the
    model's positions) recomputed per token (recompute.py: any layout, any engine's model).
    """
    check_request(prompts, max_new_tokens, model.config, window=not cache)
    if not cache:
        return recompute_ids(model, prompts, max_new_tokens, sampling, seed=seed,
                             stop_id=stop_id, max_context=max_context)
    check_sequence_unsharded(model)
    model.eval()
    state, device = model.state, next(model.parameters()).device
    graphs = use_graphs(cuda_graphs, device, state)
    ids, pad = left_pad(prompts, device)
    batch, longest = ids.shape
    cache = build_cache(model, pad, longest + max_new_tokens)
    generator = torch.Generator(device=device).manual_seed(seed)
    logits = model_step(model, ids, cache, cache.inputs(torch.arange(longest, device=device)))
    tokens = choose(logits, sampling, generator, state, batch, device)
    out = [tokens]
    finished = None if stop_id is None else tokens == stop_id
    if max_new_tokens > 1:
        step = DecodeStep(lambda t, inp: model_step(model, t, cache, inp), cache, batch, longest,
                          use_graph=graphs)
    for n in range(1, max_new_tokens):
        # Reading `finished` waits for the GPU: look every STOP_CHECK tokens only.
        if finished is not None and n % STOP_CHECK == 0 and bool(finished.all()):
            break
        tokens = choose(step(tokens), sampling, generator, state, batch, device)
        out.append(tokens)
        if finished is not None:
            finished |= tokens == stop_id
    return _trim(torch.stack(out, dim=1).tolist(), stop_id)


def use_graphs(requested: bool | None, device, state) -> bool:
    """Whether to capture the decode step (see `generate_ids`); never under pipeline
    parallelism, whose step sends and receives between stages."""
    if requested and device.type != "cuda":
        raise ValueError("--cuda-graphs needs a CUDA device; drop the flag on CPU")
    if requested is None:
        return device.type == "cuda" and state.pp.size == 1 and state.tp.size == 1
    return requested and state.pp.size == 1


def _trim(rows: list[list[int]], stop_id: int | None) -> list[list[int]]:
    """Each row up to (not including) its first stop_id."""
    if stop_id is None:
        return rows
    return [row[:row.index(stop_id)] if stop_id in row else row for row in rows]
