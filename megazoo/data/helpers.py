"""Dataset index helpers: a compiled C++ version with an identical NumPy fallback.

:func:`build_sample_idx` finds where each GPT sample starts in the shuffled document stream
(vectorised NumPy); :func:`build_blending_indices` is Megatron's greedy assignment of blended
samples to datasets (a per-sample loop: slow in Python, fast in C++). Both backends return
bit-identical arrays.

``use_cpp``: ``None`` uses the compiled module when it can be had (not when
``MEGAZOO_NO_CPP=1``), ``True`` requires it (``RuntimeError`` saying why it is missing),
``False`` forces NumPy; `backend()` says which, as the kernels' `Choice` record. The compiled
module is the extension ``megazoo._data_helpers`` when ``setup.py`` built it, else
``csrc/data_helpers.cpp`` compiled on first use into torch's extension cache.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ..kernels._dispatch import Choice

def _load_compiled() -> tuple[ModuleType | None, str]:
    """The compiled module or why not (`kernels.dataset_helpers`, imported here:
    `import megazoo.data` loads no torch)."""
    from ..kernels.dataset_helpers import load_compiled

    return load_compiled()


def _resolve(use_cpp: bool | None) -> tuple[ModuleType | None, Choice]:
    """Return (module or None, info) for a ``use_cpp`` request."""
    from ..kernels.dataset_helpers import choose

    return choose(use_cpp, lambda: _load_compiled())


def backend(use_cpp: bool | None = None) -> Choice:
    """Say which implementation ``use_cpp`` selects (compiling the C++ if needed)."""
    return _resolve(use_cpp)[1]


def __getattr__(name: str):
    """CXX_FLAGS and CPP_SOURCE, the extension's (`kernels.dataset_helpers`), loaded on use."""
    if name in ("CXX_FLAGS", "CPP_SOURCE"):
        from ..kernels import dataset_helpers

        return getattr(dataset_helpers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _check_sample_args(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int,
                       num_epochs: int, tokens_per_epoch: int) -> None:
    """Validate :func:`build_sample_idx` inputs with messages saying what to change."""
    for name, value in (("seq_length", seq_length), ("num_epochs", num_epochs)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if tokens_per_epoch < 1:
        raise ValueError(f"tokens_per_epoch must be >= 1 (the documents hold no tokens), "
                         f"got {tokens_per_epoch}")
    if sizes.ndim != 1 or doc_idx.ndim != 1:
        raise ValueError("sizes and doc_idx must be 1-D arrays")
    if sizes.size and sizes.min() < 0:
        raise ValueError("sizes must be non-negative document lengths")
    if doc_idx.size and (doc_idx.min() < 0 or doc_idx.max() >= sizes.size):
        raise ValueError(f"doc_idx holds ids outside [0, {sizes.size}); "
                         "it must index into sizes")
    total = int(sizes[doc_idx].sum()) if doc_idx.size else 0
    if total < num_epochs * tokens_per_epoch:
        raise ValueError(f"doc_idx holds {total} tokens but num_epochs * tokens_per_epoch = "
                         f"{num_epochs * tokens_per_epoch}; pass the doc_idx of all epochs")


def _sample_idx_numpy(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int,
                      num_samples: int) -> np.ndarray:
    """Vectorised sample index: a searchsorted of sample ends into document ends."""
    lengths = sizes[doc_idx]
    ends = np.cumsum(lengths)
    targets = np.arange(1, num_samples + 1, dtype=np.int64) * seq_length
    rows = np.searchsorted(ends, targets, side="right")
    out = np.zeros((num_samples + 1, 2), dtype=np.int64)
    out[1:, 0] = rows
    out[1:, 1] = targets - (ends[rows] - lengths[rows])
    return out


def build_sample_idx(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int,
                     num_epochs: int, tokens_per_epoch: int, *,
                     use_cpp: bool | None = None) -> np.ndarray:
    """Start of every GPT sample in the document stream, Megatron style.

    ``doc_idx`` lists document ids (indices into ``sizes``) for all ``num_epochs``
    epochs back to back. With ``num_samples = (num_epochs * tokens_per_epoch - 1) //
    seq_length``, returns int64 ``[num_samples + 1, 2]``: row ``k`` is ``(i, offset)``,
    the index into ``doc_idx`` and token offset where sample ``k`` starts; sample ``k``
    is the ``seq_length + 1`` tokens from row ``k`` to row ``k + 1`` inclusive (so
    consecutive samples share one token: the last label of one is the first input of
    the next). Row ``k >= 1`` sits at global position ``k * seq_length``; zero-length
    documents are allowed and never appear in rows ``>= 1`` (row 0 is always ``(0, 0)``).
    """
    sizes = np.ascontiguousarray(sizes, dtype=np.int64)
    doc_idx = np.ascontiguousarray(doc_idx, dtype=np.int64)
    seq_length, num_epochs, tokens_per_epoch = int(seq_length), int(num_epochs), int(tokens_per_epoch)
    _check_sample_args(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
    module, _ = _resolve(use_cpp)
    if module is not None:
        return module.build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    return _sample_idx_numpy(sizes, doc_idx, seq_length, num_samples)


def _blending_python(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-sample greedy loop on Python floats (IEEE doubles, same rounding as C++)."""
    counts, chosen, taken = [0] * len(weights), [0] * size, [0] * size
    for t in range(size):
        td = float(t) if t > 0 else 1.0
        best, best_err = 0, weights[0] * td - counts[0]
        for i in range(1, len(weights)):
            err = weights[i] * td - counts[i]
            if err > best_err:
                best, best_err = i, err
        chosen[t] = best
        taken[t] = counts[best]
        counts[best] += 1
    return np.array(chosen, dtype=np.int32), np.array(taken, dtype=np.int64)


def build_blending_indices(weights: np.ndarray | list[float], size: int, *,
                           use_cpp: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Assign ``size`` blended samples to datasets in proportion to ``weights``.

    Weights are normalised to sum to 1. Sample ``t`` goes to the dataset ``i`` with the
    largest error ``w_i * max(t, 1) - count_i`` (ties: lowest ``i``), Megatron's greedy
    rule, which keeps every prefix within one sample of its target share. Returns
    ``(dataset_index int32 [size], dataset_sample_index int64 [size])``: sample ``t`` is
    sample ``dataset_sample_index[t]`` of dataset ``dataset_index[t]``.
    """
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    if w.size == 0:
        raise ValueError("weights is empty; pass one weight per dataset")
    if not np.all(np.isfinite(w)) or w.min() < 0 or w.sum() <= 0:
        raise ValueError(f"weights must be finite, non-negative and not all zero, got {w.tolist()}")
    if int(size) < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    w = np.ascontiguousarray(w / w.sum())
    module, _ = _resolve(use_cpp)
    if module is not None:
        return tuple(module.build_blending_indices(w, int(size)))
    return _blending_python(w.tolist(), int(size))
