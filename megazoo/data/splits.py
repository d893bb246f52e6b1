"""Parsing of ``--split`` and ``--data-path`` (pure functions, no I/O)."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` (or ``"98/2"``) -> three fractions summing to 1 (missing parts 0)."""
    if not isinstance(split, str):
        raise ValueError(f"--split must be a string like '969,30,1', got {split!r}")
    parts = [p.strip() for p in split.replace("/", ",").split(",") if p.strip()]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if not 1 <= len(values) <= 3 or any(not math.isfinite(v) or v < 0 for v in values) \
            or sum(values) <= 0:
        raise ValueError(f"--split {split!r} is not valid; give up to three non-negative "
                         "numbers for train,valid,test such as '969,30,1'")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return [v / total for v in values]


def split_ranges(num_documents: int, split: str) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` document ranges for train, valid and test.

    Boundaries are the rounded cumulative fractions, so the three ranges always tile
    ``[0, num_documents)`` exactly.
    """
    fractions = parse_split(split)
    bounds = [0]
    for cumulative in np.cumsum(fractions)[:2]:
        bounds.append(max(bounds[-1], int(round(cumulative * num_documents))))
    bounds.append(num_documents)
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def parse_data_prefix(data_path: Sequence[str]) -> list[tuple[float, str]]:
    """``["a"]`` or ``["0.3", "a", "0.7", "b"]`` -> ``[(weight, prefix), ...]``."""
    items = list(data_path)
    if len(items) == 1:
        return [(1.0, items[0])]
    if not items or len(items) % 2:
        raise ValueError(f"--data-path {items} must be one prefix, or weight prefix pairs "
                         "like '0.3 data/a 0.7 data/b'")
    pairs = []
    for weight, prefix in zip(items[0::2], items[1::2]):
        try:
            value = float(weight)
        except ValueError:
            raise ValueError(f"--data-path weight {weight!r} is not a number; write pairs "
                             "like '0.3 data/a 0.7 data/b'") from None
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"--data-path weight {weight!r} must be a non-negative number")
        pairs.append((value, prefix))
    if sum(w for w, _ in pairs) <= 0:
        raise ValueError("--data-path weights are all zero; give at least one positive weight")
    return pairs
