"""The flat all-gather / reduce-scatter helper: current torch names, no FutureWarning.

The ranks turn torch's deprecation warning for `all_gather_into_tensor` /
`reduce_scatter_tensor` into an error, then run the paths that use the flat collectives:
Megatron sequence parallelism's gather and reduce-scatter (forward and backward) and a
plain-engine step with the distributed optimizer (gradient reduce-scatter, parameter
all-gather, overlapped too).
"""
import warnings

import torch
import torch.distributed as dist

from megazoo.layers.mappings import (gather_from_sequence_parallel_region,
                                     reduce_scatter_to_sequence_parallel_region)
from megazoo.parallel import ParallelConfig, ParallelState
from megazoo.testing import run_distributed

DEPRECATED = r".*(all_gather_into_tensor|reduce_scatter_tensor)"


def _rank_paths() -> dict:
    from helpers import ddp_checks

    warnings.filterwarnings("error", message=DEPRECATED, category=FutureWarning)
    state = ParallelState.initialize(ParallelConfig(tp=2, megatron_sp=True))
    rank = state.tp.rank
    x = torch.full((2, 3), float(rank + 1), requires_grad=True)      # [s/tp, h]
    full = gather_from_sequence_parallel_region(x, state.tp)          # [s, h]
    expected = torch.cat([torch.full((2, 3), 1.0), torch.full((2, 3), 2.0)])
    shard = reduce_scatter_to_sequence_parallel_region(full * 1.0, state.tp)
    shard.sum().backward()
    engine, dp_state = ddp_checks.engine_for(ParallelConfig(), use_distributed_optimizer=True,
                                             overlap_grad_reduce=True, overlap_param_gather=True)
    losses = ddp_checks.train(engine, dp_state, range(2))
    old_name_warns = False
    if hasattr(dist, "all_gather_single"):  # the filter is live: the old name raises
        try:
            dist.all_gather_into_tensor(torch.empty(2), torch.ones(1))
        except FutureWarning:
            old_name_warns = True
    return {"gather_ok": torch.equal(full, expected), "shard": shard.detach(),
            "grad": x.grad.clone(), "losses": losses, "old_name_warns": old_name_warns,
            "has_single": hasattr(dist, "all_gather_single")}


def test_flat_collectives_raise_no_future_warning():
    results = run_distributed(_rank_paths, 2, timeout=120)
    for rank, r in enumerate(results):
        assert r["gather_ok"]
        # reduce-scatter of the gathered [s, h] (identical on both ranks): 2 x own chunk
        assert torch.equal(r["shard"], torch.full((2, 3), 2.0 * (rank + 1)))
        assert torch.equal(r["grad"], torch.full((2, 3), 2.0))
        assert all(loss == loss for loss in r["losses"])
        assert r["old_name_warns"] == r["has_single"]

