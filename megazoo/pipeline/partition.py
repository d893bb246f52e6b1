"""Split transformer layers over pipeline virtual stages.

Virtual stage ``s = chunk * pp + rank`` holds one contiguous range of layers, and the
ranges follow virtual-stage order, so the model is cut as

    stage 0 (rank 0, chunk 0) | stage 1 (rank 1, chunk 0) | ... | stage pp*vpp - 1

Example: 8 layers, pp=2, vpp=2 gives ``[(0, 2), (2, 4), (4, 6), (6, 8)]``: rank 0 holds
layers 0-1 (chunk 0) and 4-5 (chunk 1), rank 1 holds layers 2-3 and 6-7.
"""

from __future__ import annotations

from collections.abc import Sequence

from megazoo.pipeline.schedules import _check_positive

__all__ = ["partition_layers"]


def _explicit_sizes(num_layers: int, stages: int, sizes: Sequence[int]) -> list[int]:
    """Validate an explicit per-stage layer count list and return it as a list."""
    sizes = list(sizes)
    if len(sizes) != stages:
        raise ValueError(
            f"layers_per_stage has {len(sizes)} entries but there are pp*vpp = {stages} "
            f"virtual stages; give one layer count per virtual stage (stage = chunk*pp + rank)"
        )
    bad = [n for n in sizes if isinstance(n, bool) or not isinstance(n, int) or n < 0]
    if bad:
        raise ValueError(f"layers_per_stage entries must be integers >= 0, got {bad}")
    if sum(sizes) != num_layers:
        raise ValueError(
            f"layers_per_stage {sizes} sums to {sum(sizes)} but the model has {num_layers} "
            f"layers; make the counts add up to {num_layers}"
        )
    return sizes


def partition_layers(
    num_layers: int,
    pp: int,
    vpp: int = 1,
    layers_per_stage: Sequence[int] | None = None,
) -> list[tuple[int, int]]:
    """Layer range ``[start, end)`` of every virtual stage, in virtual-stage order.

    Without ``layers_per_stage`` the split is uniform and ``num_layers`` must divide by
    ``pp * vpp``. With it, entry ``s`` is the layer count of virtual stage ``s``
    (``chunk * pp + rank``); the counts must add up to ``num_layers``.
    Rank ``r`` owns ranges ``result[c * pp + r]`` for ``c`` in ``range(vpp)``.
    """
    _check_positive("num_layers", num_layers, "the model needs at least one layer")
    _check_positive("pp (pipeline-parallel size)", pp, "use pp=1 for no pipeline")
    _check_positive("vpp (model chunks per rank)", vpp, "use vpp=1 for one chunk per rank")
    stages = pp * vpp
    if layers_per_stage is not None:
        sizes = _explicit_sizes(num_layers, stages, layers_per_stage)
    elif num_layers % stages:
        options = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
        raise ValueError(
            f"{num_layers} layers cannot be split evenly over pp*vpp = {stages} stages; "
            f"pass an explicit list per stage (layers_per_stage) or change pp*vpp to a "
            f"divisor of {num_layers} ({', '.join(map(str, options))})"
        )
    else:
        sizes = [num_layers // stages] * stages
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds
