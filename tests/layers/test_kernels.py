"""megazoo.kernels: fallbacks vs independent formulas (CPU), Triton kernels vs the fallbacks
(``@pytest.mark.triton``: on CPU under Triton's interpreter, see conftest.py), every fused
kernel vs its fallback at large awkward sizes (GPU).

GPU tests: ``python -m pytest tests/layers/test_kernels.py -m gpu -v`` on a machine with a GPU.
Tolerances are explained in tests/helpers/kernel_checks.py.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers import kernel_checks as C
from bench.experimental import kernels as X
from megazoo import kernels as K
from megazoo.kernels import _dispatch

ROOT = Path(__file__).resolve().parents[2]
F64 = torch.float64


def _env(**extra) -> dict:
    """Environment of a normal run (no Triton interpreter) importing this checkout's megazoo."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    return env


# ---------------------------------------------------------------- fallbacks vs formulas (CPU)

@pytest.mark.parametrize("alibi", [False, True])
@pytest.mark.parametrize("sq,sk", [(6, 6), (3, 8)])
def test_softmax_fallback_vs_formula(alibi, sq, sk):
    """Causal mask from torch.tril, ALiBi in its -slope*|i - j| form (equal after softmax)."""
    scores = torch.randn(2, 3, sq, sk, dtype=F64)
    slopes = torch.tensor([0.5, 0.25, 0.125], dtype=F64)
    keep = torch.ones(sq, sk, dtype=torch.bool).tril(diagonal=sk - sq)
    i = torch.arange(sq)[:, None] + (sk - sq)  # query i sits at key position i + sk - sq
    bias = -slopes.view(3, 1, 1) * (i - torch.arange(sk)).abs() if alibi else 0.0
    want = torch.softmax((0.7 * scores + bias).masked_fill(~keep, -math.inf), dim=-1)
    got = X.softmax_reference(scores, 0.7, slopes if alibi else None, causal=True)
    torch.testing.assert_close(got, want)
    full = X.softmax_reference(scores, 0.7, None, causal=False)
    torch.testing.assert_close(full, torch.softmax(0.7 * scores, dim=-1))


def test_softmax_rejects_fully_masked_rows():
    with pytest.raises(ValueError, match="sq <= sk"):
        X.scaled_masked_softmax(torch.randn(1, 1, 4, 3), 1.0, causal=True)


def test_layer_norm_fallback_vs_formula():
    x, w, b = torch.randn(4, 5, 33, dtype=F64), torch.randn(33, dtype=F64), torch.randn(33, dtype=F64)
    mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    torch.testing.assert_close(K.layer_norm(x, w, b, 1e-5), (x - mean) / torch.sqrt(var + 1e-5) * w + b)
    xb = x.to(torch.bfloat16)  # bf16: F.layer_norm on CPU, within a bf16 rounding
    want = F.layer_norm(xb, (33,), w.to(torch.bfloat16), b.to(torch.bfloat16), 1e-5)
    torch.testing.assert_close(K.layer_norm(xb, w.to(torch.bfloat16), b.to(torch.bfloat16)), want,
                               atol=3e-2, rtol=2e-2)


def test_rms_norm_fallback_vs_formula():
    x, w = torch.randn(3, 7, 100, dtype=F64), torch.randn(100, dtype=F64)
    want = x / torch.sqrt((x * x).sum(-1, keepdim=True) / 100 + 1e-6) * w
    torch.testing.assert_close(K.rms_norm(x, w, 1e-6), want)


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_bias_gelu_fallback_vs_formula(approximate):
    x, b = 3 * torch.randn(6, 50, dtype=F64), torch.randn(50, dtype=F64)
    u = x + b
    if approximate == "tanh":
        want = 0.5 * u * (1 + torch.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u**3)))
    else:
        want = 0.5 * u * (1 + torch.erf(u / math.sqrt(2)))
    torch.testing.assert_close(X.bias_gelu(x, b, approximate), want)
    xf, bf = x.float(), b.float()
    torch.testing.assert_close(X.bias_gelu(xf, bf, approximate), F.gelu(xf + bf, approximate=approximate))


def test_rope_fallback_vs_complex_rotation():
    """Pair (x_i, x_{i+d/2}) rotated by angle pos * theta^(-2i/d): a complex multiplication."""
    s, b, h, d = 7, 2, 3, 8
    x = torch.randn(s, b, h, d, dtype=F64)
    pos = torch.arange(s) + 5
    cos, sin = X.rope_cos_sin(pos, d, theta=500.0, dtype=F64)
    angle = pos[:, None].double() * 500.0 ** (-torch.arange(0, d, 2, dtype=F64) / d)  # [s, d/2]
    z = torch.complex(x[..., : d // 2], x[..., d // 2:]) * torch.polar(torch.ones_like(angle), angle)[:, None, None]
    want = torch.cat((z.real, z.imag), dim=-1)
    # rope_cos_sin computes angles in float32, as HF LLaMA does: float32-level agreement
    torch.testing.assert_close(X.apply_rope(x, cos, sin), want, atol=1e-5, rtol=1e-5)
    xb = x.to(torch.bfloat16)  # output keeps x's dtype
    assert X.apply_rope(xb, cos.float(), sin.float()).dtype == torch.bfloat16


def test_fallback_gradients_gradcheck():
    """Autograd through every fallback, checked against finite differences in float64."""
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, dtype=F64, generator=g, requires_grad=True)  # noqa: E731
    slopes = torch.tensor([0.3, 0.1], dtype=F64)
    assert torch.autograd.gradcheck(lambda s: X.scaled_masked_softmax(s, 0.5, slopes), (r(1, 2, 4, 5),))
    assert torch.autograd.gradcheck(lambda x, w, b: K.layer_norm(x, w, b), (r(3, 6), r(6), r(6)))
    assert torch.autograd.gradcheck(lambda x, w: K.rms_norm(x, w), (r(3, 6), r(6)))
    assert torch.autograd.gradcheck(lambda x, b: X.bias_gelu(x, b), (r(3, 6), r(6)))
    cos, sin = X.rope_cos_sin(torch.arange(3), 4, dtype=F64)
    assert torch.autograd.gradcheck(lambda x: X.apply_rope(x, cos, sin), (r(3, 2, 2, 4),))


# ---------------------------------------------------------------- dispatch and report (CPU)

def test_cpu_tensors_use_the_fallback_and_requests_explain(monkeypatch):
    # A normal run, not the test session: no interpreter (the flag itself must stay set, since
    # triton reads it once, when it is imported).
    monkeypatch.setattr(_dispatch, "interpreting", lambda: False)
    x = torch.randn(4, 10)
    torch.testing.assert_close(K.rms_norm(x, torch.ones(10)), K.rms_norm_reference(x, torch.ones(10)))
    with pytest.raises(RuntimeError, match="CUDA tensor|no CUDA C"):
        X.bias_gelu(x, torch.zeros(10), impl="cuda")
    with pytest.raises(ValueError, match="impl must be"):
        K.layer_norm(x, torch.ones(10), None, impl="apex")
    with pytest.raises(RuntimeError, match="triton|TRITON_INTERPRET"):
        K.rms_norm(x, torch.ones(10), impl="triton")


def test_import_compiles_nothing_and_report_runs():
    """A normal run: import megazoo.kernels and a norm on a CPU tensor load no triton (the
    fallback runs); the report prints one row per kernel."""
    code = ("import sys, torch, megazoo.kernels as K; K.rms_norm(torch.ones(2, 8), torch.ones(8)); "
            "assert 'triton' not in sys.modules, 'triton imported'; "
            "from megazoo.kernels.__main__ import main; main(['--device', 'cpu'])")
    out = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    for name in ("layer_norm", "rms_norm", "dataset index helpers"):
        assert name in out.stdout and "torch" in out.stdout, out.stdout


# ---------------------------------------------------------------- Triton kernels (interpreter on CPU)

@pytest.mark.triton
@pytest.mark.parametrize("check,dtype,kwargs", [
    pytest.param(check, dtype, kw, id=f"{case}-{tag}")
    for case, (check, kw) in C.INTERPRETER_CASES.items() for tag, dtype in C.DTYPES.items()])
def test_triton_kernel_matches_fallback(triton_device, check, dtype, kwargs):
    """impl="triton" vs the PyTorch fallback, forward and every gradient (on CPU: Triton's
    interpreter, which conftest.py switches on when no GPU is present)."""
    C.CHECKS[check]("triton", triton_device, dtype, **kwargs)


@pytest.mark.triton
def test_automatic_dispatch_keeps_cpu_tensors_on_pytorch():
    """Even with triton importable and its interpreter on, impl=None runs the fallback for CPU
    tensors: the interpreter is for tests, never picked by itself."""
    x = torch.randn(3, 16)
    assert not K.fused_norm_runs(x)
    choice = _dispatch.automatic(x)
    assert [c.impl for c in choice] == ["torch"], choice


# ---------------------------------------------------------------- GPU: fused vs fallback

GPU_CASES = {
    "softmax-alibi-causal-127": ("softmax", dict(shape=(2, 4, 127, 127))),
    "softmax-causal-1023": ("softmax", dict(shape=(1, 2, 1023, 1023), alibi=False)),
    "softmax-causal-sq<sk-kvcache": ("softmax", dict(shape=(2, 3, 37, 301))),
    "softmax-full-alibi-4096": ("softmax", dict(shape=(1, 2, 64, 4096), causal=False)),
    "layer_norm-1000": ("layer_norm", dict(shape=(4, 127, 1000))),
    "layer_norm-1539": ("layer_norm", dict(shape=(1023, 1539))),
    "layer_norm-4096-fp32weights": ("layer_norm", dict(shape=(2, 333, 4096), weight_dtype=torch.float32)),
    "layer_norm-14336": ("layer_norm", dict(shape=(257, 14336))),
    "rms_norm-1000": ("rms_norm", dict(shape=(4, 127, 1000))),
    "rms_norm-1539": ("rms_norm", dict(shape=(1023, 1539))),
    "rms_norm-8192-fp32weights": ("rms_norm", dict(shape=(129, 8192), weight_dtype=torch.float32)),
    "bias_gelu-tanh-1000": ("bias_gelu", dict(shape=(127, 1000))),
    "bias_gelu-tanh-1539": ("bias_gelu", dict(shape=(3, 341, 1539))),
    "bias_gelu-erf-4096": ("bias_gelu", dict(shape=(1023, 4096), approximate="none")),
    "bias_gelu-erf-1001": ("bias_gelu", dict(shape=(33, 1001), approximate="none")),
    "rope-127x2x8x128": ("rope", dict(s=127, b=2, heads=(8,), d=128)),
    "rope-1023-strided-batchcos": ("rope", dict(s=1023, b=2, heads=(5,), d=64, batch_cos=True,
                                                strided=True)),
    "rope-gqa-heads-d96": ("rope", dict(s=33, b=3, heads=(2, 4), d=96)),
}
_GPU_PARAMS = [pytest.param(check, impl, dtype, kw, id=f"{name}-{impl}-{tag}")
               for name, (check, kw) in GPU_CASES.items()
               for impl in (("triton", "cuda") if check == "bias_gelu" else ("triton",))
               for tag, dtype in C.DTYPES.items()]


@pytest.mark.gpu
@pytest.mark.parametrize("check,impl,dtype,kwargs", _GPU_PARAMS)
def test_gpu_fused_matches_fallback(check, impl, dtype, kwargs):
    C.CHECKS[check](impl, "cuda", dtype, **kwargs)


@pytest.mark.gpu
def test_gpu_auto_dispatch_picks_a_working_fused_kernel():
    """On a GPU every kernel runs fused by default, and nothing in the report failed."""
    from megazoo.kernels.report import format_report

    rows = K.kernel_report("cuda")
    print(format_report(rows))
    for row in rows:
        assert row.impl == "triton", f"{row.kernel} falls back: {row.reason}"
        assert "failed" not in row.triton, f"{row.kernel}: {row.triton}"
