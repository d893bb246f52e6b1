"""RMSNorm rounds the same way on every path, so a bf16 result does not depend on whether
Triton imports or the chain is compiled: the kernels' reference, the `RMSNorm` layer (its CPU
path), the Triton kernel (under the interpreter on CPU), and on a GPU the layer, the compiled
chain and the kernel again (Triton's interpreter truncates where compiled Triton rounds to
nearest: see `test_triton_kernel_rounds_once`).

The one function: float32 inside, the weight applied, then one rounding to x's dtype. Each
path is compared with that function computed in float64 and rounded once to bf16. A path
that sums in float32 in another order differs from it only where the exact value sits
within ~1e-7 (relative) of a bf16 rounding boundary: a few elements in 10^5, one rounding
step each. So at most 1 in 1000 elements may differ, by at most one bf16 step (2^-8
relative). Rounding the normalised x to bf16 before the weight (HF LLaMA's order) rounds
twice and changes about a quarter of the elements: that fails here, on any path.
"""
import pytest
import torch

from megazoo import kernels
from megazoo.kernels.fusion import rms_norm as layer_rms_norm
from megazoo.layers.norm import RMSNorm

EPS = 1e-6
BF16_STEP = 2.0 ** -8  # bf16 keeps 8 significant bits: one rounding step, relative
MAX_DIFFERING = 1e-3  # fraction of elements allowed one step off (see the module docstring)


def _inputs(weight_dtype: torch.dtype, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 512, generator=g).to(torch.bfloat16)
    w = (1 + 0.5 * torch.randn(512, generator=g)).to(weight_dtype)
    return x.to(device), w.to(device)


def _rounded_once(x: torch.Tensor, w: torch.Tensor, toward_zero: bool = False) -> torch.Tensor:
    """The float64 RMSNorm rounded once to bf16: to nearest, or toward zero (through float32,
    keeping its upper 16 bits, as Triton's interpreter converts)."""
    x64 = x.double()
    y = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS) * w.double()
    if not toward_zero:
        return y.to(torch.bfloat16)
    bits = y.float().view(torch.int32) & ~0xFFFF
    return bits.view(torch.float32).to(torch.bfloat16)  # exact: the low bits are zero


def _assert_rounded_once(name: str, y: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                         toward_zero: bool = False) -> None:
    want = _rounded_once(x.cpu(), w.cpu(), toward_zero)
    y = y.detach().cpu()
    assert y.dtype == torch.bfloat16, f"{name}: dtype {y.dtype}, not x's bfloat16"
    differ = y != want
    rel = ((y.double() - want.double()).abs() / want.double().abs())[differ]
    assert differ.float().mean() <= MAX_DIFFERING, \
        f"{name}: {int(differ.sum())} of {y.numel()} elements rounded differently"
    assert rel.numel() == 0 or rel.max() <= BF16_STEP, \
        f"{name}: an element {float(rel.max()):.2g} (relative) off, more than one bf16 step"


def _module(w: torch.Tensor) -> RMSNorm:
    norm = RMSNorm(w.numel(), EPS, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        norm.weight.copy_(w)
    return norm


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_cpu_paths_round_once(weight_dtype):
    x, w = _inputs(weight_dtype)
    _assert_rounded_once("rms_norm_reference", kernels.rms_norm_reference(x, w, EPS), x, w)
    _assert_rounded_once("kernels.rms_norm", kernels.rms_norm(x, w, EPS), x, w)
    _assert_rounded_once("RMSNorm layer", _module(w)(x), x, w)


def test_rounding_twice_is_caught():
    """The check itself: HF LLaMA's order (normalised x rounded, then times the weight)."""
    x, w = _inputs(torch.bfloat16)
    xf = x.float()
    twice = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype) * w
    with pytest.raises(AssertionError, match="rounded differently"):
        _assert_rounded_once("rounded twice", twice, x, w)


@pytest.mark.triton
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_triton_kernel_rounds_once(weight_dtype, triton_device):
    """Compiled, Triton rounds float32 to bf16 to nearest; its CPU interpreter converts by
    truncation whatever the rounding mode asked for, so there the one rounding is toward
    zero (an interpreter artefact, not the kernel's: rounding twice still fails)."""
    x, w = _inputs(weight_dtype, triton_device)
    _assert_rounded_once("triton", kernels.rms_norm(x, w, EPS, impl="triton"), x, w,
                         toward_zero=triton_device.type == "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_gpu_paths_round_once(weight_dtype):
    x, w = _inputs(weight_dtype, "cuda")
    _assert_rounded_once("RMSNorm layer (cuda)", _module(w)(x), x, w)
    _assert_rounded_once("compiled", layer_rms_norm(x, w, EPS), x, w)
    _assert_rounded_once("eager reference (cuda)", kernels.rms_norm(x, w, EPS, impl="torch"), x, w)
