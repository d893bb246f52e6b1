"""On a GPU: the decode step replayed as a CUDA graph gives the tokens of the eager step.

Both run the same kernels on the same inputs (the graph records the eager step's launches),
so bf16 greedy tokens and sampled tokens (same seed) agree exactly; a graph that read a
stale slot, mask or token buffer would diverge within a few tokens.
"""
import pytest
import torch

from megazoo.generation.loop import generate_ids
from megazoo.generation.sampling import Sampling
from megazoo.models import ModelConfig, build_model

PROMPTS = [[(13 * i + 7) % 500 for i in range(n)] for n in (17, 5, 30)]


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["gpt", "bloom", "llama"])
def test_cuda_graph_decode_equals_eager(family, capfd):
    extra = dict(num_key_value_heads=2) if family == "llama" else dict(tie_word_embeddings=False)
    cfg = ModelConfig(family=family, num_layers=4, hidden_size=256, num_attention_heads=8,
                      vocab_size=500, max_position_embeddings=128, init_std=0.1, **extra)
    model = build_model(cfg, None, device="cuda", dtype=torch.bfloat16, seed=0)
    for how in (Sampling(greedy=True), Sampling(top_k=20, top_p=0.9, temperature=0.8)):
        eager = generate_ids(model, PROMPTS, 40, how, seed=3, cuda_graphs=False)
        graph = generate_ids(model, PROMPTS, 40, how, seed=3, cuda_graphs=True)
        assert graph == eager, (family, how)
    assert "capture of the decode step failed" not in capfd.readouterr().err  # no fallback
