"""How many collectives tensor / sequence parallelism issue, counted on gloo
(`megazoo.parallel.comm_count.CommCounter`, through the dispatcher's c10d ops).

Megatron SP's minimum per transformer layer and micro-batch (two column-parallel GEMM
groups, QKV and fc1, and two row-parallel GEMMs, dense and fc2): forward one all-gather
before each column group and one reduce-scatter after each row GEMM; backward the mirror (a
reduce-scatter of each column group's input gradient, an all-gather of each row GEMM's
output gradient). Megatron also re-gathers the column input for the weight gradient;
megazoo keeps the gathered input instead (no re-gather; (1 - 1/tp) s b h more activation
memory per column group), so its backward count is the mirror exactly. No all-reduce per
layer. Without SP: one all-reduce per row GEMM forward and per column group backward.
Ulysses: two all-to-alls per layer each way. A layer's count is (3-layer model - 1-layer
model) / 2: the embedding, head and loss cancel.

Sequence-parallel parameters' gradients (norms, row biases, learned positions) are summed
over tp once per step: one all-reduce of all of them (one gradient bucket here) after the
last micro-batch, whatever the number of micro-batches.
"""
from collections import Counter

import pytest

from helpers import comm_checks
from megazoo.plan.collectives import layer_collectives
from megazoo.testing import run_distributed


def _per_layer(counts: dict, way: str) -> Counter:
    more, one = counts[3][way], counts[1][way]
    diff = Counter({k: (more[k] - one.get(k, 0)) // 2 for k in more})
    assert all(more[k] - one.get(k, 0) == 2 * diff[k] for k in more)  # whole per-layer counts
    return +diff


@pytest.mark.parametrize("tp, sp, megatron_sp, chunks, forward, backward", [
    (2, 1, True, 1, {("all_gather", "tp"): 2, ("reduce_scatter", "tp"): 2},
     {("all_gather", "tp"): 2, ("reduce_scatter", "tp"): 2}),
    (2, 1, True, 2, {("all_gather", "tp"): 4, ("reduce_scatter", "tp"): 4},
     {("all_gather", "tp"): 4, ("reduce_scatter", "tp"): 4}),
    (2, 1, False, 1, {("all_reduce", "tp"): 2}, {("all_reduce", "tp"): 2}),
    (1, 2, False, 1, {("all_to_all", "sp"): 2}, {("all_to_all", "sp"): 2}),
], ids=["tp2_sp", "tp2_sp_2chunks", "tp2", "ulysses_sp2"])
def test_layer_issues_the_minimum(tp, sp, megatron_sp, chunks, forward, backward):
    counts = run_distributed(comm_checks.model_counts, 2, tp, sp, megatron_sp, chunks,
                             timeout=300)[0]
    assert _per_layer(counts, "forward") == Counter(forward)
    assert _per_layer(counts, "backward") == Counter(backward)
    # the planner's per-layer collectives: the same calls and bytes (fp32 here)
    planned = layer_collectives(comm_checks.tiny_gpt(1), tp=tp, sp=sp, megatron_sp=megatron_sp,
                                micro_batch=comm_checks.B, seq_length=comm_checks.S,
                                chunks=chunks, elem_bytes=4)
    for way, want in (("forward", forward), ("backward", backward)):
        calls = Counter()
        for c in planned:
            if c.direction == way:
                calls[c.kind, c.group] += c.calls
        assert calls == Counter(want)
    layer_bytes = {k: (counts[3]["bytes"][k] - counts[1]["bytes"].get(k, 0)) // 2
                   for k in counts[3]["bytes"]}
    planned_bytes = Counter()
    for c in planned:
        planned_bytes[c.kind, c.group] += c.bytes
    assert +Counter(layer_bytes) == planned_bytes
    for layers in (1, 3):
        assert counts[layers]["host_syncs"] == 0 and counts[layers]["events"] == 0
    if megatron_sp:  # outside the layers: embedding reduce-scatter, head all-gather, and
        # the vocab-parallel loss's two small all-reduces (max; target logit and sum of exp)
        assert counts[1]["forward"][("all_reduce", "tp")] == 2
        # per layer each way: 2 all-gathers and 2 reduce-scatters of [s, b, h] fp32 in all,
        # however many chunks carry them
        layer = comm_checks.S * comm_checks.B * comm_checks.H * 4
        for kind in ("all_gather", "reduce_scatter"):
            assert layer_bytes[kind, "tp"] == 2 * 2 * layer


def test_sequence_parallel_grads_reduced_once_per_step():
    for micro_batches in (1, 3):
        out = run_distributed(comm_checks.step_counts, 2, micro_batches, timeout=300)[0]
        assert out["buckets"] == 1
        tokens = comm_checks.S * comm_checks.B  # the loss's all-reduces: one value per token
        per_token = [n for n in out["reduces"] if n == tokens]
        # the loss's 2 per micro-batch (the max; target logit and sum of exp stacked: twice
        # the tokens), ONE of every sequence-parallel gradient, the norm's 1
        assert len(per_token) == micro_batches
        assert out["reduces"].count(2 * tokens) == micro_batches
        assert sorted(set(out["reduces"]) - {tokens, 2 * tokens}) == [1, out["sp_numel"]]
        assert out["reduces"].count(out["sp_numel"]) == 1
        assert len(out["reduces"]) == 2 * micro_batches + 2
        # reads to the host per step: the gradient norm (clipping) and the reported loss
        assert out["host_syncs"] == 2 and out["events"] == 0
