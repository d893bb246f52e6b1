"""Rank-side checks of ParallelAttention / UlyssesAttention against the one-process block.

Each check runs inside a spawned world (megazoo.testing.run_distributed). For every layout
(tp, sp) that fits the world, and every case (ALiBi with a non-power-of-two head count, RoPE
with per-sequence position offsets, GQA with kv heads split or replicated over tp and sp, MQA,
padding masks), the parallel block's output, input gradient and weight/bias gradients are
compared with those of the tp=1, sp=1 block built with the same seed on the full sequence and
run with the float32 "math" reference backend (itself checked against plain torch ops in
test_attention_single.py). The parallel block uses attention_backend="auto" (SDPA on CPU).

Tolerance (fp32): rtol 1e-4 and atol 1e-5 x the largest entry of the expected tensor. The
parallel block computes the same sums in another order (partial matmuls over heads and sequence
chunks then all-reduces, SDPA's fused softmax against the reference's explicit one); observed
differences are at most ~1.3e-6 of the largest entry, so this leaves a margin of ~10x, while a
layout bug (a wrong head, slope, kv replica or sequence chunk) moves results by 1e-2 or more
(weights are drawn with std 0.3 so that attention is far from uniform). On GPUs, 2e-3 / 2e-4:
FlexAttention and SDPA may use TF32 tensor cores there.
"""
from dataclasses import replace

import torch
import torch.distributed as dist

from megazoo.layers import (AttentionConfig, NormalInit, ParallelAttention,
                            allreduce_sequence_parallel_grads,
                            sequence_shard_range, shard_sequence)
from megazoo.layers.mappings import all_reduce
from megazoo.layers.heads import HeadLayout
from megazoo.parallel import ParallelConfig, ParallelState

TOL = {"cpu": dict(rtol=1e-4, atol=1e-5), "cuda": dict(rtol=2e-3, atol=2e-4)}
S, B, D = 16, 2, 4

# name: (num_heads, num_kv_heads, position_embedding, padding, custom positions)
CASES = {
    "alibi-12-heads-padded": (12, 12, "alibi", True, False),
    "rope-gqa-8q-2kv-positions": (8, 2, "rope", True, True),
    "rope-gqa-8q-4kv": (8, 4, "rope", False, False),
    "alibi-mqa-8q-1kv": (8, 1, "alibi", True, False),
    "causal-no-positions": (4, 4, "none", False, False),
}


def _data(*shape, device, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device)


def _inputs(hidden, device):
    x = _data(S, B, hidden, device=device, seed=1)
    grad_y = _data(S, B, hidden, device=device, seed=2)
    mask = torch.ones(B, S, dtype=torch.bool, device=device)
    mask[0, :3] = False  # left padding: queries 0..2 see no key at all
    mask[1, -5:] = False  # right padding
    # RoPE only sees relative positions: restart one sequence mid-way (packing) so that the
    # position ids, not only their offset, matter.
    positions = torch.stack([torch.arange(S) + 5, torch.cat([torch.arange(10), torch.arange(S - 10)])])
    positions = positions.to(device)
    return x, grad_y, mask, positions


def _pair(state, case, sequence_parallel, device, seed, overlap=None):
    heads, kv, pe, _, _ = CASES[case]
    hidden = heads * D
    # Large weights, so that attention scores are O(1) and a wrong position, slope or head
    # changes the output by far more than the tolerance (with std 0.02 softmax is nearly flat).
    kwargs = dict(device=device, init_method=NormalInit(std=0.3, seed=seed, key="qkv"),
                  output_init_method=NormalInit(std=0.2, seed=seed, key="dense"))
    shape = AttentionConfig(hidden, heads, num_kv_heads=kv, position_embedding=pe)
    layer = ParallelAttention(shape, tp_group=state.tp, sp_group=state.sp,
                              megatron_sp=sequence_parallel, **kwargs)
    ref = ParallelAttention(replace(shape, attention_backend="math"), **kwargs)
    if overlap is not None:  # the overlapped variant in place of UlyssesAttention (no weights)
        from bench.experimental.ulysses_overlap import UlyssesOverlapAttention

        layer.attention = UlyssesOverlapAttention(heads, D, num_kv_heads=kv, position_embedding=pe,
                                                  sp_group=state.sp, tp_group=state.tp, **overlap)
    rows = layer.layout.qkv_rows(state.tp.rank).to(device)
    cols = slice(state.tp.rank * hidden // state.tp.size, (state.tp.rank + 1) * hidden // state.tp.size)
    assert torch.equal(layer.qkv.weight, ref.qkv.weight[rows]), f"{case}: qkv init is not the tp=1 rows"
    assert torch.equal(layer.dense.weight, ref.dense.weight[:, cols]), f"{case}: dense init not sliced"
    with torch.no_grad():  # non-zero biases, so their gradients and placement are checked too
        ref.qkv.bias.copy_(_data(ref.qkv.bias.numel(), device=device, seed=3))
        ref.dense.bias.copy_(_data(hidden, device=device, seed=4))
        layer.qkv.bias.copy_(ref.qkv.bias[rows])
        layer.dense.bias.copy_(ref.dense.bias)
    return layer, ref, rows, cols


def compare(state, case, sequence_parallel=False, device="cpu", seed=0, overlap=None):
    """One layout, one case: outputs and all gradients against the tp=1 sp=1 block.

    overlap: None (UlyssesAttention), or the keyword arguments of UlyssesOverlapAttention
    (e.g. {"num_chunks": 2}) to check the overlapped variant instead.
    """
    layer, ref, rows, cols = _pair(state, case, sequence_parallel, device, seed, overlap)
    _, _, _, padded, custom_positions = CASES[case]
    x, grad_y, mask, positions = _inputs(layer.hidden_size, device)
    mask = mask if padded else None
    positions = positions if custom_positions else None
    x_ref = x.clone().requires_grad_()
    y_ref = ref(x_ref, mask, positions)
    (y_ref * grad_y).sum().backward()

    groups = dict(tp_group=state.tp, sp_group=state.sp, megatron_sp=sequence_parallel)
    local = sequence_shard_range(S, **groups)
    assert torch.equal(shard_sequence(x, **groups), x[local.start:local.stop])
    x_local = x[local.start:local.stop].clone().requires_grad_()
    y = layer(x_local, mask, positions)
    (y * grad_y[local.start:local.stop]).sum().backward()
    for p in layer.parameters():  # each sp rank saw a part of the sequence: the dp x sp reduction
        p.grad.copy_(all_reduce(p.grad, state.sp))
    if sequence_parallel:
        allreduce_sequence_parallel_grads(layer, state.tp)

    tol = TOL[torch.device(device).type]
    where = f"{case} at {state.config} sequence_parallel={sequence_parallel} overlap={overlap}"
    checks = [("output", y, y_ref[local.start:local.stop]),
              ("input grad", x_local.grad, x_ref.grad[local.start:local.stop]),
              ("qkv weight grad", layer.qkv.weight.grad, ref.qkv.weight.grad[rows]),
              ("qkv bias grad", layer.qkv.bias.grad, ref.qkv.bias.grad[rows]),
              ("dense weight grad", layer.dense.weight.grad, ref.dense.weight.grad[:, cols]),
              ("dense bias grad", layer.dense.bias.grad, ref.dense.bias.grad)]
    for name, got, want in checks:  # atol relative to the tensor's largest entry
        scale = max(1.0, want.abs().max().item())
        torch.testing.assert_close(got, want, rtol=tol["rtol"], atol=tol["atol"] * scale,
                                   msg=lambda m: f"{where}: {name}: {m}")
    return max((got - want).abs().max().item() / want.abs().max().item() for _, got, want in checks)


def _layouts(layouts, device):
    world = dist.get_world_size()
    for tp, sp in layouts:
        if world % (tp * sp) == 0:
            yield ParallelState.initialize(ParallelConfig(tp=tp, sp=sp))


def check_ulysses(device="cpu"):
    """sp = 4; tp = 2 x sp = 2 (with and without Megatron SP); sp = 2 with dp = 2."""
    worst = 0.0
    for state in _layouts([(1, 4), (2, 2), (1, 2)], device):
        for case in CASES:
            for megatron_sp in ((False, True) if state.tp.size > 1 else (False,)):
                worst = max(worst, compare(state, case, megatron_sp, device))
    return worst


def check_ulysses_overlap(device="cpu"):
    """UlyssesOverlapAttention on the layouts of check_ulysses: automatic chunks, and 2 chunks
    where the kv groups per rank allow it. Returns the worst difference and the chunk counts
    each case ran with (GQA with one kv group per rank runs one chunk)."""
    from bench.experimental.ulysses_overlap import choose_num_chunks

    worst, chunks = 0.0, set()
    for state in _layouts([(1, 4), (2, 2), (1, 2)], device):
        for case in CASES:
            heads, kv = CASES[case][:2]
            layout = HeadLayout(heads, kv, D, state.tp.size, state.sp.size)
            options = [{}] + ([{"num_chunks": 2}] if layout.sp_groups[0] % 2 == 0 else [])
            for overlap in options:
                for megatron_sp in ((False, True) if state.tp.size > 1 else (False,)):
                    worst = max(worst, compare(state, case, megatron_sp, device, overlap=overlap))
                    chunks.add((case, state.tp.size, state.sp.size,
                                choose_num_chunks(layout.sp_groups[0], overlap.get("num_chunks"))))
    return worst, sorted(chunks)


def check_tensor_parallel(device="cpu"):
    """tp = 2 (with and without Megatron SP) and tp = 4 (kv heads replicated), sp = 1."""
    worst = 0.0
    for state in _layouts([(2, 1), (4, 1)], device):
        for case in CASES:
            if CASES[case][0] % state.tp.size:
                continue
            for megatron_sp in (False, True):
                worst = max(worst, compare(state, case, megatron_sp, device))
    return worst


def _error_of(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    raise AssertionError(f"{fn} raised no ValueError")


def check_bad_inputs(device="cpu"):
    """Misconfigurations fail with a ValueError on every rank, before any collective."""
    state = ParallelState.initialize(ParallelConfig(sp=dist.get_world_size()))
    sp = state.sp.size
    errors = {
        "heads": _error_of(lambda: ParallelAttention(AttentionConfig(12, 3), sp_group=state.sp,
                                                     device=device)),
        "kv_heads": _error_of(lambda: ParallelAttention(AttentionConfig(24, 6, num_kv_heads=3),
                                                        tp_group=state.sp, device=device)),
        "sequence": _error_of(lambda: sequence_shard_range(2 * sp + 1, sp_group=state.sp)),
    }
    layer = ParallelAttention(AttentionConfig(16, 4), sp_group=state.sp, device=device)
    x = torch.zeros(3, 2, 16, device=device)  # full sequence 3 * sp
    bad_mask = torch.ones(2, 3, dtype=torch.bool, device=device)  # the local, not full, length
    errors["mask"] = _error_of(lambda: layer(x, padding_mask=bad_mask))
    errors["positions"] = _error_of(lambda: layer(x, position_ids=torch.arange(3, device=device)))
    errors["width"] = _error_of(lambda: layer(torch.zeros(3, 2, 8, device=device)))
    y = layer(x)  # the group is still usable: nothing hung half-way
    return errors, tuple(y.shape)
