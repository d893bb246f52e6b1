"""Rank-side checks of the tensor-parallel layers against single-process torch.nn.

Each check runs inside a spawned world (see megazoo.testing.run_distributed) and compares,
for tp = 1, 2 and 4 and with/without Megatron sequence parallelism, the outputs, the input
gradients and the weight gradients of a parallel layer with those of the plain nn.Linear /
nn.Embedding / F.cross_entropy holding the full weights.

Tolerance (fp32): rtol 1e-5, atol 1e-6. A parallel layer sums the same products in another
order (partial matmuls, then an all-reduce), so results agree to a few ulps of the
accumulated magnitude (values here are O(1)), not bit for bit.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megazoo.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                            allreduce_sequence_parallel_grads, vocab_parallel_cross_entropy)
from megazoo.parallel import ParallelConfig, ParallelState

TOL = dict(rtol=1e-5, atol=1e-6)
S, B, IN, OUT = 8, 2, 16, 24


def states(device):
    """One ParallelState per tp that divides the world (all ranks build all of them)."""
    world = dist.get_world_size()
    for tp in (1, 2, 4):
        if world % tp == 0:
            yield ParallelState.initialize(ParallelConfig(tp=tp))


def _shard(t: torch.Tensor, dim: int, state) -> torch.Tensor:
    return t.chunk(state.tp.size, dim=dim)[state.tp.rank]


def _data(*shape, device, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device)


def check_column(device="cpu"):
    for state in states(device):
        for sp in (False, True):
            for gather in ((False, True) if not sp else (False,)):
                torch.manual_seed(7)
                layer = ColumnParallelLinear(IN, OUT, group=state.tp, sequence_parallel=sp,
                                             gather_output=gather, device=device)
                ref = nn.Linear(IN, OUT, device=device)
                with torch.no_grad():  # the one-process layer with the same seed: full weight
                    torch.manual_seed(7)
                    ref.weight.copy_(ColumnParallelLinear(IN, OUT, group=None, device=device).weight)
                    ref.bias.copy_(_data(OUT, device=device, seed=1))
                    layer.bias.copy_(_shard(ref.bias, 0, state))
                assert torch.equal(layer.weight, _shard(ref.weight, 0, state)), "init is not sliced"
                x = _data(S, B, IN, device=device, seed=2).requires_grad_()
                x_in = _shard(x.detach(), 0, state).requires_grad_() if sp else x.detach().clone().requires_grad_()
                g = _data(S, B, OUT, device=device, seed=3)
                y_ref = ref(x)
                (y_ref * g).sum().backward()
                y = layer(x_in)
                g_local = g if gather else _shard(g, -1, state)
                (y * g_local).sum().backward()
                torch.testing.assert_close(y, y_ref if gather else _shard(y_ref, -1, state), **TOL)
                torch.testing.assert_close(x_in.grad, _shard(x.grad, 0, state) if sp else x.grad, **TOL)
                torch.testing.assert_close(layer.weight.grad, _shard(ref.weight.grad, 0, state), **TOL)
                torch.testing.assert_close(layer.bias.grad, _shard(ref.bias.grad, 0, state), **TOL)
    return True


def check_row(device="cpu"):
    for state in states(device):
        for sp in (False, True):
            for parallel_in in ((True, False) if not sp else (True,)):
                torch.manual_seed(11)
                layer = RowParallelLinear(IN, OUT, group=state.tp, sequence_parallel=sp,
                                          input_is_parallel=parallel_in, device=device)
                ref = nn.Linear(IN, OUT, device=device)
                with torch.no_grad():
                    torch.manual_seed(11)
                    ref.weight.copy_(RowParallelLinear(IN, OUT, group=None, device=device).weight)
                    ref.bias.copy_(_data(OUT, device=device, seed=4))
                    layer.bias.copy_(ref.bias)
                assert torch.equal(layer.weight, _shard(ref.weight, 1, state)), "init is not sliced"
                x = _data(S, B, IN, device=device, seed=5).requires_grad_()
                x_in = (_shard(x.detach(), -1, state) if parallel_in else x.detach().clone()).requires_grad_()
                g = _data(S, B, OUT, device=device, seed=6)
                y_ref = ref(x)
                (y_ref * g).sum().backward()
                y = layer(x_in)
                (y * (_shard(g, 0, state) if sp else g)).sum().backward()
                allreduce_sequence_parallel_grads(layer, state.tp)
                torch.testing.assert_close(y, _shard(y_ref, 0, state) if sp else y_ref, **TOL)
                torch.testing.assert_close(x_in.grad, _shard(x.grad, -1, state) if parallel_in else x.grad, **TOL)
                torch.testing.assert_close(layer.weight.grad, _shard(ref.weight.grad, 1, state), **TOL)
                torch.testing.assert_close(layer.bias.grad, ref.bias.grad, **TOL)
    return True


def check_mlp(device="cpu"):
    """Column -> GeLU -> Row, the Megatron MLP, against two nn.Linear layers."""
    for state in states(device):
        for sp in (False, True):
            torch.manual_seed(3)
            fc1 = ColumnParallelLinear(IN, 4 * IN, group=state.tp, sequence_parallel=sp, device=device)
            fc2 = RowParallelLinear(4 * IN, IN, group=state.tp, sequence_parallel=sp, device=device)
            torch.manual_seed(3)
            ref1 = ColumnParallelLinear(IN, 4 * IN, group=None, device=device)
            ref2 = RowParallelLinear(4 * IN, IN, group=None, device=device)
            x = _data(S, B, IN, device=device, seed=8).requires_grad_()
            x_in = (_shard(x.detach(), 0, state) if sp else x.detach().clone()).requires_grad_()
            ref2(F.gelu(ref1(x))).square().sum().backward()
            y = fc2(F.gelu(fc1(x_in)))
            y.square().sum().backward()
            allreduce_sequence_parallel_grads(fc2, state.tp)
            torch.testing.assert_close(x_in.grad, _shard(x.grad, 0, state) if sp else x.grad, **TOL)
            torch.testing.assert_close(fc1.weight.grad, _shard(ref1.weight.grad, 0, state), **TOL)
            torch.testing.assert_close(fc2.weight.grad, _shard(ref2.weight.grad, 1, state), **TOL)
            torch.testing.assert_close(fc2.bias.grad, ref2.bias.grad, **TOL)
    return True


def check_parallel_mlp_fused(device="cpu"):
    """ParallelMLP with its fused local part (gelu_mlp, forced here: on CPU it runs its torch
    fallbacks) between the linears' own collectives, against two nn.Linear layers and tanh
    GeLU: the tp split of fc1 / fc2, the bias added once after the reduction, Megatron SP."""
    from unittest import mock

    from megazoo.layers import ParallelMLP, mlp as mlp_module

    for state in states(device):
        for sp in (False, True):
            torch.manual_seed(3)
            mlp = ParallelMLP(IN, 4 * IN, group=state.tp, sequence_parallel=sp, device=device)
            torch.manual_seed(3)
            ref1 = ColumnParallelLinear(IN, 4 * IN, group=None, device=device)
            ref2 = RowParallelLinear(4 * IN, IN, group=None, device=device)
            with torch.no_grad():
                ref1.bias.copy_(_data(4 * IN, device=device, seed=9))
                ref2.bias.copy_(_data(IN, device=device, seed=10))
                mlp.fc1.bias.copy_(_shard(ref1.bias, 0, state))
                mlp.fc2.bias.copy_(ref2.bias)
            x = _data(S, B, IN, device=device, seed=8).requires_grad_()
            x_in = (_shard(x.detach(), 0, state) if sp else x.detach().clone()).requires_grad_()
            y_ref = ref2(F.gelu(ref1(x), approximate="tanh"))
            y_ref.square().sum().backward()
            with mock.patch("megazoo.layers.mlp.fusable", lambda x, w, gathered: True), \
                    mock.patch("megazoo.layers.mlp.gelu_mlp", wraps=mlp_module.gelu_mlp) as fused:
                y = mlp(x_in)
            assert fused.call_count == 1
            y.square().sum().backward()
            allreduce_sequence_parallel_grads(mlp, state.tp)
            torch.testing.assert_close(y, _shard(y_ref, 0, state) if sp else y_ref, **TOL)
            torch.testing.assert_close(x_in.grad, _shard(x.grad, 0, state) if sp else x.grad, **TOL)
            pairs = [(mlp.fc1.weight, _shard(ref1.weight.grad, 0, state)),
                     (mlp.fc1.bias, _shard(ref1.bias.grad, 0, state)),
                     (mlp.fc2.weight, _shard(ref2.weight.grad, 1, state)),
                     (mlp.fc2.bias, ref2.bias.grad)]
            for param, want in pairs:
                torch.testing.assert_close(param.grad, want, **TOL)
    return True


def check_embedding(device="cpu"):
    vocab, dim = 300, 8  # padded to 384 at tp=1, 512 at tp=2 and tp=4
    for state in states(device):
        torch.manual_seed(5)
        layer = VocabParallelEmbedding(vocab, dim, group=state.tp, device=device)
        torch.manual_seed(5)
        full = VocabParallelEmbedding(vocab, dim, group=None, device=device).weight.detach()
        ref = nn.Embedding(vocab, dim, device=device)
        with torch.no_grad():
            ref.weight.copy_(full[:vocab])
        n = max(0, min(layer.vocab_end, vocab) - layer.vocab_start)  # real rows on this rank
        rows = slice(layer.vocab_start, layer.vocab_start + n)
        assert torch.equal(layer.weight[:n], ref.weight[rows]), "init is not sliced"
        ids = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(9)).to(device)
        g = _data(B, S, dim, device=device, seed=10)
        (ref(ids) * g).sum().backward()
        out = layer(ids)
        (out * g).sum().backward()
        torch.testing.assert_close(out, ref(ids), **TOL)
        torch.testing.assert_close(layer.weight.grad[:n], ref.weight.grad[rows], **TOL)
        assert torch.count_nonzero(layer.weight.grad[n:]) == 0  # padding rows get no gradient
    return True


def check_cross_entropy(device="cpu"):
    vocab = 300
    for state in states(device):
        padded = 128 * state.tp.size * -(-vocab // (128 * state.tp.size))
        for smoothing in (0.0, 0.1):
            logits = (_data(S, B, padded, device=device, seed=12) * 10).requires_grad_()
            target = torch.randint(0, vocab, (S, B), generator=torch.Generator().manual_seed(13)).to(device)
            target[0, :] = -100
            ref = logits.detach()[..., :vocab].clone().requires_grad_()
            loss_ref = F.cross_entropy(ref.reshape(-1, vocab), target.reshape(-1), reduction="none",
                                       label_smoothing=smoothing).view(S, B)
            shard = _shard(logits.detach(), -1, state).requires_grad_()
            loss = vocab_parallel_cross_entropy(shard, target, state.tp, vocab_size=vocab,
                                                label_smoothing=smoothing)
            loss_ref.mean().backward()
            loss.mean().backward()
            torch.testing.assert_close(loss, loss_ref, **TOL)
            full_grad = torch.cat([ref.grad, torch.zeros_like(logits[..., vocab:])], dim=-1)
            torch.testing.assert_close(shard.grad, _shard(full_grad, -1, state), **TOL)
    return True


def check_bad_sequence_length(device="cpu"):
    """An SP sequence that does not divide tp fails with a ValueError on every rank, no hang."""
    state = ParallelState.initialize(ParallelConfig(tp=dist.get_world_size()))
    layer = RowParallelLinear(IN, OUT, group=state.tp, sequence_parallel=True, device=device)
    x = torch.zeros(state.tp.size + 1, B, IN // state.tp.size, device=device)
    try:
        layer(x)
    except ValueError as e:
        return str(e)
    raise AssertionError("no ValueError for a sequence that does not divide tp")
