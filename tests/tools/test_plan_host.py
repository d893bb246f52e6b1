"""The step-time model's host term against the 2- and 4-GPU rows measured on H200 machines.

gpt-1.3b shape (24 x 2048, 16 heads, s 2048), micro-batch 4, global batch 64, bf16, the
distributed optimizer with overlapped reduction and gather, the default corpus's 2,048-token
vocabulary, tokens/s of the iterations after warm-up (`bench/multi_gpu_sweep.py`,
bench/results/tp_host_bound_h200_2026-11-28.md). Under tp and Ulysses the host, not the GPU,
sets the pace: a micro-batch takes about 140 ms to issue whatever its size, while its GPU work
halves with each doubling of tp. `h200-measured` carries the two host constants (4.4 ms per
block, 0.19 ms per collective call), read off the median tp 2 + SP row (57.6k over nine runs,
43.9k-76.7k) and Ulysses sp2; every other row checks them. Rows marked `before` were measured
before the tp collectives were cut (more calls per block than the model counts now), the
others on today's code. Tolerance 10% (the target); host-bound rows vary by up to 25% from
run to run on these machines, so a single run can fall outside it. The rows with CUDA graphs
(bench/results/cuda_graphs_h200_2026-11-28.md) are not host-bound: they check the
collectives' cost, bandwidth and per-call latency. The data-parallel rows check
`overlap_hidden`: an overlapped NCCL collective hides 0.06 of its time behind a GEMM there.
"""
import dataclasses

import pytest

from helpers.plan_time import predict as _predict
from megazoo.plan.clusters import load_cluster

GPT_13B = ("--family gpt --num-layers 24 --hidden-size 2048 --num-attention-heads 16 "
           "--ffn-hidden-size 8192 --seq-length 2048 --max-position-embeddings 2048 "
           "--micro-batch-size 4 --global-batch-size 64 --bf16 --use-distributed-optimizer "
           "--overlap-grad-reduce --overlap-param-gather")
SP = " --sequence-parallel"


def predict(layout: str, cluster: str = "h200-measured"):
    return _predict(GPT_13B + " " + layout, cluster, vocab=2048)


@pytest.mark.parametrize("layout, measured", [
    ("", 69195),  # one GPU
    ("--dp 4", 264530),
    ("--pp 4 --num-layers-per-virtual-pipeline-stage 3", 242051),
    ("--tp 2" + SP, 58287),  # one run of today's code (the constants used the median)
    ("--ds-sequence-parallel-size 4", 61774),
    ("--dp 2", 134100),  # before
    ("--tp 2", 62200),  # before
    ("--tp 4" + SP, 60400),  # before
    ("--tp 2 --dp 2" + SP, 106400),  # before
    ("--tp 2 --pp 2 --num-layers-per-virtual-pipeline-stage 6" + SP, 108600),  # before
    ("--ds-sequence-parallel-size 2", 65900),  # before
    ("--dp 4 --zero-stage 3 --zero-impl fsdp2 --fsdp-blocks-per-unit 1", 210460),  # before; FSDP2's hooks set the pace
])
def test_measured_rows_within_ten_percent(layout, measured):
    assert predict(layout).tokens_per_s == pytest.approx(measured, rel=0.10)


GRAPHS = " --enable-cuda-graph"


@pytest.mark.parametrize("layout, measured", [
    ("--tp 2" + SP + GRAPHS, 102513),
    ("--tp 2 --dp 2" + SP + GRAPHS, 202849),
    ("--tp 4" + SP + GRAPHS, 142385),
    ("--ds-sequence-parallel-size 2" + GRAPHS, 105516),
    ("--ds-sequence-parallel-size 4" + GRAPHS, 166700),
    ("--tp 2" + SP + GRAPHS + " --tp-comm-overlap", 105218),  # the fused ops
    ("--tp 2 --pp 2 --num-layers-per-virtual-pipeline-stage 6" + SP + GRAPHS, 193816),
    ("--pp 4 --num-layers-per-virtual-pipeline-stage 3" + GRAPHS, 245086),
    ("--pp 4 --num-layers-per-virtual-pipeline-stage 1" + GRAPHS, 245764),
])
def test_graphed_rows_within_ten_percent(layout, measured):
    """With --enable-cuda-graph the blocks replay and the host no longer sets the pace: the
    rows are the GPU's work plus the collectives, none hidden, each at the bus bandwidth plus
    `collective_latency_us` (45 µs on h200-measured, from the all-gather / reduce-scatter
    probe). --tp-comm-overlap runs torch's fused symmetric-memory ops on GPUs: one piece of
    each collective per rank beside the GEMMs, at least one of them exposed
    (bench/results/tp_fused_ops_h200x2_2026-11-29.md; the NCCL chunks it replaced, 4 calls
    per collective, made tp 2 slower: bench/results/cuda_graphs_h200_2026-11-28.md). The pipeline rows replay each chunk's
    graphs (bench/results/pipeline_graphs_h200x4_2026-11-28.md); at one layer per virtual
    stage the model's smaller bubble is offset on the machine by 3x the stage transfers,
    which it charges on the pipeline's path only, not beside the compute (+8%)."""
    time = predict(layout)
    assert all(s.host == 0.0 for s in time.stages)
    assert time.tokens_per_s == pytest.approx(measured, rel=0.10)


LLAMA_8B = ("--family llama --num-layers 8 --hidden-size 4096 --num-attention-heads 32 "
            "--num-key-value-heads 8 --ffn-hidden-size 14336 --seq-length 4096 "
            "--max-position-embeddings 4096 --micro-batch-size 1 --global-batch-size 32 --bf16 "
            "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather")


@pytest.mark.parametrize("layout, measured", [
    (GRAPHS, 50934),  # one GPU
    ("--tp 2" + SP + GRAPHS, 86016),
    ("--tp 2" + SP + GRAPHS + " --tp-comm-overlap", 88720),  # the fused ops
    ("--tp 4" + SP + GRAPHS, 141865),
    ("--tp 2 --dp 2" + SP + GRAPHS, 167815),
    ("--ds-sequence-parallel-size 2" + GRAPHS, 85674),
    ("--ds-sequence-parallel-size 4" + GRAPHS, 143754),
    ("--dp 4" + GRAPHS, 193141),
    ("--tp 2 --pp 2 --num-layers-per-virtual-pipeline-stage 2" + SP + GRAPHS, 168295),
    ("--dp 4 --zero-stage 3 --zero-impl fsdp2 --fsdp-blocks-per-unit 1", 159220),
])
def test_llama_8b_rows_within_ten_percent(layout, measured):
    """The LLaMA-8B-like shape's rows (8 x 4096, 32 / 8 heads, ffn 14336, s 4096,
    micro-batch 1, global batch 32; bench/results/llama_8b_h200x4_2026-11-28.md), from the
    same cluster constants as the gpt-1.3b rows; tp 2 x pp 2 with graphs from
    bench/results/pipeline_graphs_h200x4_2026-11-28.md. Left out, and outside 10% there:
    tp 2 x pp 2 interleaved eager (+24%: the model puts the host's time per block at about
    the GPU's, 5.9 against 5.8 ms, so host costs it does not count set the pace there),
    and DeepSpeed dp 4 (+40%, next test's docstring). FSDP2 dp 4 came within 10% (+1%, from
    +10%) once its memory passes were counted (`work.zero3_copies`)."""
    got = _predict(LLAMA_8B + " " + layout, "h200-measured", vocab=2048).tokens_per_s
    assert got == pytest.approx(measured, rel=0.10)


ONE_GPU_GPT = GPT_13B.replace("--global-batch-size 64", "--global-batch-size 16").replace(
    " --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather", "")
ONE_GPU_LLAMA = LLAMA_8B.replace("--global-batch-size 32", "--global-batch-size 8").replace(
    " --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather", "")
ZERO3 = " --zero-stage 3 --zero-impl fsdp2 --fsdp-blocks-per-unit "


@pytest.mark.parametrize("flags, measured", [
    (ONE_GPU_GPT, 68170),
    (ONE_GPU_GPT + " --deepspeed --zero-stage 3", 25430),
    (ONE_GPU_LLAMA, 49870),
    (ONE_GPU_LLAMA + ZERO3 + "1", 43365),  # the mean of two runs: 42.5k, 44.2k
])
def test_zero3_engines_on_one_gpu_within_ten_percent(flags, measured):
    """ZeRO-3's engines on one H200, a rank's share of the dp 4 rows (gpt-1.3b 4 micro-batches
    of 4, LLaMA-8B-like 8 of 1; bench/results/zero_host_h200_2026-11-29.md): no collective
    moves anything, so what they lose against the plain engine is their hooks' host time
    (`host_fsdp2_unit_ms`, `host_deepspeed_block_ms`) and their memory passes
    (`work.zero3_copies`). Left out:
    - DeepSpeed at LLaMA-8B-like, 31.7k measured, +22% predicted: it runs at its host's
      pace (in one call host_pace's micro-batch took 128-135 ms, training 129-138 ms), and
      its hooks took 10-16 ms per block from run to run, where the constant says 8.4;
    - gpt-1.3b FSDP2, where the host sets the pace: with 1 block per unit three runs gave
      45.9k-47.7k and the model says 51.6k (+10%); with 2, four runs gave 48.2k-60.2k, 53k
      in the middle, and the model says 61.4k (+16%). The host's pace varies by 10% there,
      and a 2-block unit's hooks took 2.5-2.8 ms of host time, where the model charges
      2.1 ms per unit."""
    got = _predict(flags, "h200-measured", vocab=2048).tokens_per_s
    assert got == pytest.approx(measured, rel=0.10)


def test_overlapped_collectives_hide_only_the_measured_share():
    """On h200-measured the dp buckets' reduction and gather are overlapped but hide only
    `overlap_hidden` (0.06) of their time: dp 4 loses about 3% to them, where a cluster whose
    collectives hid fully behind the backward would lose almost nothing (measured: 0.956 of
    linear at gpt-1.3b)."""
    from megazoo.plan.layout import resolve
    from megazoo.plan.published import plan_args
    from megazoo.plan.cli import plan_parser
    from megazoo.plan.timing import step_time

    args, config, _ = plan_args(plan_parser().parse_args((GPT_13B + " --dp 4").split()))
    config = dataclasses.replace(config, vocab_size=2048)
    measured = load_cluster("h200-measured")
    hiding = dataclasses.replace(measured, overlap_hidden=1.0)
    shown, hidden = (step_time(args, resolve(args), c, config).stages[0].dp_comm
                     for c in (measured, hiding))
    step = step_time(args, resolve(args), measured, config).step_s
    assert hidden < 0.005 * step and 0.02 * step < shown < 0.06 * step


def test_tp_and_ulysses_are_host_bound_and_dp_is_not():
    """The host term is what brings tp down: without it (the `h200` preset, the same GPU and
    links) tp 2 + SP is predicted near linear; with it, the step is the host's and tp 4 is no
    faster than tp 2. One GPU, dp and pp keep their GPU-bound step."""
    free = predict("--tp 2" + SP, "h200").tokens_per_s
    tp2, tp4 = predict("--tp 2" + SP), predict("--tp 4" + SP)
    assert free > 1.6 * tp2.tokens_per_s
    assert tp4.tokens_per_s == pytest.approx(tp2.tokens_per_s, rel=0.05)
    for t in (tp2, tp4):
        assert all(s.host > 0.4 * t.step_s for s in t.stages)  # GPU idle 48%, 63%
        for s in t.stages:  # the parts still add up to the step
            assert s.compute + s.tp_comm + s.host + s.bubble + s.dp_comm + s.optimizer == \
                pytest.approx(t.step_s)
    for layout in ("", "--dp 4"):
        assert all(s.host == 0.0 for s in predict(layout).stages)


def test_more_collective_calls_cost_host_time():
    """--tp-comm-overlap issues each tp collective in pieces: more calls, each with its host
    cost, so a host-bound layout gets slower with it (measured 0.56x at tp 2 when the
    pieces were 4 NCCL calls; on the fused ops eagerly not measured yet)."""
    plain = predict("--tp 2" + SP).step_s
    chunked = _predict(GPT_13B + " --tp 2" + SP + " --tp-comm-overlap", "h200-measured",
                       vocab=2048).step_s
    assert chunked > plain


def test_cluster_host_fields_checked(tmp_path):
    spec = tmp_path / "c.json"
    base = ('{"gpu": "x", "peak_bf16_tflops": 100, "hbm_gb": 40, "hbm_gb_s": 1000, '
            '"gpus_per_node": 8, "intra_node_gb_s": 100, "inter_node_gb_s_per_node": 100')
    spec.write_text(base + ', "host_block_ms": 0}')
    with pytest.raises(ValueError, match="host_block_ms must be > 0"):
        load_cluster(str(spec))
    spec.write_text(base + ', "host_block_ms": 2, "host_collective_ms": -1}')
    with pytest.raises(ValueError, match="host_collective_ms must be >= 0"):
        load_cluster(str(spec))
    spec.write_text(base + ', "host_block_ms": 2, "host_fsdp2_unit_ms": -0.5}')
    with pytest.raises(ValueError, match="host_fsdp2_unit_ms must be >= 0"):
        load_cluster(str(spec))
    spec.write_text(base + ', "overlap_hidden": 0}')
    with pytest.raises(ValueError, match=r"overlap_hidden must be in \(0, 1\]"):
        load_cluster(str(spec))
    spec.write_text(base + ', "host_block_ms": 2}')
    assert load_cluster(str(spec)).host_block_ms == 2


def test_fsdp2_hooks_cost_host_time_per_block():
    """`host_fsdp2_unit_ms` (what FSDP2's hooks add per unit, here a block,
    `bench/host_pace.py`'s FSDP2
    row) is charged to FSDP2 runs only: at gpt-1.3b, micro-batch 4, where the host issues a
    block in about the GPU's time, 2 ms more per block makes FSDP2 dp 4 host-bound and
    slower; the plain engine's dp 4 is unchanged. (h200-measured carries the 2.1 ms measured
    on the GPUs' host, which brings the gpt-1.3b FSDP2 dp 4 row from +20% to -2%.)"""
    plain = GPT_13B.replace(" --use-distributed-optimizer --overlap-grad-reduce "
                            "--overlap-param-gather", "")
    fsdp2 = plain + " --dp 4 --zero-stage 3 --zero-impl fsdp2 --fsdp-blocks-per-unit 1"
    measured = load_cluster("h200-measured")
    bare = dataclasses.replace(measured, host_fsdp2_unit_ms=0.0)
    hooked = dataclasses.replace(measured, host_fsdp2_unit_ms=2.0)
    times = {(name, layout): _predict(flags, cluster, vocab=2048).tokens_per_s
             for name, cluster in (("measured", bare), ("hooked", hooked))
             for layout, flags in (("fsdp2", fsdp2), ("dp", GPT_13B + " --dp 4"))}
    assert times["hooked", "fsdp2"] < 0.9 * times["measured", "fsdp2"]
    assert times["hooked", "dp"] == times["measured", "dp"]


def test_deepspeed_zero3_hooks_cost_host_time_per_block():
    """`host_deepspeed_block_ms` (8.4 ms on h200-measured, `bench/host_pace.py`'s DeepSpeed
    row) is charged to DeepSpeed at ZeRO-3 only: at gpt-1.3b it makes dp 4 host-bound; ZeRO-1
    (no parameter hooks) and the plain engine are unchanged."""
    measured = load_cluster("h200-measured")
    bare = dataclasses.replace(measured, host_deepspeed_block_ms=0.0)
    plain = GPT_13B.replace(" --use-distributed-optimizer --overlap-grad-reduce "
                            "--overlap-param-gather", "")
    rows = {"zero3": plain + " --dp 4 --deepspeed --zero-stage 3",
            "zero1": plain + " --dp 4 --deepspeed --zero-stage 1", "dp": GPT_13B + " --dp 4"}
    times = {(name, c): _predict(flags, cluster, vocab=2048).tokens_per_s
             for name, flags in rows.items() for c, cluster in (("bare", bare), ("hooked", measured))}
    assert times["zero3", "hooked"] < 0.6 * times["zero3", "bare"]
    assert times["zero1", "hooked"] == times["zero1", "bare"]
    assert times["dp", "hooked"] == times["dp", "bare"]


def test_a_synced_engine_cannot_issue_its_forward_ahead(monkeypatch):
    """DeepSpeed ZeRO-3 waits for the GPU after each micro-batch: a forward the host issues
    slower than the GPU runs it delays the backward's GPU work (`work.host_paced`), where
    an engine that runs ahead hides it behind the previous backward. The step time applies
    that to DeepSpeed ZeRO-3 only."""
    import megazoo.plan.timing as timing
    from megazoo.plan.work import HOST_FORWARD_SHARE, Work, host_paced

    work = Work(fwd=1.0, bwd=2.0)  # 3 s of GPU work
    assert host_paced(work, 2.5) == work  # the GPU is the slower over the micro-batch
    took = host_paced(work, 2.5, synced=True).total
    assert took == pytest.approx(HOST_FORWARD_SHARE * 2.5 + 2.0) and took > 3.0
    assert host_paced(work, 1.5, synced=True) == work  # the forward issued in time
    assert host_paced(work, 4.0, synced=True).total == pytest.approx(4.0)  # the host's pace

    calls = []
    monkeypatch.setattr(timing, "host_paced",
                        lambda w, h, synced=False: calls.append(synced) or host_paced(w, h, synced))
    plain = GPT_13B.replace(" --use-distributed-optimizer --overlap-grad-reduce "
                            "--overlap-param-gather", "")
    for engine in ("--zero-stage 3 --zero-impl fsdp2", "--deepspeed --zero-stage 3",
                   "--deepspeed --zero-stage 1"):
        _predict(f"{plain} --dp 4 {engine}", "h200-measured")
    assert calls == [False, True, False]


def test_fsdp2_units_of_blocks_share_the_hooks_host_time():
    """--fsdp-blocks-per-unit 2 halves the hooks' host time per block: the host-bound gpt-1.3b
    FSDP2 dp 4 row gets faster and its gathered working set holds 2 blocks per unit."""
    fsdp2 = GPT_13B.replace(" --use-distributed-optimizer --overlap-grad-reduce "
                            "--overlap-param-gather", "") + " --dp 4 --zero-stage 3 --zero-impl fsdp2"
    one, two = (predict(fsdp2 + f" --fsdp-blocks-per-unit {n}") for n in (1, 2))
    assert one.stages[0].host > 0 and two.stages[0].host < one.stages[0].host
    assert two.tokens_per_s > 1.05 * one.tokens_per_s


def test_a_host_bound_prediction_points_at_cuda_graphs():
    """Where the GPUs wait on the host and the run would take --enable-cuda-graph, the
    prediction says so; not with graphs on, not where the run refuses them (recompute),
    not where the GPU sets the pace (dp)."""
    def hinted(layout):
        return any("--enable-cuda-graph" in n for n in predict(layout).notes)

    assert hinted("--tp 2" + SP) and hinted("--ds-sequence-parallel-size 2")
    assert not hinted("--tp 2" + SP + GRAPHS)
    assert not hinted("--tp 2" + SP + " --recompute full")
    assert not hinted("--dp 4")
