"""Gradient-accumulation fusion (megazoo/layers/wgrad.py, megazoo/kernels/cublaslt.py): a
linear's weight gradient summed straight into the fp32 main gradient.

CPU: the fused backward computes the gradient in the weight's dtype and adds it, the same
arithmetic as the unfused hook, so everything is compared exactly: dW summed over
micro-batches, dx, db, and the owner's contract (the first micro-batch overwrites whatever
`main_grad` held, the hook sees `grad_added_to_main_grad`). GPU: the fused GEMMs against
an fp32 reference; their tolerances are stated where they are asserted.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megazoo.config.precision import FP8Recipe
from megazoo.layers import ColumnParallelLinear, RowParallelLinear
from megazoo.kernels.cublaslt import fp8_gemm_accumulate
from megazoo.layers.linear import fusable_weights
from megazoo.layers.wgrad import accumulate_wgrad

M, K, N, MICRO = 32, 48, 16, 3


class _Owner:
    """The gradient owner's half of the contract (what `GradBuffer` does)."""

    def __init__(self, weight: nn.Parameter, fuse: bool = True):
        self.weight, self.calls, self.flags = weight, 0, []
        weight.main_grad = torch.full(weight.shape, float("nan"))  # stale: must be overwritten
        weight.fuse_wgrad, weight.main_grad_fresh = fuse, True
        weight.grad_added_to_main_grad = False
        weight.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, p):
        self.calls += 1
        self.flags.append(p.grad_added_to_main_grad)
        if p.grad_added_to_main_grad:
            p.grad_added_to_main_grad = False
        else:
            p.main_grad.copy_(p.grad) if self.calls == 1 else p.main_grad.add_(p.grad)
            p.main_grad_fresh = False
        p.grad = None


def _micro_batches(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, M // 4, K, generator=g).to(dtype),
             torch.randn(4, M // 4, N, generator=g).to(dtype)) for _ in range(MICRO)]


def _layer(cls, dtype, fp8=None):
    torch.manual_seed(1)
    kw = {"input_is_parallel": True} if cls is RowParallelLinear else {}
    layer = cls(K, N, group=None, fp8=fp8, **kw).to(dtype)
    with torch.no_grad():
        layer.bias.normal_()
    return layer


def _unfused(layer, data):
    """dW summed in fp32 the unfused way, and each micro-batch's dx and db."""
    total, dxs, dbs = None, [], []
    for x, dy in data:
        x = x.clone().requires_grad_()
        layer(x).backward(dy)
        g = layer.weight.grad.float()
        total = g if total is None else total + g
        dxs.append(x.grad)
        dbs.append(layer.bias.grad.clone())
        layer.weight.grad = layer.bias.grad = None
    return total, dxs, dbs


@pytest.mark.parametrize("cls", [ColumnParallelLinear, RowParallelLinear])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8", [None, FP8Recipe(format="hybrid", emulate=True)],
                         ids=["plain", "fp8-emulated"])
def test_fused_equals_unfused_over_micro_batches(cls, dtype, fp8):
    data = _micro_batches(dtype)
    want, want_dx, want_db = _unfused(_layer(cls, dtype, fp8), data)
    layer = _layer(cls, dtype, fp8)
    owner = _Owner(layer.weight)
    for i, (x, dy) in enumerate(data):
        x = x.clone().requires_grad_()
        layer(x).backward(dy)
        assert torch.equal(x.grad, want_dx[i])
        assert torch.equal(layer.bias.grad, want_db[i])
        layer.bias.grad = None
    assert owner.flags == [True] * MICRO  # every micro-batch went through the fused path
    assert layer.weight.grad is None
    assert torch.equal(layer.weight.main_grad, want)


def test_a_new_step_overwrites_and_an_unfused_call_is_added_to():
    data = _micro_batches(torch.float32)
    layer = _layer(ColumnParallelLinear, torch.float32)
    owner = _Owner(layer.weight)
    layer(data[0][0]).backward(data[0][1])
    layer.weight.main_grad_fresh, owner.calls = True, 0  # the owner starts a new step
    layer(data[1][0]).backward(data[1][1])
    want, _, _ = _unfused(_layer(ColumnParallelLinear, torch.float32), data[1:2])
    assert torch.equal(layer.weight.main_grad, want)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast: the unfused F.linear
        layer(data[2][0]).backward(data[2][1].bfloat16())
    assert owner.flags[-1] is False
    assert not layer.weight.main_grad_fresh  # a later fused call adds
    assert layer.weight.main_grad.ne(want).any()


def test_no_fusion_without_the_owner_or_under_no_grad():
    layer = _layer(ColumnParallelLinear, torch.float32)
    x, dy = _micro_batches(torch.float32)[0]
    layer(x).backward(dy)
    assert layer.weight.grad is not None  # no owner: autograd's own .grad
    owner = _Owner(layer.weight, fuse=False)
    layer.weight.grad = None
    layer(x).backward(dy)
    assert owner.flags == [False]
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def test_fusable_weights_skip_tied_hooked_and_frozen_weights():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = ColumnParallelLinear(8, 8, group=None)
            self.b = RowParallelLinear(8, 8, group=None)
            self.tied = ColumnParallelLinear(8, 8, group=None)
            self.tied_copy = ColumnParallelLinear(8, 8, group=None)
            self.tied_copy.weight = self.tied.weight
            self.hooked = ColumnParallelLinear(8, 8, group=None)
            self.hooked.weight.register_hook(lambda g: g)
            self.frozen = ColumnParallelLinear(8, 8, group=None)
            self.frozen.weight.requires_grad_(False)
            self.other = nn.Linear(8, 8)

    net = Net()
    assert [id(w) for w in fusable_weights(net)] == [id(net.a.weight), id(net.b.weight)]


def test_fp8_accumulate_declines_off_gpu():
    a = torch.zeros(16, 16, dtype=torch.float8_e5m2)
    b = torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
    out = torch.full((16, 16), 3.0)
    one = torch.ones(())
    assert not fp8_gemm_accumulate(a, b, one, one, out, accumulate=True)
    assert torch.equal(out, torch.full((16, 16), 3.0))


# -- GPU --------------------------------------------------------------------------------------
SHAPES = [(4096, 1024, 3072), (2048, 512, 1536)]  # tokens M, in K, out N


def _weight_with_main_grad(n, k, dtype, start):
    w = nn.Parameter(torch.empty(n, k, device="cuda", dtype=dtype))
    w.main_grad = torch.full((n, k), start, device="cuda")
    w.fuse_wgrad, w.main_grad_fresh, w.grad_added_to_main_grad = True, start != start, False
    return w


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_gpu_fused_wgrad_gemm(dtype, shape):
    """bf16 inputs, fp32 accumulation: the fused GEMM is exact up to the GEMM's own fp32
    summation order; the reference is float64. rtol 1e-5 of the largest element (the
    unfused path would round each micro-batch's dW to bf16: 2^-9 = 2e-3)."""
    m, k, n = shape
    torch.manual_seed(0)
    dy, x = (torch.randn(m, n, device="cuda").to(dtype), torch.randn(m, k, device="cuda").to(dtype))
    for start in (float("nan"), 3.0):  # nan: a fresh step (beta 0), 3.0: accumulate
        w = _weight_with_main_grad(n, k, dtype, start)
        accumulate_wgrad(w, dy, x)
        want = dy.double().t() @ x.double() + (0.0 if start != start else start)
        err = (w.main_grad.double() - want).abs().max() / want.abs().max()
        assert err < 1e-5, (start, float(err))
        assert w.grad_added_to_main_grad and not w.main_grad_fresh


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_gpu_fp8_wgrad_accumulates_in_cublaslt(shape):
    """The cuBLASLt call must run (True) and match the dequantized product in float64 to
    1e-3 of the largest element: FP8 products are exact, but Hopper's FP8 tensor cores
    accumulate with fewer mantissa bits than fp32 (measured ~1.4e-4 of the largest element
    at K = 4096), while a transposed or mis-scaled operand is off by O(1)."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability 8.9+")
    m, k, n = shape
    torch.manual_seed(0)
    xt = (torch.randn(k, m, device="cuda") * 50).to(torch.float8_e4m3fn)
    dyt = (torch.randn(n, m, device="cuda") * 1000).to(torch.float8_e5m2)
    s_x, s_dy = torch.tensor(0.02, device="cuda"), torch.tensor(3e-4, device="cuda")
    want = (dyt.double() @ xt.double().t()) * 0.02 * 3e-4
    for start, accumulate in ((float("nan"), False), (-1.0, True)):
        out = torch.full((n, k), start, device="cuda")
        assert fp8_gemm_accumulate(dyt, xt, s_dy, s_x, out, accumulate)
        expect = want + (start if accumulate else 0.0)
        err = (out.double() - expect).abs().max() / want.abs().max()
        assert err < 1e-3, (accumulate, float(err))
    misaligned = torch.zeros(n * k + 1, device="cuda")[1:].view(n, k)
    assert not fp8_gemm_accumulate(dyt, xt, s_dy, s_x, misaligned, True)
