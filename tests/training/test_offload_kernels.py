"""The offload's one-pass AdamW kernels against torch's fused AdamW: the host's C kernel
(csrc/host_adamw.c) and the GPU share's Triton kernel (kernels/triton_adamw.py; on CPU
under Triton's interpreter, @pytest.mark.triton).

Tolerance: torch's fused CPU AdamW evaluates the same formula with its own vector code
(its lerp and division order), so the two agree to a few float32 ulps per step, not bit for
bit: rtol 1e-6 / atol 1e-6 after 5 steps on values of order 1. The bf16 parameters written
into `out` must be exactly the kernel's own masters rounded to bf16 (round-to-nearest-even,
torch's cast). The C tests skip only where no C compiler works (the engine then runs
torch's kernel).
"""
import pytest
import torch
from torch.optim.adamw import adamw

from megazoo.kernels import host_adamw as hk
from megazoo.training.backends.cpu_offload import adamw_piece

KERNEL = hk.host_adamw()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason=f"host kernel: {hk.backend().reason}")
PIECES = [(0, 5000, 0.1), (5000, 5003, 0.0), (5003, 10007, 0.1)]  # (start, end, weight decay)
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8)


def _step(kernel, state, grad, pieces, step, **kw):
    """One kernel step over (start, end, weight decay) pieces at AdamW step `step`."""
    lr, beta1, beta2, eps = HYPER.values()
    kernel(state, grad, [adamw_piece(a, b, lr, wd, step, beta1, beta2) for a, b, wd in pieces],
           beta1=beta1, beta2=beta2, eps=eps, **kw)


def _state(n, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    state = {k: torch.randn(n, generator=g).to(device)
             for k in ("master", "exp_avg", "exp_avg_sq")}
    state["exp_avg_sq"].abs_()
    return state


def _against_torch(kernel, grad_dtype, device, divisor, exact_out=True):
    """5 steps of `kernel` and of torch's fused AdamW (on the CPU) from the same state."""
    n = PIECES[-1][1]
    mine, ref = _state(n, device=device), _state(n)
    steps = [torch.zeros(()) for _ in PIECES]
    out = torch.empty(n, dtype=torch.bfloat16, device=device)
    for t in range(1, 6):
        grad = torch.randn(n, generator=torch.Generator().manual_seed(t)).to(grad_dtype)
        _step(kernel, mine, grad.to(device), PIECES, t, out=out, divisor=divisor)
        for (a, b, wd), step in zip(PIECES, steps):
            adamw([ref["master"][a:b]], [grad.float()[a:b]], [ref["exp_avg"][a:b]],
                  [ref["exp_avg_sq"][a:b]], [], [step], fused=True,
                  grad_scale=torch.tensor(2.0), amsgrad=False, weight_decay=wd,
                  maximize=False, **HYPER)
    for k in mine:
        torch.testing.assert_close(mine[k].cpu(), ref[k], rtol=1e-6, atol=1e-6, msg=k)
    if exact_out:
        assert torch.equal(out, mine["master"].to(torch.bfloat16))
    else:  # Triton's CPU interpreter truncates to bf16 (the GPU rounds to nearest even)
        torch.testing.assert_close(out.float(), mine["master"].to(torch.bfloat16).float(),
                                   rtol=2 ** -7, atol=0)
    assert not torch.equal(mine["master"].cpu(), _state(n)["master"])  # it did step


@needs_kernel
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_matches_torch_fused_adamw(grad_dtype):
    _against_torch(KERNEL, grad_dtype, "cpu", 2.0)


@pytest.mark.triton
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_matches_torch_fused_adamw(triton_device, grad_dtype):
    from megazoo.kernels._dispatch import triton_module

    _against_torch(triton_module("adamw").adamw_, grad_dtype, triton_device,
                   torch.tensor(2.0, device=triton_device), exact_out=triton_device.type == "cuda")


@needs_kernel
def test_untouched_outside_pieces_and_nan_stays_nan():
    state, n = _state(16), 16
    before = {k: v.clone() for k, v in state.items()}
    grad = torch.ones(n)
    grad[3] = float("nan")
    out = torch.zeros(n, dtype=torch.bfloat16)
    _step(KERNEL, state, grad, [(2, 8, 0.0)], 1, out=out, divisor=1.0)
    for k in state:
        assert torch.equal(state[k][:2], before[k][:2]) and torch.equal(state[k][8:], before[k][8:])
    assert torch.isnan(state["master"][3]) and torch.isnan(out[3].float())
    assert torch.equal(out[:2], torch.zeros(2, dtype=torch.bfloat16))


@needs_kernel
def test_bad_input_is_refused():
    state = _state(8)
    with pytest.raises(ValueError, match="gradient must be"):
        _step(KERNEL, state, torch.ones(8, dtype=torch.float16), [(0, 8, 0.0)], 1, out=None,
              divisor=1.0)
    with pytest.raises(ValueError, match="out must be"):
        _step(KERNEL, state, torch.ones(8), [(0, 8, 0.0)], 1, out=torch.empty(8), divisor=1.0)


def test_switch_off(monkeypatch):
    monkeypatch.setenv("MEGAZOO_NO_HOST_KERNEL", "1")
    hk._load.cache_clear()
    try:
        assert hk.host_adamw() is None and hk.backend().impl == "torch"
    finally:
        monkeypatch.delenv("MEGAZOO_NO_HOST_KERNEL")
        hk._load.cache_clear()
