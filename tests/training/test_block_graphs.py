"""`--enable-cuda-graph`'s capture and replay (`megazoo.training.block_graphs`) on CPU, its
CUDA graphs emulated (tests/helpers/fake_graphs.py: the recorded ops re-run on the same
tensors, none of the Python around them). A replay runs the eager run's ops in the eager
order on the same values, and the fused weight gradients add into ranges zeroed at each
step's start (0 + g is g), so graphed and eager runs must agree bit for bit: losses and every
final parameter, over 3 steps of 4 micro-batches, at one process, tp 2 + SP, Ulysses sp 2
and dp 2 with the distributed optimizer and overlapped reduction (the buckets launched from
`GradBuffer.graph_delivered`). The memory pools and streams are the GPU tests' part
(tests/training/test_layouts_gpu.py::test_cuda_graphs_match_eager)."""
import pytest
import torch

from helpers import ddp_checks as checks
from helpers.fake_graphs import graphed_and_eager
from megazoo.parallel import ParallelConfig
from megazoo.testing import run_distributed

MICRO_BATCHES = 3 * checks.GLOBAL_MB  # 3 steps


def _same(out: dict, micro_batches: int) -> None:
    eager, graphed = out["eager"], out["graphed"]
    assert graphed["losses"] == eager["losses"]
    for name, want in eager["params"].items():
        assert torch.equal(graphed["params"][name], want), name
    # each block's forward and backward graph ran once per micro-batch: nothing ran eagerly
    assert graphed["replays"] and set(graphed["replays"]) == {micro_batches}


def test_graphed_blocks_match_eager_in_one_process():
    _same(checks.one_thread(graphed_and_eager, ParallelConfig()), MICRO_BATCHES)


@pytest.mark.parametrize("par, training", [
    (ParallelConfig(tp=2, sequence_parallel=True), {}),
    (ParallelConfig(sp=2), {}),
    (ParallelConfig(), dict(use_distributed_optimizer=True, overlap_grad_reduce=True,
                            ddp_bucket_size=2000)),
], ids=["tp2-sp", "ulysses-sp2", "dp2-distopt-overlap"])
def test_graphed_blocks_match_eager_on_two_ranks(par, training):
    dp = 2 if par.tp * par.sp == 1 else 1
    for out in run_distributed(graphed_and_eager, 2, par, training, timeout=300):
        _same(out, MICRO_BATCHES // dp)
