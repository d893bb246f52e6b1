"""Pipeline executor vs the unpipelined model on gloo: pp = 2 and 4, vpp = 1 and 2,
m = p, 2p, 3p, with tp = 2 and dp = 2 where 8 ranks allow."""
import pytest

from helpers import pipeline_checks
from megazoo.testing import run_distributed

FOUR_RANKS = [(1, 4, 1, m) for m in (4, 8, 12)] + [(1, 4, 2, m) for m in (4, 8)] \
    + [(1, 2, 1, m) for m in (2, 4, 6)] + [(1, 2, 2, m) for m in (2, 4, 6)] \
    + [(2, 2, 1, 4), (2, 2, 2, 4)]
EIGHT_RANKS = [(2, 2, 2, 6), (2, 4, 1, 4), (2, 4, 2, 8), (1, 4, 2, 12)]


def _ok(results):
    errors = [e for rank_errors in results for e in rank_errors]
    assert not errors, "\n".join(errors[:20])


def test_pipeline_four_ranks():
    """pp=4 (dp=1), pp=2 with dp=2, pp=2 with tp=2."""
    _ok(run_distributed(pipeline_checks.check_layouts, 4, FOUR_RANKS, timeout=600))


def test_pipeline_eight_ranks_with_tp_and_dp():
    _ok(run_distributed(pipeline_checks.check_layouts, 8, EIGHT_RANKS, timeout=600))


@pytest.mark.parametrize("family", ["bloom", "llama"])
def test_pipeline_other_families(family):
    _ok(run_distributed(pipeline_checks.check_layouts, 4, [(1, 2, 2, 4), (2, 2, 1, 2)],
                        (family,), timeout=300))


def test_forward_only():
    _ok(run_distributed(pipeline_checks.check_forward_only, 2, timeout=120))
