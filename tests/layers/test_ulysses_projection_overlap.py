"""Ulysses with its all-to-alls chunked by kv groups and overlapped with the QKV and output
projections (`megazoo.layers.ulysses_overlap`) against the one-process model on gloo, and
what it issues. Tolerance: tests/helpers/model_checks.py (rtol 1e-4, atol 1e-5, fp32)."""
from collections import Counter

from helpers import comm_checks
from megazoo.testing import run_distributed


def test_chunked_ulysses_matches_one_process():
    assert run_distributed(comm_checks.check_ulysses_chunks, 2, timeout=300) == [[], []]


def test_chunked_ulysses_issues_k_all_to_alls_each_way():
    def per_layer(counts, way):
        return Counter({k: (counts[3][way][k] - counts[1][way].get(k, 0)) // 2
                        for k in counts[3][way] if k[0] == "all_to_all"})

    counts = run_distributed(comm_checks.model_counts, 2, 1, 2, False, 1, 2, timeout=300)[0]
    # tiny_gpt: 4 heads, sp 2 -> 2 kv groups per rank -> 2 chunks per all-to-all
    assert per_layer(counts, "forward") == per_layer(counts, "backward") == Counter(
        {("all_to_all", "sp"): 4})
