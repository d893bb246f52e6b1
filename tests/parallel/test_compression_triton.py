"""The Triton codecs (`megazoo.kernels.triton_codec`, `triton_topk`) against the PyTorch ones.

Runs compiled on a GPU, and on CPU tensors under Triton's interpreter (conftest). Exactness:
the signs (1bit) are the same bits as the PyTorch codec's; a block's scale is the same mean
summed in another order (rtol 1e-6), so a ternary code may flip where |x| sits on the
threshold (at most 0.1% of codes here); decoding the same bytes gives the same floats (a
product of a sign and a scale), and the residual is x + err minus the decoded value up to
fp32 rounding (atol 1e-6 on values of size ~3). In the gloo reduction, fp32 sums of two
steps deviate from sum(outputs) + sum(residuals) = sum(inputs) by rounding only (1e-5
relative; a lost or doubled residual is off by O(1)), and both ranks decode the same bytes.
topk: the same entries as torch.topk (random scores never tie), their values the same bits
in fp32 and within one bf16 rounding step in bf16 (Triton's interpreter casts by truncation,
compiled code rounds to nearest: rtol 1e-2), and decoded + residual = x + err exactly (a sent
value's rounding error is exact in fp32).
"""
import os

import pytest
import torch

from megazoo.compress.codecs import BlockCodec, TopKCodec
from megazoo.testing import run_distributed

from helpers import compression_checks as checks

pytestmark = pytest.mark.triton


def _codes_and_scales(codec: BlockCodec, wire: torch.Tensor, k: int):
    split = codec.padded(k) * codec.bits // 8
    return wire[:, :split], wire[:, split:].contiguous().view(codec.wire_dtype).float()


@pytest.mark.parametrize("bits", [1, 2])
@pytest.mark.parametrize("wire_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_codec_matches_the_pytorch_codec(bits, wire_dtype, triton_device):
    k = 3000  # not a block multiple: the last block is partial
    gen = torch.Generator().manual_seed(bits)
    x = torch.randn(3, k, generator=gen).to(triton_device)
    err0 = 0.1 * torch.randn(3, k, generator=gen).to(triton_device)
    fast, ref = (BlockCodec(bits, 256, wire_dtype, impl) for impl in ("triton", "torch"))
    err_fast, err_ref = err0.clone(), err0.clone()
    wire_fast = fast.encode_with_error(x, err_fast)
    wire_ref = ref.encode_with_error(x, err_ref)
    assert wire_fast.shape == wire_ref.shape
    codes_fast, scales_fast = _codes_and_scales(fast, wire_fast, k)
    codes_ref, scales_ref = _codes_and_scales(ref, wire_ref, k)
    torch.testing.assert_close(scales_fast, scales_ref, rtol=1e-6 if wire_dtype == torch.float32 else 1e-2, atol=0)
    if bits == 1:
        assert torch.equal(codes_fast, codes_ref)
    else:
        assert (codes_fast != codes_ref).float().mean() < 1e-3
    decoded = ref.decode_rows(wire_fast, k, torch.empty(3, k, device=triton_device))
    torch.testing.assert_close(err_fast, x + err0 - decoded, rtol=0, atol=1e-6)
    assert torch.equal(fast.decode_rows(wire_fast, k, torch.empty_like(decoded)), decoded)
    torch.testing.assert_close(fast.decode_sum(wire_fast, k, torch.float32), decoded.sum(0),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("weighted", [False, True], ids=["by_size", "weighted"])
@pytest.mark.parametrize("wire_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_topk_matches_the_pytorch_codec(weighted, wire_dtype, triton_device):
    numel = 140_000  # two whole chunks of 65536 and a partial one
    gen = torch.Generator().manual_seed(3)
    x, err0, w = (torch.randn(numel, generator=gen).to(triton_device) for _ in range(3))
    weight = w.abs() if weighted else None
    fast, ref = (TopKCodec(0.003, wire_dtype, impl) for impl in ("triton", "torch"))
    err_fast, err_ref = err0.clone(), err0.clone()
    wire_fast = fast.encode_with_error(x, err_fast, weight)
    wire_ref = ref.encode_with_error(x, err_ref, weight)
    assert wire_fast.shape == wire_ref.shape == (1, ref.row_bytes(numel))
    got = ref.decode_sum_into(wire_fast, torch.empty_like(x))
    want = ref.decode_sum_into(wire_ref, torch.empty_like(x))
    assert torch.equal(got != 0, want != 0)  # the same entries
    torch.testing.assert_close(got, want, rtol=0 if wire_dtype == torch.float32 else 1e-2, atol=0)
    assert torch.equal(got + err_fast, x + err0)


def _chosen(codec: TopKCodec, wire: torch.Tensor, numel: int) -> list[list[int]]:
    """The sorted offsets each chunk of the wire sends."""
    chunks, _, k = codec.shape(numel)
    offsets = wire[0, chunks * k * codec.wire_dtype.itemsize:].cpu().view(torch.int16)
    return (offsets.long() + 32768).view(chunks, k).sort(1).values.tolist()


def _reference(score: torch.Tensor, codec: TopKCodec) -> list[list[int]]:
    """Each chunk's k largest scores, ties to the lowest index (a stable descending sort),
    the last chunk padded with zero scores."""
    chunks, chunk, k = codec.shape(score.numel())
    padded = torch.nn.functional.pad(score.cpu(), (0, chunks * chunk - score.numel()))
    order = padded.view(chunks, chunk).sort(dim=1, descending=True, stable=True).indices
    return order[:, :k].sort(1).values.tolist()


def _magnitudes(kind: str, numel: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(numel, generator=gen)
    if kind == "ties_at_threshold":  # 300 equal entries straddle each chunk's k-th largest
        for start in range(0, numel, 65536):
            part = x[start:start + 65536]
            part[1000:1300] = part.abs().sort(descending=True).values[600]
    if kind == "constant":  # every score equal
        x = torch.where(x < 0, -1.0, 1.0)
    if kind == "mostly_zero":  # 1 in 20 nonzero: fewer than k in the last chunk
        x = torch.where(torch.arange(numel) % 20 == 0, x, torch.zeros(()))
    return x


@pytest.mark.parametrize("kind", ["random", "ties_at_threshold", "constant", "mostly_zero"])
def test_triton_topk_takes_the_k_largest_ties_by_index(kind, triton_device):
    """The exact choice, checked against a stable sort: random scores, ties straddling the
    k-th largest, all scores equal, mostly zeros (fewer nonzeros than k in the last chunk)."""
    numel = 140_000
    x = _magnitudes(kind, numel).to(triton_device)
    codec = TopKCodec(0.01, torch.float32, "triton")
    err = torch.zeros_like(x)
    wire = codec.encode_with_error(x, err)
    assert _chosen(codec, wire, numel) == _reference(x.abs(), codec)
    decoded = codec.decode_sum_into(wire, torch.empty_like(x))
    assert torch.equal(decoded + err, x)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the gloo ranks hold CPU tensors, which Triton runs only under its "
                           "interpreter (on CPU-only hosts; on GPUs the codec test above runs compiled)")
@pytest.mark.parametrize("algorithm", ["1bit", "2bit", "topk"])
def test_triton_reduction_conserves_mass_and_ranks_agree(algorithm):
    out = run_distributed(checks.conservation_both, 2, algorithm, 2, 2048, torch.float32, "triton",
                          algorithm == "topk", timeout=240)
    for shard in (False, True):
        for r in (o[shard] for o in out):
            assert r["deviation"] < 1e-5 * max(r["scale"], 1.0), (shard, r["deviation"])
        for a, b in zip(out[0][shard]["outputs"], out[1][shard]["outputs"]):
            assert torch.equal(a, b)
