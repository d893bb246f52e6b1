"""ParallelAttention / Ulysses on gloo ranks against the one-process block (attention_checks.py).

World 4 covers sp = 4, tp = 2 x sp = 2 (with and without Megatron sequence parallelism),
sp = 2 x dp = 2, tp = 2 and tp = 4 (kv heads replicated); many cases per spawn, since a spawn
costs seconds.
"""
import pytest

from helpers import attention_checks
from megazoo.testing import run_distributed


@pytest.mark.parametrize("check", ["check_ulysses", "check_tensor_parallel"])
def test_attention_matches_single_process(check):
    worst = run_distributed(getattr(attention_checks, check), 4, timeout=240)
    assert max(worst) < 1e-4  # worst relative difference, for the record (asserted per tensor)


def test_bad_inputs_raise_value_error_on_every_rank():
    results = run_distributed(attention_checks.check_bad_inputs, 2, timeout=60)
    for errors, shape in results:
        assert "not divisible by tp*sp" in errors["heads"]
        assert "cannot be split over 2 ranks" in errors["kv_heads"]
        assert "sequence length 5 must divide by 2 (Ulysses sp=2)" in errors["sequence"]
        assert "padding_mask must be bool [b, s] = [2, 6]" in errors["mask"]
        assert "position_ids must be [s] or [b, s]" in errors["positions"]
        assert "expects x [s_local, b, 16]" in errors["width"]
        assert shape == (3, 2, 16)


# On 2 GPUs: sp = 2 and tp = 2 (with Megatron SP), NCCL, the auto backend (FlexAttention for ALiBi).
@pytest.mark.gpu(count=2)
@pytest.mark.parametrize("check", ["check_ulysses", "check_tensor_parallel"])
def test_attention_matches_single_process_nccl(check):
    worst = run_distributed(getattr(attention_checks, check), 2, "cuda", timeout=600,
                            backend="nccl")
    assert max(worst) < 2e-3
