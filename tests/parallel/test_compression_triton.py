"""The Triton block codec (`megazoo.kernels.triton_codec`) against the PyTorch codec.

Runs compiled on a GPU, and on CPU tensors under Triton's interpreter (conftest). Exactness:
the signs (1bit) are the same bits as the PyTorch codec's; a block's scale is the same mean
summed in another order (rtol 1e-6), so a ternary code may flip where |x| sits on the
threshold (at most 0.1% of codes here); decoding the same bytes gives the same floats (a
product of a sign and a scale), and the residual is x + err minus the decoded value up to
fp32 rounding (atol 1e-6 on values of size ~3). In the gloo reduction, fp32 sums of two
steps deviate from sum(outputs) + sum(residuals) = sum(inputs) by rounding only (1e-5
relative; a lost or doubled residual is off by O(1)), and both ranks decode the same bytes.
"""
import os

import pytest
import torch

from megazoo.parallel.compress.codecs import BlockCodec
from megazoo.testing import run_distributed

import compression_checks as checks

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


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the gloo ranks hold CPU tensors, which Triton runs only under its "
                           "interpreter (on CPU-only hosts; on GPUs the codec test above runs compiled)")
@pytest.mark.parametrize("algorithm", ["1bit", "2bit"])
def test_triton_reduction_conserves_mass_and_ranks_agree(algorithm):
    out = run_distributed(checks.conservation_both, 2, algorithm, 2, 2048, torch.float32, "triton",
                          timeout=240)
    for shard in (False, True):
        for r in (o[shard] for o in out):
            assert r["deviation"] < 1e-5 * max(r["scale"], 1.0), (shard, r["deviation"])
        for a, b in zip(out[0][shard]["outputs"], out[1][shard]["outputs"]):
            assert torch.equal(a, b)
