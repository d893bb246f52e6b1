"""Compressed reductions (`megazoo.compress`) on gloo ranks, against exact sums.

Tolerances. `lossless`: inputs each codec represents exactly (small integers), so the sum
must match bit for bit. `conservation`: sum of outputs + sum of every rank's residuals =
sum of inputs holds exactly in real arithmetic; the test runs in float64, where the rounding
of four steps of adds on values of size ~10 stays below 1e-12 (a lost or doubled residual
is off by O(1)). Every rank must decode the same bytes in the same order: outputs are
compared with torch.equal.
"""
import pytest
import torch

from megazoo.compress.codecs import BlockCodec, TopKCodec, pack_bits, unpack_bits
from megazoo.testing import run_distributed

from helpers import compression_checks as checks

TIMEOUT = 120
ALGORITHMS = ["topk", "1bit", "2bit"]


def test_bit_packing_round_trips():
    codes = torch.randint(0, 2, (3, 64))
    packed = pack_bits(codes, 1)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 8)  # 8 signs per byte
    assert torch.equal(unpack_bits(packed, 1).long(), codes)
    codes = torch.randint(0, 3, (2, 64))
    assert pack_bits(codes, 2).shape == (2, 16)
    assert torch.equal(unpack_bits(pack_bits(codes, 2), 2).long(), codes)


def test_wire_sizes():
    """1bit is 1/32 of fp32 plus one scale per block; topk sends value + uint16 offset."""
    assert BlockCodec(1, 1024, torch.float32).row_bytes(1 << 20) == (1 << 17) + 1024 * 4
    assert BlockCodec(2, 1024, torch.bfloat16).row_bytes(1 << 20) == (1 << 18) + 1024 * 2
    codec = TopKCodec(0.01, torch.float32)
    assert codec.shape(200_000) == (4, 65536, 656)
    assert codec.row_bytes(200_000) == 4 * 656 * 6


def _topk(codec, x, weight=None):
    """(wire, what the receivers decode) for x with no earlier residual; the residual left
    must be x minus that, exactly (an fp32 wire rounds nothing)."""
    err = torch.zeros_like(x)
    wire = codec.encode_with_error(x, err, weight)
    decoded = codec.decode_sum_into(wire, torch.full_like(x, float("nan")))
    assert torch.equal(err, x - decoded)
    return wire, decoded


def test_topk_offsets_decode_to_the_selected_entries():
    """Two whole chunks and a partial last one (padded inside the codec)."""
    x = torch.zeros(140_000)
    hot = torch.tensor([3, 65535, 65536, 139_999])
    x[hot] = torch.tensor([5.0, -7.0, 2.0, -1.0])
    codec = TopKCodec(1 / 65536, torch.float32)  # one entry per chunk
    wire, sent = _topk(codec, x)
    assert wire.numel() == codec.row_bytes(x.numel()) == 3 * 6
    assert sent[65535] == -7.0 and sent[65536] == 2.0 and sent[139_999] == -1.0
    assert sent.count_nonzero() == 3


def test_topk_weight_changes_the_choice_not_the_values():
    """Chosen by |x| x weight: the small entry with the large weight is sent, with its own
    value (the receivers never see the weights)."""
    x = torch.tensor([4.0, -1.0, 3.0, 0.5])
    codec = TopKCodec(0.5, torch.float32)  # 2 of 4
    _, sent = _topk(codec, x)
    assert torch.equal(sent, torch.tensor([4.0, 0.0, 3.0, 0.0]))
    _, sent = _topk(codec, x, torch.tensor([1.0, 10.0, 0.1, 1.0]))
    assert torch.equal(sent, torch.tensor([4.0, -1.0, 0.0, 0.0]))


def test_topk_residual_keeps_the_wire_dtype_rounding():
    """bf16 values on the wire: a sent entry leaves its rounding error behind, so x = decoded
    + residual still holds exactly."""
    x = torch.tensor([1.0 + 2 ** -12, -3.0, 0.25, 0.0])
    codec = TopKCodec(0.5, torch.bfloat16)
    err = torch.zeros_like(x)
    wire = codec.encode_with_error(x, err)
    decoded = codec.decode_sum_into(wire, torch.empty_like(x))
    assert torch.equal(decoded, torch.tensor([1.0, -3.0, 0.0, 0.0]))
    assert torch.equal(decoded + err, x) and err[0] == 2 ** -12


def test_lossless_inputs_sum_exactly():
    """topk at ratio 1; 1bit / 2bit on blocks of +-s (and 0) with one pattern on all ranks."""
    out = run_distributed(checks.lossless_all, 2, 4000, timeout=TIMEOUT)
    assert all(r[alg]["equal"] for r in out for alg in ALGORITHMS), out


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_error_feedback_conserves_mass_and_ranks_agree(algorithm):
    """All-reduce form and reduce-scatter form (the distributed optimizer's), 4 steps."""
    out = run_distributed(checks.conservation_both, 2, algorithm, 4, 4000, timeout=TIMEOUT)
    for shard in (False, True):
        for r in (o[shard] for o in out):
            assert r["deviation"] < 1e-12 * max(r["scale"], 1.0), (shard, r["deviation"])
            assert r["sent"] <= r["dense"] / 4  # it did compress (float64 values here)
        for a, b in zip(out[0][shard]["outputs"], out[1][shard]["outputs"]):
            assert torch.equal(a, b)


def test_weighted_topk_conserves_mass_and_ranks_agree():
    """topk chosen by a weight (the topk-tuned recipe's selection by AdamW step): each rank
    picks by its own weights; what it did not send stays in its residual, so the conservation
    bound and bit-equal outputs still hold."""
    out = run_distributed(checks.conservation_both, 2, "topk", 4, 4000, torch.float64, None,
                          True, timeout=TIMEOUT)
    for shard in (False, True):
        for r in (o[shard] for o in out):
            assert r["deviation"] < 1e-12 * max(r["scale"], 1.0), (shard, r["deviation"])
        for a, b in zip(out[0][shard]["outputs"], out[1][shard]["outputs"]):
            assert torch.equal(a, b)


def test_three_ranks_conserve_mass():
    """Chunks of uneven blocks (4000 / 3 is not a block multiple) and an odd group."""
    out = run_distributed(checks.conservation, 3, "1bit", 3, 3999, False, timeout=TIMEOUT)
    assert all(r["deviation"] < 1e-12 * max(r["scale"], 1.0) for r in out)


def test_communication_data_type_halves_the_bytes_of_an_exact_sum():
    out = run_distributed(checks.dense_wire_dtypes, 2, 1000, timeout=TIMEOUT)
    for rank_out in out:
        for full_ok, shard_ok, ratio, dtype in rank_out.values():
            assert full_ok and shard_ok and ratio == 2 and dtype == torch.float32
