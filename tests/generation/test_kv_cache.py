"""Generation with the KV cache against full recomputation (`training.generate`, which runs
the whole context through the model for every token), token for token, greedy.

Both compute the same float32 function up to summation order (the cache attends over a
longer, masked key range; the layouts reduce over tp in another order): logits agree to
~1e-6 relative, far below the gaps between the top logits of these random models, so the
argmax tokens agree exactly. The models use init_std 0.3 and untied heads so that greedy
output does not collapse to repeating the last prompt token (which would hide bugs).
"""
import pytest
import torch

from megazoo.generation.loop import generate_ids
from megazoo.generation.sampling import Sampling
from megazoo.models import ModelConfig, build_model
from megazoo.parallel import ParallelConfig, ParallelState
from megazoo.testing import run_distributed
from megazoo.training.generate import generate_ids as recompute_ids

PROMPTS = [[5, 17, 3, 42, 8], [1, 2], [9, 30, 9, 60, 9, 9, 71, 9, 9]]
NEW = 10
FAMILIES = {
    "gpt": dict(tie_word_embeddings=False),
    "bloom": dict(tie_word_embeddings=False),
    "llama": dict(num_key_value_heads=2),  # GQA: two query heads per kv head
    "llama-mqa": dict(num_key_value_heads=1),  # one kv head, replicated over tp ranks
}


def config(name: str) -> ModelConfig:
    return ModelConfig(family=name.split("-")[0], num_layers=4, hidden_size=32,
                       num_attention_heads=4, vocab_size=97, max_position_embeddings=64,
                       init_std=0.3, **FAMILIES[name])


def reference(name: str) -> list[list[int]]:
    """Greedy continuations of PROMPTS, one prompt at a time, recomputed without a cache."""
    model = build_model(config(name), None, device="cpu", seed=3)
    return [recompute_ids(model, p, NEW, top_k=1)[len(p):] for p in PROMPTS]


def _cached_at_layout(layout: dict, names: list[str]) -> dict:
    state = ParallelState.initialize(ParallelConfig(**layout))
    out = {}
    for name in names:
        model = build_model(config(name), state, device="cpu", seed=3)
        out[name] = (generate_ids(model, PROMPTS, NEW), reference(name))
    return out


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_cached_greedy_equals_recompute_and_batch_equals_alone(name):
    model = build_model(config(name), None, device="cpu", seed=3)
    expected = reference(name)
    assert generate_ids(model, PROMPTS, NEW) == expected
    for prompt, want in zip(PROMPTS, expected):
        assert generate_ids(model, [prompt], NEW) == [want]
    assert len({tuple(r) for r in expected}) == len(expected)  # not all the same tokens


@pytest.mark.parametrize("layout", [dict(tp=2), dict(pp=2), dict(pp=2, vpp=2)],
                         ids=["tp2", "pp2", "pp2-vpp2"])
def test_cached_greedy_at_layouts_equals_one_process(layout):
    names = ["gpt", "bloom", "llama", "llama-mqa"] if layout.get("tp") else ["gpt", "bloom", "llama"]
    for rank_out in run_distributed(_cached_at_layout, 2, layout, names, timeout=240):
        for name, (cached, expected) in rank_out.items():
            assert cached == expected, (name, layout)


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
