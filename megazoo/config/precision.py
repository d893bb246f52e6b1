"""`FP8Recipe`: how a linear layer's GEMMs run in FP8 (the layers' `fp8.py` runs them).

A recipe is configuration: `ModelConfig.fp8(layer)` returns one from the run's
`--fp8-format` / `--fp8-recipe` / `--fp8-layers`, and a `ColumnParallelLinear(fp8=...)` takes
one. The format decides the dtypes (e4m3 forward; e4m3 or e5m2 gradients), the recipe the
scaling granularity, `cast` which kernel computes amax / scale / cast on CUDA.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.fp8_cast import CAST_IMPLS

FORMATS = ("e4m3", "hybrid")
RECIPES = ("tensorwise", "rowwise")


@dataclass(frozen=True)
class FP8Recipe:
    """How a linear layer's GEMMs run in FP8 (dynamic scaling: scales from this step's amax)."""

    format: str = "hybrid"
    """"e4m3": every operand e4m3; "hybrid": e4m3 forward, e5m2 output gradients."""
    recipe: str = "tensorwise"
    """"tensorwise": one scale per tensor; "rowwise": one per row (per column of `b`)."""
    cast: str = "auto"
    """amax + scale + cast implementation on CUDA: auto | triton | compile | eager."""
    fast_accum: bool = True
    """Forward GEMM with `_scaled_mm`'s faster, less exact accumulation (gradients never)."""
    fallback: bool = True
    """A GEMM with a dimension not a multiple of 16 runs in the run's dtype instead of raising."""
    emulate: bool = False
    """Compute the GEMMs with the float32 emulation even on a GPU (the kernels' reference)."""
    fwd_dtype = torch.float8_e4m3fn  # every format's forward operands (not a field)

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"FP8 format must be one of {FORMATS} (hybrid: e4m3 forward, "
                             f"e5m2 gradients), got {self.format!r}")
        if self.recipe not in RECIPES:
            raise ValueError(f"FP8 recipe must be one of {RECIPES}, got {self.recipe!r}")
        if self.cast not in CAST_IMPLS:
            raise ValueError(f"FP8 cast must be one of {CAST_IMPLS}, got {self.cast!r}")

    @property
    def grad_dtype(self) -> torch.dtype:
        return torch.float8_e5m2 if self.format == "hybrid" else torch.float8_e4m3fn

    @property
    def rowwise(self) -> bool:
        return self.recipe == "rowwise"
