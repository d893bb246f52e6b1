"""Generation without the KV cache (`generate_ids(cache=False)`, the end-of-training sample)
gives the same tokens at every layout: pp=2 (forward-only pipeline, the last stage broadcasts
its token), tp=2, Ulysses sp=2 and tp=2 with Megatron SP (both shard the sequence, which the
cached loop cannot run) against one process, greedy and top-k sampled.

The layouts compute the same float32 logits up to summation order (~1e-6 relative); with
random weights the top tokens differ by far more than that, so the chosen ids agree exactly.
"""
import torch

import megazoo
from megazoo.generation import Sampling, generate_ids
from megazoo.models import ModelConfig, build_model
from megazoo.parallel import ParallelConfig, ParallelState
from megazoo.testing import run_distributed
from megazoo.training.run import run_training

from helpers.runs import make_data, tiny_argv

CONFIG = dict(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=97,
              max_position_embeddings=64)
PROMPT = [5, 17, 3, 42, 8]
GREEDY, TOP5 = Sampling(greedy=True), Sampling(top_k=5, temperature=0.8)


LAYOUTS = [("gpt", dict(pp=2)), ("llama", dict(tp=2)), ("bloom", dict(pp=2)),
           ("gpt", dict(sp=2)), ("llama", dict(tp=2, megatron_sp=True))]


def _generate_both(cases) -> list[tuple[list, list, list, list]]:
    """Per (family, layout): greedy and sampled at the layout, then in one process."""
    out = []
    for family, layout in cases:
        cfg = ModelConfig(family=family, **CONFIG)
        state = ParallelState.initialize(ParallelConfig(**layout))
        model = build_model(cfg, state, device="cpu", seed=3)
        single = build_model(cfg, None, device="cpu", seed=3)
        runs = []
        for m in (model, single):
            runs.append(generate_ids(m, [PROMPT], 6, GREEDY, cache=False)[0])
            runs.append(generate_ids(m, [PROMPT], 6, TOP5, seed=11, cache=False)[0])
        out.append(tuple(runs))
    return out


def test_every_layout_generates_what_one_process_does():
    """All layouts in one pair of ranks (a spawn costs more than the generation)."""
    for rank_results in run_distributed(_generate_both, 2, LAYOUTS, timeout=300):
        for (family, layout), (greedy, sampled, greedy_1, sampled_1) in zip(LAYOUTS,
                                                                             rank_results):
            assert greedy == greedy_1 and sampled == sampled_1, (family, layout)
            assert len(greedy) == 6


def test_single_process_generation_is_deterministic_and_seeded():
    model = build_model(ModelConfig(family="gpt", **CONFIG), None, device="cpu", seed=3)
    a = generate_ids(model, [PROMPT], 8, TOP5, seed=1, cache=False)
    assert a == generate_ids(model, [PROMPT], 8, TOP5, seed=1, cache=False)
    assert torch.tensor(a).max() < 97


def test_sliding_window_and_stop():
    """Past `max_context` tokens the window slides (more tokens than positions), and a row
    ends before its stop id."""
    model = build_model(ModelConfig(family="gpt", **CONFIG), None, device="cpu", seed=3)
    long = generate_ids(model, [PROMPT], 70, TOP5, seed=2, cache=False, max_context=16)[0]
    assert len(long) == 70
    stop = long[3]
    assert generate_ids(model, [PROMPT], 70, TOP5, seed=2, cache=False, max_context=16,
                        stop_id=stop)[0] == long[:long.index(stop)]


def test_end_of_training_sample_is_what_the_checkpoint_generates(tmp_path):
    """The sample a run prints at its end (greedy, no cache, the engine's model) is the
    cached generation from the checkpoint it saved: the same model, the same tokens."""
    save, lines = tmp_path / "ck", []
    run_training(tiny_argv(make_data(tmp_path), "--save", str(save), "--train-iters", "2",
                           "--generate-tokens", "12", "--generate-top-k", "1"),
                 print_fn=lines.append)
    printed = next(line for line in lines if line.startswith("sample (greedy):"))
    expected = megazoo.generate(str(save), "def", 12, greedy=True)
    assert printed == f"sample (greedy):\n{expected}"
