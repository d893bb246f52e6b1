"""One-process checks: layout-independent init and clear errors on bad input (no collective)."""
import re

import pytest
import torch
import torch.nn.functional as F

from megazoo.layers import (ColumnParallelLinear, NormalInit, RowParallelLinear,
                            VocabParallelEmbedding, padded_vocab_size, vocab_parallel_cross_entropy)
from megazoo.layers import init as init_module
from megazoo.parallel import GroupInfo


def fake_group(size: int, rank: int) -> GroupInfo:
    """A group of `size` ranks seen from `rank`, with no process group: constructing layers
    needs only sizes, so shapes and init are checked without processes."""
    return GroupInfo(group=None, ranks=tuple(range(size)), rank=rank)


@pytest.mark.parametrize("tp", [2, 4])
def test_every_rank_holds_its_slice_of_the_tp1_weights(tp):
    torch.manual_seed(0)
    col, row = ColumnParallelLinear(32, 64, group=None), RowParallelLinear(64, 32, group=None)
    emb = VocabParallelEmbedding(1000, 16, group=None)
    for rank in range(tp):
        torch.manual_seed(0)
        g = fake_group(tp, rank)
        c, r = ColumnParallelLinear(32, 64, group=g), RowParallelLinear(64, 32, group=g)
        e = VocabParallelEmbedding(1000, 16, group=g)
        assert torch.equal(c.weight, col.weight.chunk(tp, 0)[rank])
        assert torch.equal(r.weight, row.weight.chunk(tp, 1)[rank])
        n = max(0, min(e.vocab_end, 1000) - e.vocab_start)
        assert torch.equal(e.weight[:n], emb.weight[e.vocab_start:e.vocab_start + n])


def test_shard_init_never_builds_the_full_matrix(monkeypatch):
    """The BLOOM-176B embedding (250880 x 14336) at tp=8: rank 3 generates only its rows."""
    seen = []
    real = init_module.normal_block

    def spy(key, rows, cols, device=None):
        seen.append((rows, cols))
        return real(key, rows, cols, device)

    monkeypatch.setattr(init_module, "normal_block", spy)
    emb = VocabParallelEmbedding(250880, 14336, group=fake_group(8, 3), device="meta")
    weight = torch.empty(16, 14336)  # a slab of rank 3's shard, filled like the real one
    NormalInit(seed=1, key="emb").fill_(weight, emb.vocab_start, 0)
    assert emb.weight.shape == (31360, 14336) and emb.vocab_start == 3 * 31360
    assert all(r.start >= emb.vocab_start and r.stop <= emb.vocab_start + 16 for r, _ in seen)
    assert sum(len(r) * len(c) for r, c in seen) == weight.numel()


def test_normal_init_blocks_agree_and_are_normal():
    init = NormalInit(std=1.0, seed=3, key="w")
    full = init.fill_(torch.empty(256, 384))
    block = init.fill_(torch.empty(100, 50), row_offset=17, col_offset=301)
    assert torch.equal(block, full[17:117, 301:351])
    assert abs(full.mean().item()) < 0.02 and abs(full.std().item() - 1.0) < 0.02
    other = NormalInit(std=1.0, seed=4, key="w").fill_(torch.empty(256, 384))
    assert not torch.equal(other, full)


def test_padded_vocab_size():
    assert padded_vocab_size(50257, 1) == 50304
    assert padded_vocab_size(50257, 8) == 51200
    assert padded_vocab_size(250880, 4) == 250880


@pytest.mark.parametrize("build, message", [
    (lambda: ColumnParallelLinear(16, 10, group=fake_group(4, 0)), "out_features divided over tp=4 (10) is not divisible by 4"),
    (lambda: RowParallelLinear(10, 16, group=fake_group(4, 0)), "in_features divided over tp=4 (10) is not divisible by 4"),
    (lambda: ColumnParallelLinear(8, 8, group=None, gather_output=True, sequence_parallel=True), "cannot be combined"),
    (lambda: RowParallelLinear(8, 8, group=None, input_is_parallel=False, sequence_parallel=True), "needs input_is_parallel=True"),
])
def test_sizes_that_do_not_divide(build, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        build()


def test_wrong_input_shape():
    with pytest.raises(ValueError, match=re.escape("expects input [..., 8]")):
        ColumnParallelLinear(8, 4, group=None)(torch.zeros(3, 2, 7))
    with pytest.raises(ValueError, match=re.escape("expects input [..., 4]")):
        RowParallelLinear(8, 4, group=fake_group(2, 0))(torch.zeros(3, 2, 8))


def test_tokens_outside_the_vocabulary():
    emb = VocabParallelEmbedding(100, 4, group=None)
    with pytest.raises(ValueError, match="token id 100 is outside the vocabulary"):
        emb(torch.tensor([[1, 100]]))
    with pytest.raises(ValueError, match="token id -1 is outside"):
        emb(torch.tensor([[-1, 3]]))
    with pytest.raises(ValueError, match="integer tensor"):
        emb(torch.tensor([[1.0]]))
    logits = torch.zeros(2, 3, 128)
    with pytest.raises(ValueError, match="target 120 is outside the vocabulary"):
        vocab_parallel_cross_entropy(logits, torch.tensor([[1, 2, 120], [0, 0, -100]]), None,
                                     vocab_size=100)
    with pytest.raises(ValueError, match="disagree"):
        vocab_parallel_cross_entropy(logits, torch.zeros(3, 2, dtype=torch.long), None)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cross_entropy_is_stable_in_low_precision(dtype):
    """Logits of magnitude ~3e4 (exp overflows fp16/bf16, still finite in fp16): fp32 after the max."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(4, 5, 256, generator=g) * 8e3).to(dtype).requires_grad_()
    target = torch.randint(0, 256, (4, 5), generator=g)
    loss = vocab_parallel_cross_entropy(logits, target, None)
    ref_in = logits.detach().float().requires_grad_()
    ref = F.cross_entropy(ref_in.view(-1, 256), target.view(-1), reduction="none").view(4, 5)
    loss.sum().backward()
    ref.sum().backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss).all()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-3)  # fp32 math on rounded inputs
    assert logits.grad.dtype == dtype
    torch.testing.assert_close(logits.grad.float(), ref_in.grad, rtol=0, atol=1e-2)  # one bf16 ulp near 1


def _split_reference(t, gs, rope):
    """autograd's split + reshape (a cat in backward), then `positions.apply_rope`."""
    from megazoo.layers.positions import apply_rope

    s, b, kc, _, d = t.shape
    q, k, v = t.split([gs, 1, 1], dim=3)
    q, k, v = q.reshape(s, b, kc * gs, d), k.squeeze(3), v.squeeze(3)
    return (*apply_rope(q, k, *rope), v) if rope is not None else (q, k, v)


@pytest.mark.parametrize("rope_batch", [None, 1, 2])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_split_qkv_equals_split_and_rope_and_their_gradients(device, rope_batch):
    """`qkv_split.split_qkv` (its own backward, RoPE optional; compiled kernels on CUDA) against
    split + reshape + `apply_rope` through autograd, a missing k or v gradient included.
    float64 on CPU: equal to rounding (1e-12) and a gradcheck; float32 on CUDA, where the
    compiled kernels may contract multiplies: 1e-6."""
    from megazoo.layers.positions import rope_cos_sin
    from megazoo.layers.qkv_split import split_qkv

    dtype = torch.float64 if device == "cpu" else torch.float32
    tol = dict(rtol=0, atol=1e-12) if device == "cpu" else dict(rtol=1e-6, atol=1e-6)
    torch.manual_seed(0)
    x = torch.randn(5, 2, 3, 6, 8, device=device, dtype=dtype, requires_grad=True)
    rope = None
    if rope_batch is not None:
        positions = torch.arange(5, device=device) + 3 if rope_batch == 1 else \
            torch.randint(0, 50, (2, 5), device=device)
        rope = rope_cos_sin(positions, 8, dtype=dtype)
    got, want = split_qkv(x, 4, rope), _split_reference(x, 4, rope)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)
    seeds = [torch.randn_like(o) for o in got]
    torch.testing.assert_close(torch.autograd.grad(got, x, seeds, retain_graph=True)[0],
                               torch.autograd.grad(want, x, seeds, retain_graph=True)[0], **tol)
    no_k = torch.autograd.grad(got[0].sum() + got[2].sum(), x)[0]
    torch.testing.assert_close(no_k, torch.autograd.grad(want[0].sum() + want[2].sum(), x)[0], **tol)
    if device == "cpu":
        assert torch.autograd.gradcheck(lambda t: split_qkv(t, 4, rope), (x,))
        if rope is None:  # k and v stay views of qkv, and q too for one query head per group
            q, k, v = split_qkv(x.view(5, 2, 24, 3, 2), 1)
            assert all(t._base is x for t in (q, k, v))


def test_split_qkv_rejects_mismatched_shapes():
    from megazoo.layers.qkv_split import split_qkv

    with pytest.raises(ValueError, match="gs \\+ 2 = 6"):
        split_qkv(torch.zeros(5, 2, 3, 5, 8), 4)
    with pytest.raises(ValueError, match="cos/sin"):
        split_qkv(torch.zeros(5, 2, 3, 6, 8), 4, (torch.zeros(4, 1, 8), torch.zeros(4, 1, 8)))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_swiglu_of_the_fused_output_matches_the_formula(device):
    """`fusion.swiglu` takes fc1's whole [gate; up] output (compiled on CUDA, eager on CPU):
    its value and the one gradient it returns equal silu(gate) * up's and the two halves'
    gradients side by side (fp64 on CPU; fp32 on CUDA, where the compiled kernel may contract
    multiplies: 1e-6)."""
    from megazoo.kernels.fusion import swiglu

    dtype = torch.float64 if device == "cpu" else torch.float32
    torch.manual_seed(0)
    x = torch.randn(5, 3, 2 * 24, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(5, 3, 24, device=device, dtype=dtype)
    y = swiglu(x)
    (dx,) = torch.autograd.grad(y, x, dy)
    gate, up = x.detach()[..., :24].requires_grad_(), x.detach()[..., 24:].requires_grad_()
    ref = F.silu(gate) * up
    ref.backward(dy)
    tol = dict(rtol=1e-6, atol=1e-6) if device == "cuda" else dict(rtol=0, atol=1e-12)
    torch.testing.assert_close(y, ref, **tol)
    torch.testing.assert_close(dx, torch.cat([gate.grad, up.grad], -1), **tol)
