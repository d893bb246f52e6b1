"""A two-layer tensor-parallel MLP on CPU ranks, checked against the same MLP on one process.

    python examples/tp_mlp.py            # spawns 2 gloo ranks
"""
import torch
import torch.nn.functional as F

from megazoo.layers import ColumnParallelLinear, RowParallelLinear
from megazoo.parallel import ParallelConfig, ParallelState
from megazoo.testing import run_distributed


def mlp(group, hidden=64):
    torch.manual_seed(0)  # same seed on every rank: each holds its slice of the same MLP
    fc1 = ColumnParallelLinear(hidden, 4 * hidden, group=group)  # weight [4h/tp, h]
    fc2 = RowParallelLinear(4 * hidden, hidden, group=group)     # weight [h, 4h/tp]
    return lambda x: fc2(F.gelu(fc1(x)))


def train_step():
    state = ParallelState.initialize(ParallelConfig(tp=2))
    x = torch.randn(16, 4, 64, generator=torch.Generator().manual_seed(1))  # [s, b, h]
    y = mlp(state.tp)(x)
    y.square().mean().backward()
    reference = mlp(None)(x)  # one process, full weights
    return state.tp.rank, str(state), (y - reference).abs().max().item()


if __name__ == "__main__":
    for rank, layout, err in run_distributed(train_step, 2):
        print(f"{layout}: tp rank {rank}, max |tp - single| = {err:.2e}")
