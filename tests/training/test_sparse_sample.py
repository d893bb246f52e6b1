"""The sample a run prints at its end works for block-sparse models whatever the prompt's
length: a layout is defined for whole blocks (a prompt of 3 tokens is no multiple of a
16-token block) and may need several blocks (a sliding window of 3), so the context is padded
to the run's sequence length; causal attention keeps the padding out of the last real
position's logits, so the greedy sample is that of the unpadded dense computation's rule."""
import pytest

from helpers.runs import make_data, tiny_argv
from megazoo.training.run import run_training


@pytest.mark.parametrize("sparse", [
    ["--sparse-attention-mode", "fixed", "--sparse-block", "16"],
    ["--sparse-attention-mode", "bigbird", "--sparse-block", "16", "--sparse-attention-config",
     '{"num_random_blocks": 1, "num_sliding_window_blocks": 3}']])
def test_end_of_run_sample_of_a_block_sparse_model(tmp_path, sparse):
    lines = []
    out = run_training(tiny_argv(make_data(tmp_path), "--train-iters", "1", "--seq-length",
                                 "64", "--generate-tokens", "3", *sparse),
                       print_fn=lines.append)
    assert len(out["losses"]) == 1
    [sample] = [x for x in lines if x.startswith("sample (")]
    assert sample.split("\n", 1)[1].startswith("def")  # the prompt, then its continuation
