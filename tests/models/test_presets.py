"""Presets: every one builds on the meta device, and parameter counts are exact."""
import time

import pytest

from megazoo.models import PRESETS, build_model, count_parameters

# Published / commonly quoted totals (HF configs; GPT-3 with the vocabulary padded to 51,200).
EXACT = {
    "bloom-176b": 176_247_271_424,
    "gpt3-175b": 174_615_846_912,
    "bloom-560m": 559_214_592,
    "bloom-7b1": 7_069_016_064,
    "llama-7b": 6_738_415_616,
    "llama-13b": 13_015_864_320,
    "llama-70b": 68_976_648_192,
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_builds_on_meta_and_counts_match(name):
    start = time.monotonic()
    model = build_model(name)  # meta device by default
    assert time.monotonic() - start < 60  # seconds, not minutes (generous; not a benchmark)
    assert all(p.device.type == "meta" for p in model.parameters())
    built = sum(p.numel() for p in model.parameters())
    assert built == count_parameters(PRESETS[name])
    if name in EXACT:
        assert built == EXACT[name]


def test_gpt3_vocabulary_padding():
    cfg = PRESETS["gpt3-175b"]
    assert [cfg.padded_vocab(tp) for tp in (1, 2, 8)] == [51200] * 3
    assert PRESETS["gpt-1.3b"].padded_vocab(1) == 50304
    assert count_parameters(cfg, padded=False) == 174_615_846_912 - (51200 - 50257) * 12288


def test_presets_are_the_published_shapes():
    shape = {n: (c.num_layers, c.hidden_size, c.num_attention_heads) for n, c in PRESETS.items()}
    assert shape["gpt3-175b"] == (96, 12288, 96)
    assert shape["bloom-176b"] == (70, 14336, 112)
    assert shape["llama-70b"] == (80, 8192, 64)
    assert PRESETS["llama-70b"].num_key_value_heads == 8
    assert PRESETS["llama-70b"].ffn_hidden_size == 28672
    assert {PRESETS[n].vocab_size for n in PRESETS if n.startswith("bloom")} == {250880}
