"""Generation with the KV cache against full recomputation (`cache=False`, which runs the
whole context through the model for every token), token for token, greedy.

Block-sparse models generate as the model run on the sequence right-padded to the cache
length L (the total length rounded up to the block; cache.py): their reference recomputes
each step on the context right-padded to L (causal, so the padding changes nothing before
it), with prompts whose lengths are not multiples of the block.

Both compute the same float32 function up to summation order (the cache attends over a
longer, masked key range; the layouts reduce over tp in another order): logits agree to
~1e-6 relative, far below the gaps between the top logits of these random models, so the
argmax tokens agree exactly. The models use init_std 0.3 and untied heads so that greedy
output does not collapse to repeating the last prompt token (which would hide bugs).
"""
import pytest
import torch

from megazoo.generation.loop import cache_length, generate_ids
from megazoo.generation.sampling import Sampling
from megazoo.models import ModelConfig, build_model
from megazoo.parallel import ParallelConfig, ParallelState
from megazoo.testing import run_distributed

PROMPTS = [[5, 17, 3, 42, 8], [1, 2], [9, 30, 9, 60, 9, 9, 71, 9, 9]]
NEW = 10
FAMILIES = {
    "gpt": dict(tie_word_embeddings=False),
    "bloom": dict(tie_word_embeddings=False),
    "llama": dict(num_key_value_heads=2),  # GQA: two query heads per kv head
    "llama-mqa": dict(num_key_value_heads=1),  # one kv head, replicated over tp ranks
    # block 16, prompts of 5 to 37 tokens: the layouts' 3-4 blocks each restrict attention
    "gpt-sparse": dict(tie_word_embeddings=False, sparse_attention={
        "mode": "bigbird", "block": 16, "different_layout_per_head": True,
        "num_random_blocks": 1, "num_sliding_window_blocks": 1}),
    "bloom-sparse": dict(tie_word_embeddings=False, sparse_attention={
        "mode": "fixed", "block": 16, "different_layout_per_head": True, "num_local_blocks": 2,
        "num_different_global_patterns": 2}),
    "llama-sparse": dict(num_key_value_heads=2, sparse_attention={
        "mode": "bslongformer", "block": 16, "num_sliding_window_blocks": 1,
        "global_block_indices": [0]}),
}
SPARSE_PROMPTS = [[(7 * i + 3) % 97 for i in range(n)] for n in (21, 37, 5)]


def config(name: str) -> ModelConfig:
    return ModelConfig(family=name.split("-")[0], num_layers=4, hidden_size=32,
                       num_attention_heads=4, vocab_size=97, max_position_embeddings=64,
                       init_std=0.3, **FAMILIES[name])


def prompts(name: str) -> list[list[int]]:
    return SPARSE_PROMPTS if name.endswith("sparse") else PROMPTS


def padded_recompute(model, prompt: list[int], length: int) -> list[int]:
    """Greedy, the whole context right-padded to `length` through the model at every step."""
    ids = list(prompt)
    for _ in range(NEW):
        logits = model(torch.tensor([ids + [0] * (length - len(ids))]))[0, len(ids) - 1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def reference(name: str) -> list[list[int]]:
    """Greedy continuations of the prompts, one at a time, recomputed without a cache."""
    model = build_model(config(name), None, device="cpu", seed=3)
    if name.endswith("sparse"):
        length = cache_length(max(map(len, SPARSE_PROMPTS)) + NEW, model.config)
        with torch.no_grad():
            return [padded_recompute(model, p, length) for p in SPARSE_PROMPTS]
    return generate_ids(model, PROMPTS, NEW, cache=False)


LAYOUTS = {"tp2": dict(tp=2), "pp2": dict(pp=2), "pp2-vpp2": dict(pp=2, vpp=2)}


def names_at(layout: str) -> list[str]:
    extra = ["llama-mqa", "gpt-sparse", "llama-sparse"] if layout == "tp2" else ["bloom-sparse"]
    return ["gpt", "bloom", "llama"] + extra


def _cached_at_layouts() -> dict:
    out = {}
    for layout, sizes in LAYOUTS.items():
        state = ParallelState.initialize(ParallelConfig(**sizes))
        for name in names_at(layout):
            model = build_model(config(name), state, device="cpu", seed=3)
            out[layout, name] = generate_ids(model, prompts(name), NEW)
    return out


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_cached_greedy_equals_recompute_and_batch_equals_alone(name):
    model = build_model(config(name), None, device="cpu", seed=3)
    expected = reference(name)
    assert generate_ids(model, prompts(name), NEW) == expected
    for prompt, want in zip(prompts(name), expected):
        if not name.endswith("sparse"):  # alone, a sparse prompt gets a shorter cache
            assert generate_ids(model, [prompt], NEW) == [want]
    assert len({tuple(r) for r in expected}) == len(expected)  # not all the same tokens


def test_cached_greedy_at_tp2_pp2_and_interleaved_pp2_equals_one_process():
    """Every rank of each layout (both tp ranks; both pipeline stages, which receive the
    last stage's tokens) returns the one-process recomputation's tokens."""
    expected = {name: reference(name) for name in FAMILIES}
    for rank_out in run_distributed(_cached_at_layouts, 2, timeout=240):
        assert len(rank_out) == sum(len(names_at(layout)) for layout in LAYOUTS)
        for (layout, name), cached in rank_out.items():
            assert cached == expected[name], (layout, name)


def test_stop_token_ends_a_row():
    model = build_model(config("llama"), None, device="cpu", seed=3)
    full = generate_ids(model, PROMPTS, NEW)
    stop = full[0][3]
    cut = generate_ids(model, PROMPTS, NEW, stop_id=stop)
    for row, whole in zip(cut, full):
        assert row == (whole[:whole.index(stop)] if stop in whole else whole)


def test_sampling_is_seeded():
    model = build_model(config("gpt"), None, device="cpu", seed=3)
    how = Sampling(temperature=0.9, top_k=20, top_p=0.9)
    a = generate_ids(model, PROMPTS, NEW, how, seed=4)
    assert a == generate_ids(model, PROMPTS, NEW, how, seed=4)
    assert a != generate_ids(model, PROMPTS, NEW, how, seed=5)
