"""Sampling: the filters keep exactly the tokens they should, draws follow the filtered
distribution, a seed fixes them, and bad settings are one clear ValueError."""
import math

import pytest
import torch

from megazoo.generation.sampling import Sampling, filter_logits, sample

PROBS = torch.tensor([[0.05, 0.5, 0.15, 0.3], [0.4, 0.1, 0.2, 0.3]])
LOGITS = PROBS.log()


def kept(sampling: Sampling) -> list[set[int]]:
    out = filter_logits(LOGITS, sampling)
    return [set(torch.nonzero(row > -math.inf).flatten().tolist()) for row in out]


def test_top_k_and_top_p_keep_the_right_tokens():
    assert kept(Sampling(top_k=2)) == [{1, 3}, {0, 3}]
    # top-p 0.7: the most likely tokens until their probability reaches 0.7
    assert kept(Sampling(top_p=0.7)) == [{1, 3}, {0, 3}]
    assert kept(Sampling(top_p=0.81)) == [{1, 3, 2}, {0, 3, 2}]
    assert kept(Sampling(top_p=0.01)) == [{1}, {0}]  # the most likely one always stays
    assert kept(Sampling(top_k=1, top_p=0.99)) == [{1}, {0}]
    assert kept(Sampling()) == [{0, 1, 2, 3}] * 2


def test_draws_stay_in_the_filter_and_follow_it():
    how = Sampling(top_k=3, top_p=0.9, temperature=1.0)
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample(LOGITS, how, g) for _ in range(4000)])  # [n, 2]
    assert set(draws[:, 0].tolist()) <= {1, 3, 2} and set(draws[:, 1].tolist()) <= {0, 3, 2}
    # row 0 renormalised over {1, 3, 2}: 0.5 / 0.95 for token 1; 4000 draws: std ~0.008
    assert abs((draws[:, 0] == 1).float().mean().item() - 0.5 / 0.95) < 0.04


def test_a_tiny_temperature_draws_the_most_likely_token():
    g = torch.Generator().manual_seed(0)
    for temperature in (1e-38, 1e-45):
        assert torch.equal(sample(LOGITS, Sampling(temperature=temperature), g),
                           torch.tensor([1, 0]))


def test_temperature_sharpens_and_seed_repeats():
    g = torch.Generator().manual_seed(1)
    cold = torch.stack([sample(LOGITS, Sampling(temperature=0.01), g) for _ in range(200)])
    assert (cold[:, 0] == 1).all() and (cold[:, 1] == 0).all()
    draw = [sample(LOGITS, Sampling(), torch.Generator().manual_seed(7)) for _ in range(2)]
    assert torch.equal(draw[0], draw[1])
    assert torch.equal(sample(LOGITS, Sampling(greedy=True, temperature=3.0)), torch.tensor([1, 0]))


@pytest.mark.parametrize("fields, message", [
    (dict(temperature=0.0), "--temperature must be > 0"),
    (dict(top_k=-1), "--top-k must be >= 0"),
    (dict(top_p=0.0), "--top-p must be in"),
    (dict(top_p=1.5), "--top-p must be in"),
])
def test_bad_settings(fields, message):
    with pytest.raises(ValueError, match=message):
        Sampling(**fields)
