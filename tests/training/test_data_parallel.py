"""The plain engine's data parallelism (fp32 main-gradient buckets, overlapped reduction,
distributed optimizer) against the one-process run, on gloo.

Tolerances. fp32 runs: the loss of every step and every parameter after 3 steps agree with
one process to rtol 1e-5: the same float32 sums in another order (dp adds the replicas'
halves, tp splits matmuls and the softmax); atol 1e-5 (a thousandth of an AdamW step at lr
1e-2) for elements whose near-zero gradient AdamW's normalisation magnifies. A wrong
dp / sp factor, a bucket reduced twice or not at all, a shard misplaced by the
distributed optimizer, or a lost tied-embedding sum is off by far more (a factor of 2 in
a gradient moves the loss in the 3rd digit after one step at lr 1e-2). bf16 runs: the
micro-batches' forward and backward are the same bf16 kernels on the same inputs as one
process, and after step 1 the fp32 masters differ only in the last float32 bits; but a bf16
parameter then rounds the other way here and there (one bf16 ulp, 2^-8 relative), the next
gradients differ at bf16 precision, and AdamW's early steps move every element by about
lr whatever its gradient's size, so elements with near-zero gradients move differently:
losses rtol 2e-3, and each parameter's RMS difference below half an AdamW step (5e-3 at lr
1e-2); a wrong reduction is off by whole steps.
"""
import pytest
import torch

from megazoo.parallel import ParallelConfig
from megazoo.testing import run_distributed

from helpers import ddp_checks as checks

TIMEOUT = 300
TWO_RANK = [  # name, training flags
    ("dp2", {}),
    ("dp2_overlap", {"overlap_grad_reduce": True, "ddp_bucket_size": 3000}),
    ("dp2_distopt", {"use_distributed_optimizer": True, "ddp_bucket_size": 3000}),
    ("dp2_distopt_overlap", {"use_distributed_optimizer": True, "overlap_grad_reduce": True,
                             "overlap_param_gather": True, "ddp_bucket_size": 3000}),
    ("dp2_bf16_distopt", {"bf16": True, "use_distributed_optimizer": True,
                          "overlap_grad_reduce": True, "ddp_bucket_size": 3000}),
]
FOUR_RANK = [  # name, layout, training flags (dp = 2 in each)
    ("tp2_dp2", ParallelConfig(tp=2, sequence_parallel=True),
     {"use_distributed_optimizer": True, "overlap_grad_reduce": True, "ddp_bucket_size": 3000}),
    ("pp2_dp2", ParallelConfig(pp=2), {"overlap_grad_reduce": True, "ddp_bucket_size": 3000}),
    ("pp2_vpp2_dp2", ParallelConfig(pp=2, vpp=2),
     {"use_distributed_optimizer": True, "overlap_grad_reduce": True, "ddp_bucket_size": 3000}),
    ("sp2_dp2", ParallelConfig(sp=2),
     {"use_distributed_optimizer": True, "overlap_grad_reduce": True, "ddp_bucket_size": 3000}),
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    # One intra-op thread, as every spawned rank runs (megazoo.testing): CPU kernels such as
    # the embedding backward accumulate in a thread-dependent order, and AdamW turns those
    # last-bit differences of near-zero gradients into visible parameter differences.
    path, threads = str(tmp_path_factory.mktemp("ref") / "ck"), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fp32 = checks.run_and_save(ParallelConfig(), path)
        bf16 = checks.run_and_save(ParallelConfig(), path + "_bf16", bf16=True)
    finally:
        torch.set_num_threads(threads)
    return {"fp32": fp32, "bf16": bf16}


def _compare(out: dict, ref: dict, bf16: bool, name: str) -> None:
    assert out["losses"] == pytest.approx(ref["losses"], rel=2e-3 if bf16 else 1e-5), name
    for key, want in ref["params"].items():
        if bf16:
            rms = float((out["params"][key] - want).square().mean().sqrt())
            assert rms < 5e-3, (name, key, rms)
            continue
        torch.testing.assert_close(out["params"][key], want, rtol=1e-5, atol=1e-5,
                                   msg=lambda m, k=key: f"{name}: {k}: {m}")


def test_dp2_variants_match_one_process(reference, tmp_path):
    jobs = [(ParallelConfig(), str(tmp_path / name), flags) for name, flags in TWO_RANK]
    results = run_distributed(checks.layouts, 2, jobs, timeout=TIMEOUT)
    for (name, flags), out in zip(TWO_RANK, results[0]):
        _compare(out, reference["bf16" if flags.get("bf16") else "fp32"], flags.get("bf16", False), name)
    assert results[0][0]["losses"] == results[1][0]["losses"]


def test_tp_pp_sp_times_dp2_match_one_process(reference, tmp_path):
    jobs = [(par, str(tmp_path / name), flags) for name, par, flags in FOUR_RANK]
    results = run_distributed(checks.layouts, 4, jobs, timeout=TIMEOUT)
    for (name, _, _), out in zip(FOUR_RANK, results[0]):
        _compare(out, reference["fp32"], False, name)


def test_first_bucket_is_reduced_while_backward_still_runs():
    """Launch times of the bucket reductions against full backward hooks of the first
    transformer block and of the embedding (the last modules backward reaches)."""
    for out in run_distributed(checks.overlap_timeline, 2, timeout=TIMEOUT):
        assert out["buckets"] > 2
        assert out["launches"][0] < out["first_block"] < out["embedding"]


def test_distributed_optimizer_resumes_exactly_and_at_other_dp(tmp_path):
    """dp=2 + distributed optimizer: save after 2 steps; resuming at dp=2 repeats steps 2-3
    bit for bit; at dp=1 and dp=4 the next loss matches to rtol 1e-5 (same state, the
    global batch summed in another order)."""
    path = str(tmp_path / "ck")
    flags = {"use_distributed_optimizer": True, "overlap_grad_reduce": True,
             "ddp_bucket_size": 3000}
    first = run_distributed(checks.save_then_continue, 2, path, flags, timeout=TIMEOUT)[0]
    again = run_distributed(checks.resume, 2, path, flags, timeout=TIMEOUT)[0]
    assert again["after"] == first["after"] and again["steps"] == 4
    one = checks.resume(path, flags)
    assert one["after"] == pytest.approx(first["after"], rel=1e-5)
    four = run_distributed(checks.resume, 4, path, flags, timeout=TIMEOUT)[0]
    assert four["after"] == pytest.approx(first["after"], rel=1e-5)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_gradient_accumulation_fusion_changes_no_value_on_cpu(reference, tmp_path, bf16,
                                                            monkeypatch):
    """The reference ran with the fusion (the default); without it the hook adds each
    micro-batch's dW instead. On CPU both are the same arithmetic: bit-equal. The fused
    weights are every linear's (2 per attention, 2 per MLP), and each micro-batch's
    backward accumulates each of them once."""
    from megazoo.layers import wgrad

    calls, fused_call = [], wgrad.accumulate_wgrad
    monkeypatch.setattr(wgrad, "accumulate_wgrad",
                        lambda w, *a: calls.append(w) or fused_call(w, *a))
    engine, state = checks.engine_for(ParallelConfig(), bf16=bf16)
    assert len(engine.buffers.fused) == 4 * checks.model_config().num_layers
    checks.train(engine, state, range(1))
    assert sorted(map(id, calls)) == sorted(map(id, engine.buffers.fused * checks.GLOBAL_MB))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        off = checks.run_and_save(ParallelConfig(), str(tmp_path / "off"), bf16=bf16,
                                  gradient_accumulation_fusion=False)
    finally:
        torch.set_num_threads(threads)
    ref = reference["bf16" if bf16 else "fp32"]
    assert off["losses"] == ref["losses"]
    for key, want in ref["params"].items():
        assert torch.equal(off["params"][key], want), key


def test_weights_accumulating_inside_graphs_change_no_value_on_cpu(reference, tmp_path,
                                                                  monkeypatch):
    """Under --enable-cuda-graph the fused weights' backward is a replayed graph: it always
    adds into main_grad and runs no Python, so the flags the eager fusion sets per call are
    never set, and autograd gets no gradient for them: the replay tells the buffer
    (`graph_delivered`). Emulated on CPU (the accumulation adds, sets no flag, and is
    delivered to the buffer instead of returned), the buffer must zero their ranges at each
    step's start and count each delivery as one micro-batch's gradient: then the run is
    bit-equal to the eager fusion's (0 + g is g). Without the zeroing, step 2 would carry
    step 1's gradient; without the count, no bucket would ever be reduced."""
    from megazoo.layers import wgrad
    from megazoo.training.backends.plain import PlainEngine

    def replayed(weight):
        assert not weight.main_grad_fresh, "a graphed weight's accumulation must add"
        return weight.main_grad, True

    owner = []

    def delivered(weight):
        owner[0].graph_delivered([weight])

    monkeypatch.setattr(wgrad, "_target", replayed)
    monkeypatch.setattr(wgrad, "_delivered", delivered)
    real_init = PlainEngine.__init__

    def init_then_graph(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.buffers.graph_weights(self.buffers.fused)
        owner[:] = [self.buffers]

    monkeypatch.setattr(PlainEngine, "__init__", init_then_graph)
    out = checks.one_thread(checks.run_and_save, ParallelConfig(), str(tmp_path / "graphed"))
    ref = reference["fp32"]
    assert out["losses"] == ref["losses"]
    for key, want in ref["params"].items():
        assert torch.equal(out["params"][key], want), key


def test_grad_buffer_refuses_a_fused_weight_outside_the_model():
    from torch import nn

    from megazoo.parallel import ParallelState
    from megazoo.training.backends.grad_buffer import GradBuffer

    with pytest.raises(ValueError, match="fused weight must be a trainable parameter"):
        GradBuffer(nn.Linear(4, 4), ParallelState.single(), bucket_numel=100, overlap=False,
                   shard=False, reducer=None, fused=[nn.Parameter(torch.zeros(4, 4))])
