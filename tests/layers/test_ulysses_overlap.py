"""bench/experimental/ulysses_overlap.py (the chunked, overlapped Ulysses pipeline, outside
the library) against the one-process block.

The distributed check (attention_checks.check_ulysses_overlap, world 4) runs sp = 4,
tp = 2 x sp = 2 (with and without Megatron SP) and sp = 2 x dp = 2 over every case of
attention_checks (ALiBi, RoPE with packed positions, GQA split and replicated, MQA, padding),
with automatic chunks and with 2 chunks; output, input gradient and weight/bias gradients
are compared per tensor with the tolerances stated in attention_checks.py.
"""
import pytest
import torch
import torch.distributed as dist

from helpers import attention_checks
from megazoo.layers import UlyssesAttention
from bench.experimental.ulysses_overlap import UlyssesOverlapAttention, choose_num_chunks
from megazoo.parallel.state import GroupInfo
from megazoo.testing import run_distributed


def test_overlap_matches_single_process():
    results = run_distributed(attention_checks.check_ulysses_overlap, 4, timeout=300)
    worst, chunks = results[0]
    assert max(w for w, _ in results) < 1e-4  # for the record; asserted per tensor in compare
    assert {k for *_, k in chunks} >= {1, 2, 3}  # pipelines of 1, 2 and 3 chunks were checked


def test_choose_num_chunks():
    assert [choose_num_chunks(g, None) for g in (1, 2, 3, 6, 8, 16)] == [1, 2, 3, 3, 4, 4]
    assert choose_num_chunks(16, 8) == 8
    with pytest.raises(ValueError, match="must divide the 6 kv groups"):
        choose_num_chunks(6, 4)
    with pytest.raises(ValueError, match="num_chunks=2"):  # 8 q / 2 kv heads at sp=2: 1 group
        # Construction only reads size and rank; no collective is issued.
        UlyssesOverlapAttention(8, 4, num_kv_heads=2, num_chunks=2,
                                sp_group=GroupInfo(group=None, ranks=(0, 1), rank=0))


def _same_as_plain(chunks):
    """Rank side: plain and overlapped modules on identical float32 inputs."""
    n, rank = dist.get_world_size(), dist.get_rank()
    s, b, heads, d = 8 * n, 2, 8, 4
    full = torch.randn(s, b, heads * 3 * d, generator=torch.Generator().manual_seed(0))
    local = full[rank * s // n:(rank + 1) * s // n]
    results = []
    for module in (UlyssesAttention(heads, d, sp_group=dist.group.WORLD, position_embedding="rope"),
                   UlyssesOverlapAttention(heads, d, sp_group=dist.group.WORLD,
                                           position_embedding="rope", num_chunks=chunks)):
        x = local.clone().requires_grad_()
        y = module(x)
        (y * y).sum().backward()
        with torch.no_grad():  # no graph kept, same numbers
            assert torch.equal(module(x), y.detach())
        results.append((y.detach(), x.grad))
    (y0, g0), (y1, g1) = results
    # Same kernels on the same numbers per head: only the grouping of heads into SDPA calls
    # differs, which on CPU changes nothing; allow float32 rounding anyway.
    torch.testing.assert_close(y1, y0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g1, g0, rtol=1e-6, atol=1e-6)
    return True


def test_overlap_equals_plain_ulysses_sp2():
    assert all(run_distributed(_same_as_plain, 2, 4, timeout=60))


# On 2 GPUs: sp = 2, NCCL (the asynchronous all-to-alls on the communication stream, the case
# the overlap is for), the auto backend; tolerances of attention_checks for CUDA.
@pytest.mark.gpu(count=2)
def test_overlap_matches_single_process_nccl():
    results = run_distributed(attention_checks.check_ulysses_overlap, 2, "cuda", timeout=600,
                              backend="nccl")
    assert max(w for w, _ in results) < 2e-3
