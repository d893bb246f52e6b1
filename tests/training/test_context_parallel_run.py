"""pretrain_gpt.py with --context-parallel-size 2 on 2 gloo ranks (Ulysses x cp and the
other combinations run in test_context_parallel_training.py): the tiny run's losses
(learned positions; its 32 tokens in 4 chunks) agree with one rank's to 1e-5 relative
(the same float32 sums in another order), the end-of-run sample runs through the recompute
path, and a bad sequence length is one clear error before any collective."""
import pytest

from megazoo.testing import run_distributed
from megazoo.training.run import run_training

from helpers.runs import tiny_argv

SHORT = ("--train-iters", "3", "--lr-decay-iters", "6")


def _runs(argv_sets):
    return [run_training(argv) for argv in argv_sets]


def test_context_parallel_runs_match_one_rank(data, reference):
    ref, _ = reference
    runs = [tiny_argv(data, "--context-parallel-size", "2", *SHORT)]
    for rank_out in run_distributed(_runs, 2, runs, timeout=240):
        assert rank_out[0]["losses"] == pytest.approx(ref["losses"][:3], rel=1e-5)


def test_bad_sequence_length_is_refused(data):
    argv = tiny_argv(data, "--context-parallel-size", "4", "--seq-length", "36")
    with pytest.raises(ValueError, match=r"sequence length 36 must divide by 2\*cp = 8"):
        run_training(argv)
