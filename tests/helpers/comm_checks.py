"""Rank-side checks of tensor-parallel / Ulysses communication: what one layer, one model
micro-batch and one training step issue (`megazoo.parallel.comm_count.CommCounter`), and the
chunked all-gather + GEMM / GEMM + reduce-scatter (`megazoo.layers.tp_overlap`) against the
unchunked path and the one-process nn.Linear.

Tolerance of the chunked linears: chunks multiply row blocks of the same matrices and the
reduce-scatter adds the same two partial sums per element, so on CPU (fp32) the results are
expected bit for bit; compared with rtol 1e-6, atol 1e-6 (a few fp32 ulps of O(1) values)
in case a GEMM library blocks a row subset differently. Against one process: the tp_checks
tolerance (rtol 1e-5, atol 1e-6: partial matmuls summed in another order).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from megazoo.layers import ColumnParallelLinear, RowParallelLinear, symm_tp
from megazoo.layers.linear import set_tp_comm_overlap
from megazoo.layers.parallel_attention import set_ulysses_overlap
from megazoo.models import ModelConfig, build_model
from megazoo.parallel import ParallelConfig, ParallelState
from megazoo.parallel.comm_count import CommCounter, named_groups

SAME = dict(rtol=1e-6, atol=1e-6)
REF = dict(rtol=1e-5, atol=1e-6)
S, B, H = 16, 2, 32


def _data(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _run_pair(state, chunks: int, x_full, g):
    """Column (H -> 3H) then row (3H -> H) at `chunks`; (output, x grad, every param grad)."""
    torch.manual_seed(3)
    col = ColumnParallelLinear(H, 3 * H, group=state.tp, sequence_parallel=True,
                               device=x_full.device)
    row = RowParallelLinear(3 * H, H, group=state.tp, sequence_parallel=True, device=x_full.device)
    with torch.no_grad():
        row.bias.copy_(_data(H, seed=9))
    set_tp_comm_overlap(nn.ModuleList([col, row]), chunks)
    n, r = state.tp.size, state.tp.rank
    x = x_full.chunk(n)[r].clone().requires_grad_()
    y = row(torch.relu(col(x)))
    (y * g.chunk(n)[r]).sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in (col.weight, col.bias, row.weight, row.bias)]


def check_chunked_linears(device: str = "cpu") -> int:
    """k = 2 and 4 against k = 1 (the plain path), and k = 1 against one process. On CUDA
    (NCCL) the GEMM library may pick another kernel for fewer rows: REF tolerance there."""
    state = ParallelState.initialize(ParallelConfig(tp=dist.get_world_size(), sequence_parallel=True))
    x_full, g = _data(S, B, H, seed=1).to(device), _data(S, B, H, seed=2).to(device)
    # on CUDA over NCCL the chunked GEMMs are the fused symmetric-memory ops: checked here
    assert symm_tp.usable(x_full, state.tp.group) == (device == "cuda")
    plain = _run_pair(state, 1, x_full, g)
    for k in (2, 4):
        for got, want in zip(_run_pair(state, k, x_full, g), plain):
            torch.testing.assert_close(got, want, **(SAME if device == "cpu" else REF))
    # one process, same seeds: the full weights
    torch.manual_seed(3)
    col = ColumnParallelLinear(H, 3 * H, group=None, device=device)
    row = RowParallelLinear(3 * H, H, group=None, device=device)
    with torch.no_grad():
        row.bias.copy_(_data(H, seed=9).to(device))
    x = x_full.clone().requires_grad_()
    y = row(torch.relu(col(x)))
    (y * g).sum().backward()
    n, r = state.tp.size, state.tp.rank
    want = [y.chunk(n)[r], x.grad.chunk(n)[r], col.weight.grad.chunk(n)[r],
            col.bias.grad.chunk(n)[r], row.weight.grad.chunk(n, dim=1)[r]]
    for got, ref in zip(plain[:4] + [plain[4]], want):
        torch.testing.assert_close(got, ref.detach(), **REF)
    # the replicated row bias saw this rank's rows only: summed over tp it is the full one
    bias = plain[5].clone()
    dist.all_reduce(bias, group=state.tp.group)
    torch.testing.assert_close(bias, row.bias.grad, **REF)
    return len(plain)


def tiny_gpt(num_layers: int) -> ModelConfig:
    return ModelConfig(family="gpt", num_layers=num_layers, hidden_size=H, num_attention_heads=4,
                       vocab_size=128, max_position_embeddings=S)


def model_counts(tp: int, sp: int, megatron_sp: bool, chunks: int = 1,
                 ulysses_chunks: int = 1) -> dict:
    """Collectives of one forward and one backward of a 1-layer and a 3-layer model; their
    difference over 2 is one layer's (everything outside the layers cancels)."""
    state = ParallelState.initialize(ParallelConfig(tp=tp, sp=sp, sequence_parallel=megatron_sp))
    ids = torch.randint(0, 128, (B, S), generator=torch.Generator().manual_seed(0))
    out = {}
    for layers in (1, 3):
        model = build_model(tiny_gpt(layers), state, device="cpu", seed=0)
        set_tp_comm_overlap(model, chunks)
        set_ulysses_overlap(model, ulysses_chunks)
        with CommCounter(named_groups(state)) as fw:
            loss = model(ids, labels=ids)
        with CommCounter(named_groups(state)) as bw:
            loss.backward()
        out[layers] = dict(forward=fw.summary(), backward=bw.summary(),
                           host_syncs=fw.host_syncs + bw.host_syncs,
                           events=fw.events + bw.events,
                           bytes=fw.bytes_by_kind() + bw.bytes_by_kind())
    return out


def step_counts(micro_batches: int) -> dict:
    """One plain-engine training step at tp = 2 + Megatron SP (one gradient bucket):
    the tp all-reduces by size, and the sequence-parallel parameters' total size."""
    from megazoo.config.run import PretrainArgs, TrainingConfig
    from megazoo.training.backends.plain import PlainEngine

    par = ParallelConfig(tp=2, sequence_parallel=True)
    state = ParallelState.initialize(par)
    training = TrainingConfig(micro_batch_size=B, global_batch_size=B * micro_batches,
                              train_iters=2, lr=1e-3, seed=3, overlap_grad_reduce=True)
    args = PretrainArgs(model=tiny_gpt(2), parallel=par, training=training)
    model = build_model(args.model, state, device="cpu", seed=3)
    engine = PlainEngine(model, state, args)
    g = torch.Generator().manual_seed(5)
    batch = [{"input_ids": ids, "labels": ids}
             for ids in (torch.randint(0, 128, (B, S), generator=g) for _ in range(micro_batches))]
    with CommCounter(named_groups(state)) as counts:
        engine.train_step(batch)
    sp_numel = sum(p.numel() for p in model.parameters() if getattr(p, "sequence_parallel", False))
    reduces = [c.elements for c in counts.calls if c.kind == "all_reduce" and c.group == "tp"]
    return dict(reduces=reduces, sp_numel=sp_numel, buckets=len(engine.buffers.buckets),
                host_syncs=counts.host_syncs, events=counts.events,
                other=counts.summary())


def check_ulysses_chunks(families=("gpt", "llama")) -> list[str]:
    """Ulysses sp = world with its all-to-alls chunked into the projections (2 and 4 chunks)
    against the one-process model: loss, logits and every gradient (model_checks.compare,
    its tolerance: the output projection sums chunks in another order)."""
    from .fixtures import tiny_config
    from .model_checks import _run_layout, reference

    state = ParallelState.initialize(ParallelConfig(sp=dist.get_world_size()))
    errors = []
    for family in families:
        cfg = tiny_config(family, position_embedding="rope") if family == "gpt" else tiny_config(family)
        ref = reference(cfg)
        for chunks in (2, 4):
            errors += _run_layout(cfg, ref, state, f"{family} {chunks} chunks",
                                  prepare=lambda m, k=chunks: set_ulysses_overlap(m, k))
    return errors
