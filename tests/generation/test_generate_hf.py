"""A Hugging Face model converted to megazoo generates what transformers' own greedy
`generate` (with its KV cache) produces, for each family, one prompt at a time and batched
(megazoo left-pads the batch; each row must still equal the prompt generated alone).

float32 on both sides; the converted logits match HF's to ~1e-6 relative
(tests/checkpoint/test_convert.py), far below the gaps between these random models' top logits.
"""
import os

import pytest
import torch

import megazoo
from megazoo.convert import hf_to_megazoo
from megazoo.generation.loop import generate_ids
from helpers.hf_models import VOCAB, hf_model

PROMPTS = [[(11 * i + 5) % VOCAB for i in range(n)] for n in (6, 3, 9)]
NEW = 8


def spread(model):
    """helpers.hf_models' tiny model with its matrices scaled up 8x: at the initial std (0.02) the
    greedy output repeats one token, which would hide position and cache errors."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    return model


def hf_greedy(model, prompt: list[int]) -> list[int]:
    model.generation_config.eos_token_id = None  # generate all NEW tokens, as megazoo does
    model.generation_config.pad_token_id = 0
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                         dtype=torch.long), max_new_tokens=NEW, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", ["gpt2", "bloom", "llama"])
def test_converted_model_generates_what_transformers_generates(tmp_path, kind):
    pytest.importorskip("transformers")
    hf = spread(hf_model(kind))
    hf.save_pretrained(tmp_path / "hf")
    hf_to_megazoo(tmp_path / "hf", tmp_path / "mz")
    model = megazoo.load_pretrained(tmp_path / "mz")
    expected = [hf_greedy(hf, p) for p in PROMPTS]
    assert generate_ids(model, PROMPTS, NEW) == expected
    assert megazoo.generate(str(tmp_path / "mz"), PROMPTS, NEW, greedy=True) == expected
    assert os.path.isfile(tmp_path / "mz" / "megazoo.json")
