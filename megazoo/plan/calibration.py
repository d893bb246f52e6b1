"""Kernel rates for the step-time model, fitted to measurements kept as package fixtures.

`calibration/<gpu>.json` holds what `python -m bench.plan_calibration` measured on one GPU
(bf16 GEMMs over transformer-layer shapes, FP8 GEMMs, causal SDPA attention, a device copy,
fused AdamW; the machine's name and the date are in the file). From it:

- **GEMM curve**: t(m, n, k) = (t0^q + tc^q)^(1/q), tc = 2 m n k / (R u(m) u(n) u(k)),
  u(x) = x / (x + c_x): a peak rate R lowered by each dimension's tile and wave losses,
  smoothly floored at t0 (the shortest kernel). Six numbers, least squares on log time (torch
  L-BFGS, float64), stored in the fixture's "fit" (`python -m megazoo.plan.calibration NAME`
  refits it; a test checks the stored numbers are what the fit gives). FP8: the bf16 curve
  divided by the median FP8 / bf16 speedup at the measured shapes.
- **Attention**: causal SDPA forward + backward t = a + W / r, W = 6 b a s^2 d (the causal
  half of Megatron's 12 b a s^2 d); the forward is the median measured share of it. The
  h100-sxm fixture timed each call alone, so its rows hold the host's time between the
  forward's and the backward's launches: a = 0.37 ms. The tool now issues them back to back,
  which on an H200 gives a = 0.22 ms (bench/results/planner_compute_h200_2026-11-29.md).
- **Elementwise** work runs at the measured copy bandwidth; the optimizer step at the
  measured fused-AdamW seconds per parameter (with 30 B of traffic per parameter, the same
  bandwidth).

Another GPU kind reuses a measured curve scaled to its own datasheet: R and the attention
rate by the ratio of bf16 peaks, copy and AdamW by the ratio of HBM bandwidths. The A100 is
H100's curve scaled that way (312 / 989 TFLOP/s): not fitted to any published run.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

FIXTURES = Path(__file__).with_name("calibration")
H100_PEAK_TFLOPS, H100_HBM_GB_S = 989.4, 3350.0  # H100 SXM5 datasheet (dense bf16)


@dataclass(frozen=True)
class GemmCurve:
    """t(m, n, k) in seconds: see the module docstring."""

    rate: float
    """R, FLOP/s at large shapes."""
    cm: float
    cn: float
    ck: float
    t0: float
    """Shortest GEMM, seconds."""
    q: float
    """Sharpness of the floor."""

    def time(self, m: float, n: float, k: float) -> float:
        if min(m, n, k) <= 0:
            return 0.0
        u = (m / (m + self.cm)) * (n / (n + self.cn)) * (k / (k + self.ck))
        tc = 2.0 * m * n * k / (self.rate * u)
        return (self.t0 ** self.q + tc ** self.q) ** (1.0 / self.q)


def fit_gemm(points: list[dict]) -> GemmCurve:
    """Least squares of log t over the measured (m, n, k, ms) points."""
    import torch

    mnk = torch.tensor([[p["m"], p["n"], p["k"]] for p in points], dtype=torch.float64)
    seconds = torch.tensor([p["ms"] * 1e-3 for p in points], dtype=torch.float64)
    # log of (R in TFLOP/s, cm, cn, ck, t0 in microseconds, q): all of order 1..1000
    theta = torch.tensor([math.log(700.0), math.log(128.0), math.log(128.0), math.log(128.0),
                          math.log(10.0), math.log(3.0)], dtype=torch.float64, requires_grad=True)

    def predict(t):
        rate, cm, cn, ck, t0, q = t.exp()
        m, n, k = mnk.unbind(1)
        u = m / (m + cm) * n / (n + cn) * k / (k + ck)
        tc = 2.0 * mnk.prod(1) / (rate * 1e12 * u)
        return ((t0 * 1e-6) ** q + tc ** q) ** (1.0 / q)

    opt = torch.optim.LBFGS([theta], lr=0.5, max_iter=500, tolerance_grad=1e-12,
                            tolerance_change=1e-14, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = ((predict(theta) / seconds).log() ** 2).mean()
        loss.backward()
        return loss
    opt.step(closure)
    rate, cm, cn, ck, t0, q = theta.detach().exp().tolist()
    return GemmCurve(rate * 1e12, cm, cn, ck, t0 * 1e-6, q)


@dataclass(frozen=True)
class KernelRates:
    """Everything the time model asks of one GPU kind."""

    gpu: str
    """The fixture's machine (and the scaling applied, if any)."""
    gemm: GemmCurve
    fp8_speedup: float
    """FP8 GEMM time = bf16 time / this."""
    attention_rate: float
    """FLOP/s of causal attention forward + backward (6 b a s^2 d of work)."""
    attention_t0: float
    attention_fwd_share: float
    """Forward's share of forward + backward."""
    copy_bytes_s: float
    """Bytes per second (read + write) of a device copy: the elementwise rate."""
    adamw_s_per_param: float

    def attention(self, batch: int, heads: float, seq: int, head_dim: int) -> tuple[float, float]:
        """(forward, backward) seconds of causal attention on this GPU's heads."""
        both = self.attention_t0 + 6.0 * batch * heads * seq * seq * head_dim / self.attention_rate
        return self.attention_fwd_share * both, (1.0 - self.attention_fwd_share) * both

    def scaled(self, peak_tflops: float, hbm_gb_s: float, gpu: str) -> KernelRates:
        """These rates moved to another GPU by its datasheet (module docstring)."""
        flops = peak_tflops / H100_PEAK_TFLOPS
        memory = hbm_gb_s / H100_HBM_GB_S
        return dataclasses.replace(
            self, gpu=f"{gpu} (scaled from {self.gpu})",
            gemm=dataclasses.replace(self.gemm, rate=self.gemm.rate * flops),
            attention_rate=self.attention_rate * flops, copy_bytes_s=self.copy_bytes_s * memory,
            adamw_s_per_param=self.adamw_s_per_param / memory)


def _fit_attention(rows: list[dict]) -> tuple[float, float, float]:
    """(rate, t0, forward share): a line t = t0 + W / r through the measured forward +
    backward times (ordinary least squares), the median forward share."""
    work = [6.0 * r["batch"] * r["heads"] * r["seq"] ** 2 * r["head_dim"] for r in rows]
    secs = [r["fwd_bwd_ms"] * 1e-3 for r in rows]
    slope, intercept = statistics.linear_regression(work, secs)
    t0 = max(0.0, intercept)
    # a forward timed slower than its forward + backward was a first call: not a share
    shares = [r["fwd_ms"] / r["fwd_bwd_ms"] for r in rows if r["fwd_ms"] < r["fwd_bwd_ms"]]
    return 1.0 / slope, t0, statistics.median(shares)


def fp8_speedup(data: dict, curve: GemmCurve) -> float:
    """Median of bf16 curve time / measured FP8 time (1.0 without FP8 measurements)."""
    ratios = [curve.time(p["m"], p["n"], p["k"]) / (p["ms"] * 1e-3) for p in data["gemm_fp8"]]
    return statistics.median(ratios) if ratios else 1.0


def load_fixture(name: str) -> dict:
    """The measurements `calibration/<name>.json` (ValueError naming the choices)."""
    path = FIXTURES / f"{name}.json"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in FIXTURES.glob("*.json")))
        raise ValueError(f"no calibration {name!r}; measured: {known}")
    return json.loads(path.read_text())


def refit(name: str) -> GemmCurve:
    """Fit the fixture's GEMM curve and store it in the fixture (its "fit" entry)."""
    data = load_fixture(name)
    curve = fit_gemm(data["gemm_bf16"])
    data["fit"] = dataclasses.asdict(curve)
    (FIXTURES / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
    return curve


@functools.lru_cache(maxsize=None)
def kernel_rates(name: str = "h100-sxm") -> KernelRates:
    """The rates of the fixture `name`: its stored GEMM fit (fitted now if it has none)."""
    data = load_fixture(name)
    curve = GemmCurve(**data["fit"]) if "fit" in data else fit_gemm(data["gemm_bf16"])
    rate, t0, share = _fit_attention(data["attention"])
    return KernelRates(data["device"], curve, fp8_speedup(data, curve), rate, t0, share,
                       data["copy_gb_s"] * 1e9, data["adamw_s_per_param"])


if __name__ == "__main__":
    import sys

    for fixture in sys.argv[1:] or ["h100-sxm"]:
        print(fixture, refit(fixture))
