"""`--enable-cuda-graph`'s capture and replay (`megazoo.training.block_graphs`) on CPU, its
CUDA graphs emulated (tests/helpers/fake_graphs.py: the recorded ops re-run on the same
tensors, none of the Python around them). A replay runs the eager run's ops in the eager
order on the same values, and the fused weight gradients add into ranges zeroed at each
step's start (0 + g is g), so graphed and eager runs must agree bit for bit: losses and every
final parameter, over 3 steps of 4 micro-batches, at one process, tp 2 + SP, Ulysses sp 2
and dp 2 with the distributed optimizer and overlapped reduction (the buckets launched from
`GradBuffer.graph_delivered`), and under pipelines (1F1B and interleaved, with tp2 + SP),
where each chunk keeps one copy of its graphs per micro-batch in flight (`graph_slots`;
micro-batch j replaying copy j mod n never takes a copy still in flight). The memory pools
and streams are the GPU tests' part
(tests/training/test_layouts_gpu.py::test_cuda_graphs_match_eager)."""
import pytest
import torch

from helpers import ddp_checks as checks
from helpers.fake_graphs import graphed_and_eager
from megazoo.parallel import ParallelConfig
from megazoo.pipeline.schedules import Action, ActionKind, build_schedule
from megazoo.testing import run_distributed
from megazoo.training.block_graphs import grad_senders, graph_slots

F, B = ActionKind.F, ActionKind.B

def _same(out: dict) -> None:
    eager, graphed = out["eager"], out["graphed"]
    assert graphed["losses"] == eager["losses"]
    for name, want in eager["params"].items():
        assert torch.equal(graphed["params"][name], want), name
    # every copy of every block replayed forward and backward for exactly the micro-batches
    # that took it (copy k of n: the chunk's forwards k, k + n, ...): nothing ran eagerly
    assert graphed["replays"] is True


def test_graphed_blocks_match_eager_in_one_process():
    _same(checks.one_thread(graphed_and_eager, ParallelConfig()))


@pytest.mark.parametrize("par, training", [
    (ParallelConfig(tp=2, sequence_parallel=True), {}),
    (ParallelConfig(sp=2), {}),
    (ParallelConfig(), dict(use_distributed_optimizer=True, overlap_grad_reduce=True,
                            ddp_bucket_size=2000)),
    (ParallelConfig(pp=2), {}),
    (ParallelConfig(pp=2, vpp=2), {}),
], ids=["tp2-sp", "ulysses-sp2", "dp2-distopt-overlap", "pp2", "pp2-interleaved"])
def test_graphed_blocks_match_eager_on_two_ranks(par, training):
    for out in run_distributed(graphed_and_eager, 2, par, training, timeout=300):
        _same(out)


def test_graphed_pipeline_with_tensor_parallelism_matches_eager():
    par = ParallelConfig(tp=2, pp=2, vpp=2, sequence_parallel=True)
    for out in run_distributed(graphed_and_eager, 4, par, None, timeout=300):
        _same(out)


@pytest.mark.parametrize("pp, vpp, m", [(1, 1, 4), (2, 1, 8), (4, 1, 3), (4, 1, 16),
                                        (2, 2, 4), (2, 2, 8), (4, 2, 8), (4, 3, 12)])
def test_no_copy_is_taken_while_its_micro_batch_is_in_flight(pp, vpp, m):
    for rank, program in enumerate(build_schedule(pp, vpp, m)):
        slots = graph_slots(program)
        assert len(slots) == vpp
        holder: dict = {}  # (chunk, copy) -> the micro-batch using it
        for a in program:
            key = (a.chunk, a.microbatch % slots[a.chunk])
            if a.kind == F:
                assert key not in holder, (pp, vpp, m, rank, a, holder)
                holder[key] = a.microbatch
            elif a.kind == B:
                assert holder.pop(key) == a.microbatch
        assert not holder


def test_one_f_one_b_keeps_pp_minus_rank_in_flight():
    assert [graph_slots(p) for p in build_schedule(1, 1, 8)] == [[1]]
    assert [graph_slots(p) for p in build_schedule(4, 1, 16)] == [[4], [3], [2], [1]]
    assert [graph_slots(p) for p in build_schedule(4, 1, 2)] == [[2], [2], [2], [1]]


def test_only_chunks_whose_input_gradient_leaves_the_stage_copy_it():
    """Every chunk sends its input gradient to the previous stage except the first stage's
    first chunk, whose input comes from its own embedding; one stage sends none."""
    assert [grad_senders(p) for p in build_schedule(1, 1, 4)] == [frozenset()]
    assert [grad_senders(p) for p in build_schedule(2, 2, 4)] == [{1}, {0, 1}]
    assert [grad_senders(p) for p in build_schedule(4, 3, 8)] == [{1, 2}] + [{0, 1, 2}] * 3


def test_a_program_out_of_micro_batch_order_is_refused():
    program = [Action(F, 0, 0), Action(F, 0, 1), Action(B, 0, 1), Action(B, 0, 0)]
    with pytest.raises(ValueError, match="out of micro-batch order"):
        graph_slots(program)
