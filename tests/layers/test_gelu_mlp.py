"""The fused GELU MLP (megazoo/layers/gelu_mlp.py) and cuBLASLt's epilogues
(megazoo/kernels/cublaslt.py).

CPU: cuBLASLt cannot run, so `gelu_mlp` takes its torch fallbacks; that is the backward's
own arithmetic (the GELU derivative, the weight and bias gradients, the main-gradient
contract), compared exactly with autograd through F.linear / F.gelu. GPU: each epilogue
against a float64 reference, and ParallelMLP fused against unfused in bf16; tolerances are
stated where they are asserted.
"""
import pytest
import torch
import torch.nn.functional as F

from megazoo.kernels import cublaslt
from megazoo.layers import gelu_mlp as gelu_mlp_module
from megazoo.layers.gelu_mlp import gelu_mlp
from megazoo.layers.mlp import ParallelMLP

S, B, H, FFN = 8, 2, 16, 64


def _weights(dtype, device="cpu", bias=True):
    g = torch.Generator().manual_seed(0)

    def make(*shape):
        return (torch.randn(*shape, generator=g) * 0.3).to(device, dtype)

    w1, w2 = make(FFN, H), make(H, FFN)
    b1, b2 = (make(FFN), make(H)) if bias else (None, None)
    return [t.requires_grad_() if t is not None else None for t in (w1, b1, w2, b2)]


def _reference(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)


def _grads(fn, x, params, dy):
    x = x.detach().clone().requires_grad_()
    params = [p.detach().clone().requires_grad_() if p is not None else None for p in params]
    y = fn(x, *params)
    y.backward(dy)
    return [y, x.grad] + [p.grad for p in params if p is not None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_cpu_fallback_equals_autograd(dtype, bias):
    """Output, dx, dW1, db1, dW2, db2 bit-equal to autograd through the plain ops."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(S, B, H, generator=g).to(dtype)
    dy = torch.randn(S, B, H, generator=g).to(dtype)
    params = _weights(dtype, bias=bias)
    fused, plain = _grads(gelu_mlp, x, params, dy), _grads(_reference, x, params, dy)
    assert len(fused) == len(plain) == (6 if bias else 4)
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_cpu_fused_weights_take_the_main_gradient():
    """Weights marked for gradient-accumulation fusion get dW summed into `main_grad` over
    two micro-batches (the first overwrites a stale NaN), exactly the autograd sum; the
    biases still get their gradient through autograd."""
    params = _weights(torch.float32)
    w1, b1, w2, b2 = params
    for w in (w1, w2):
        w.main_grad = torch.full(w.shape, float("nan"))
        w.fuse_wgrad, w.main_grad_fresh, w.grad_added_to_main_grad = True, True, False
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g))
            for _ in range(2)]
    want = [torch.zeros_like(p) for p in params]
    for x, dy in data:
        gelu_mlp(x, *params).backward(dy)
        for acc, got in zip(want, _grads(_reference, x, params, dy)[2:]):
            acc += got
    for w, ref in ((w1, want[0]), (w2, want[2])):
        assert w.grad_added_to_main_grad and not w.main_grad_fresh
        torch.testing.assert_close(w.main_grad, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(b1.grad, want[1], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(b2.grad, want[3], rtol=1e-6, atol=1e-6)


def test_parallel_mlp_takes_the_fused_path_where_it_can(monkeypatch):
    """ParallelMLP routes "gelu" through gelu_mlp when `fusable` says so (CUDA, bf16 / fp16),
    not with bias_gelu_fusion=False, nor for gelu_exact or swiglu."""
    calls = []
    real = gelu_mlp_module._GeluMLP.apply
    monkeypatch.setattr("megazoo.layers.mlp.fusable", lambda x, w, gathered: True)
    monkeypatch.setattr(gelu_mlp_module._GeluMLP, "apply",
                        staticmethod(lambda *a: calls.append(1) or real(*a)))
    x = torch.randn(S, B, H)
    for activation, fusion, expect in (("gelu", True, 1), ("gelu", False, 0),
                                       ("gelu_exact", True, 0), ("swiglu", True, 0)):
        calls.clear()
        torch.manual_seed(0)
        mlp = ParallelMLP(H, FFN, group=None, activation=activation, bias_gelu_fusion=fusion)
        y = mlp(x)
        assert len(calls) == expect, (activation, fusion)
        if activation == "gelu":
            ref = _reference(x, mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias)
            torch.testing.assert_close(y, ref, rtol=0, atol=0)


def test_cublaslt_refuses_what_it_cannot_run():
    """False, and nothing written, on CPU and for operands it cannot take."""
    a, b, out = torch.randn(16, 16), torch.randn(16, 16), torch.zeros(16, 16)
    assert not cublaslt.gemm(a, b, out)
    assert not cublaslt.gemm(a, b, out, epilogue="dgelu")  # no aux
    assert not cublaslt.gemm(a, b, out, epilogue="nonsense")
    assert torch.equal(out, torch.zeros(16, 16))


# ---------------------------------------------------------------------------------- GPU

def _rel(got, want):
    return float((got.double() - want).abs().max() / want.abs().max())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_epilogues_match_float64(dtype):
    """Each epilogue must run (True) and match float64. The GEMM sums in fp32, so what is
    left is the output's rounding: bf16 keeps 8 bits (2^-9 = 2e-3 relative per element; fp16
    2^-12), so outputs are held to 8e-3 of the largest element (a few roundings, including
    the pre-activation's, which the dgelu epilogue reads in the output dtype). A wrong
    transpose, bias or derivative is off by O(1)."""
    torch.manual_seed(0)
    m, k, n = 256, 128, 192
    bf = dict(device="cuda", dtype=dtype)
    x, w, b = torch.randn(m, k, **bf), torch.randn(n, k, **bf) * 0.1, torch.randn(n, **bf)
    y, pre = torch.empty(m, n, **bf), torch.empty(m, n, **bf)
    assert cublaslt.gemm(x, w, y, trans_b=True, epilogue="gelu_aux_bias", bias=b, aux=pre)
    pre64 = x.double() @ w.double().t() + b.double()
    assert _rel(pre, pre64) < 8e-3
    assert _rel(y, F.gelu(pre64, approximate="tanh")) < 8e-3
    y_nb, pre_nb = torch.empty_like(y), torch.empty_like(pre)  # no bias: "gelu_aux"
    assert cublaslt.gemm(x, w, y_nb, trans_b=True, epilogue="gelu_aux", aux=pre_nb)
    assert _rel(y_nb, F.gelu(x.double() @ w.double().t(), approximate="tanh")) < 8e-3

    dy, w2 = torch.randn(m, k, **bf), torch.randn(k, n, **bf) * 0.1
    dpre = torch.empty(m, n, **bf)
    assert cublaslt.gemm(dy, w2, dpre, epilogue="dgelu", aux=pre)
    p = pre.double().requires_grad_()
    F.gelu(p, approximate="tanh").backward(dy.double() @ w2.double())
    assert _rel(dpre, p.grad) < 8e-3


@pytest.mark.gpu
def test_gpu_fused_mlp_matches_unfused_bf16(monkeypatch):
    """ParallelMLP in bf16 with and without bias_gelu_fusion, against the float64 function
    of the same bf16 weights: the fused path's output and every gradient must be as close
    as the unfused path's (within 1.5x its error plus 1e-3 of the largest element; both
    are bf16 computations, ~1e-2 here), and the two paths must agree with each other."""
    monkeypatch.setattr(gelu_mlp_module, "MIN_ACTIVATION", 0)  # this shape is below it
    torch.manual_seed(0)
    s, b, h, ffn = 128, 4, 256, 1024
    x = torch.randn(s, b, h, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(s, b, h, device="cuda", dtype=torch.bfloat16)
    results = {}
    for fusion in (True, False):
        torch.manual_seed(1)
        mlp = ParallelMLP(h, ffn, group=None, bias_gelu_fusion=fusion).cuda().to(torch.bfloat16)
        with torch.no_grad():
            mlp.fc1.bias.normal_()
            mlp.fc2.bias.normal_()
        xi = x.clone().requires_grad_()
        mlp(xi).backward(dy)
        params = [mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias]
        results[fusion] = [mlp(x).detach(), xi.grad] + [p.grad for p in params]
        ref = _grads(_reference, x.double(), [p.double() for p in params], dy.double())
    for fused, plain, want in zip(results[True], results[False], ref):
        assert _rel(fused, want) < 1.5 * _rel(plain, want) + 1e-3
        assert _rel(fused, plain) < 2e-2


@pytest.mark.gpu
def test_gpu_small_mlps_keep_the_plain_ops():
    """The fused path is taken from MIN_ACTIVATION elements of [tokens, ffn] on (its Python
    and ctypes launches cost the host more than a smaller MLP's saved kernels)."""
    from megazoo.layers.gelu_mlp import MIN_ACTIVATION, fusable

    bf = dict(device="cuda", dtype=torch.bfloat16)
    w1 = torch.empty(4096, 16, **bf)
    tokens = MIN_ACTIVATION // 4096
    assert fusable(torch.empty(tokens, 1, 16, **bf), w1)
    assert not fusable(torch.empty(tokens // 2, 1, 16, **bf), w1)
    assert not fusable(torch.empty(tokens, 1, 16, device="cuda"), w1)  # fp32
    assert fusable(torch.empty(tokens // 2, 1, 16, **bf), w1, gathered=2)  # Megatron SP
