"""Tensor-parallel layers against single-process torch.nn, on 4 gloo ranks (tp = 1, 2, 4)."""
import pytest

from helpers import tp_checks
from megazoo.testing import run_distributed

CHECKS = ["check_column", "check_row", "check_mlp", "check_parallel_mlp_fused", "check_embedding",
          "check_cross_entropy"]


@pytest.mark.parametrize("check", CHECKS)
def test_layer_matches_single_process(check):
    assert run_distributed(getattr(tp_checks, check), 4, timeout=180) == [True] * 4


def test_bad_sequence_length_raises_on_every_rank():
    messages = run_distributed(tp_checks.check_bad_sequence_length, 2, timeout=60)
    assert all("not divisible by the group size 2" in m for m in messages)


@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("check", CHECKS)
def test_layer_matches_single_process_nccl(check):
    assert run_distributed(getattr(tp_checks, check), 2, "cuda", timeout=300,
                           backend="nccl") == [True] * 2
