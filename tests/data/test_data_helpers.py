"""C++ index helpers against their NumPy fallbacks: identical arrays on every input.

Zero-length documents are part of the inputs on purpose: preprocess_data.py skips empty
documents, but an IndexedDataset may hold them (builder, other tools), and both backends
must skip them the same way (a sample boundary never points into an empty document,
except row 0 which is always (0, 0)).

Run with ``-s`` to see the printed C++/NumPy timings on a 1M-document corpus.
"""

from __future__ import annotations

import importlib.util
import shutil
import time

import numpy as np
import pytest

from megazoo.data import helpers

# torch.utils.cpp_extension.load needs a C++ compiler and ninja; a prebuilt
# megazoo._data_helpers (setup.py) needs neither.
HAVE_TOOLCHAIN = (
    (shutil.which("c++") or shutil.which("g++")) and shutil.which("ninja")
) or importlib.util.find_spec("megazoo._data_helpers") is not None
needs_cpp = pytest.mark.skipif(not HAVE_TOOLCHAIN, reason="no C++ compiler/ninja and no "
                               "prebuilt megazoo._data_helpers")


@pytest.fixture(scope="module")
def cpp_backend():
    """The compiled module must load wherever a toolchain exists (compiles on first use)."""
    info = helpers.backend(use_cpp=True)
    assert info.impl == "cpp", info
    return info


def _random_corpus(rng: np.random.RandomState):
    """Random sizes (with zero-length docs), epochs and per-epoch permutations."""
    num_docs = rng.randint(1, 60)
    sizes = rng.randint(0, rng.choice([2, 10, 50, 300]), size=num_docs)
    sizes[rng.rand(num_docs) < rng.choice([0.0, 0.2, 0.6])] = 0
    if sizes.sum() == 0:
        sizes[rng.randint(num_docs)] = rng.randint(1, 20)
    documents = np.arange(num_docs)
    if rng.rand() < 0.3:  # a split: a sub-range of the documents
        lo = rng.randint(num_docs)
        documents = documents[lo:] if sizes[lo:].sum() else documents
    num_epochs = rng.randint(1, 5)
    doc_idx = np.concatenate([rng.permutation(documents) for _ in range(num_epochs)])
    tokens_per_epoch = int(sizes[documents].sum())
    seq_length = int(rng.choice([1, 2, 3, rng.randint(1, 40), rng.randint(1, 2000)]))
    return sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch


@needs_cpp
def test_sample_idx_cpp_equals_numpy_on_random_inputs(cpp_backend):
    rng = np.random.RandomState(1234)
    for case in range(400):
        args = _random_corpus(rng)
        cpp = helpers.build_sample_idx(*args, use_cpp=True)
        ref = helpers.build_sample_idx(*args, use_cpp=False)
        assert cpp.dtype == ref.dtype == np.int64 and cpp.shape == ref.shape, case
        np.testing.assert_array_equal(cpp, ref, err_msg=f"case {case}")


@needs_cpp
@pytest.mark.parametrize("sizes,doc_idx,seq,epochs,tpe", [
    ([0, 0, 5, 0], [0, 1, 2, 3], 1, 1, 5),          # leading empty docs
    ([4], [0, 0, 0], 2, 3, 4),                      # one doc, three epochs
    ([3, 4], [0, 1], 100, 1, 7),                    # seq longer than the corpus: 0 samples
    ([3, 0, 4], [0, 1, 2], 6, 1, 7),                # exactly one sample
    ([1, 1, 1, 1], [3, 2, 1, 0], 1, 1, 4),          # one-token docs and samples
    ([5, 0, 0, 5], [0, 1, 2, 3], 5, 1, 10),         # boundary lands before empty docs
    (np.array([7], np.uint16), np.array([0], np.int32), 3, 1, 7),  # narrow input dtypes
])
def test_sample_idx_edge_cases(cpp_backend, sizes, doc_idx, seq, epochs, tpe):
    cpp = helpers.build_sample_idx(sizes, doc_idx, seq, epochs, tpe, use_cpp=True)
    ref = helpers.build_sample_idx(sizes, doc_idx, seq, epochs, tpe, use_cpp=False)
    np.testing.assert_array_equal(cpp, ref)
    assert cpp.shape == ((epochs * tpe - 1) // seq + 1, 2) and tuple(cpp[0]) == (0, 0)


def test_sample_idx_known_answer():
    # stream: doc2 (3 tokens) | doc0 (2) | doc1 (0) | doc3 (4); sample ends at 2, 4, 6, 8
    out = helpers.build_sample_idx([2, 0, 3, 4], [2, 0, 1, 3], 2, 1, 9, use_cpp=False)
    assert out.tolist() == [[0, 0], [0, 2], [1, 1], [3, 1], [3, 3]]


@pytest.mark.parametrize("use_cpp", [False, pytest.param(True, marks=needs_cpp)])
def test_sample_idx_errors_are_the_same(use_cpp):
    cases = [
        (([3], [0], 0, 1, 3), "seq_length"),
        (([3], [0], 2, 0, 3), "num_epochs"),
        (([0], [0], 2, 1, 0), "no tokens"),
        (([3], [1], 2, 1, 3), "outside"),
        (([-1, 5], [0, 1], 2, 1, 4), "non-negative"),
        (([3, 4], [0, 1], 2, 2, 7), "all epochs"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            helpers.build_sample_idx(*args, use_cpp=use_cpp)


@needs_cpp
def test_blending_cpp_equals_python_on_random_inputs(cpp_backend):
    rng = np.random.RandomState(99)
    for case in range(150):
        n = rng.randint(1, 9)
        weights = rng.rand(n) * rng.choice([1e-3, 1.0, 1e6])
        if rng.rand() < 0.3:
            weights[rng.rand(n) < 0.4] = 0.0
        if rng.rand() < 0.2:
            weights[:] = 1.0  # all ties
        if weights.sum() == 0:
            weights[0] = 1.0
        size = int(rng.choice([0, 1, 2, rng.randint(1, 300), rng.randint(1, 5000)]))
        cpp = helpers.build_blending_indices(weights, size, use_cpp=True)
        ref = helpers.build_blending_indices(weights, size, use_cpp=False)
        for a, b in zip(cpp, ref):
            assert a.dtype == b.dtype and a.shape == (size,), case
            np.testing.assert_array_equal(a, b, err_msg=f"case {case}")


def test_backend_selection(monkeypatch):
    assert helpers.backend(use_cpp=False).impl == "numpy"
    monkeypatch.setenv("MEGAZOO_NO_CPP", "1")
    info = helpers.backend()
    assert info.impl == "numpy" and "MEGAZOO_NO_CPP" in str(info)


def test_cpp_required_but_missing_says_why(monkeypatch):
    monkeypatch.setattr(helpers, "_load_compiled", lambda: (None, "no compiler"))
    with pytest.raises(RuntimeError, match="no compiler"):
        helpers.build_blending_indices([1.0], 3, use_cpp=True)
    assert helpers.backend().impl == "numpy"


def _best_time(fn, repeats=3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@needs_cpp
def test_speed_on_a_million_documents(cpp_backend):
    """Prints timings; asserts only that both backends agree on the large input."""
    rng = np.random.RandomState(0)
    num_docs = 1_000_000
    sizes = rng.randint(0, 1000, size=num_docs)
    doc_idx = np.concatenate([rng.permutation(num_docs) for _ in range(2)])
    tokens = int(sizes.sum())
    print(f"\n[data helpers] {cpp_backend}")
    for seq in (2048, 128):
        args = (sizes, doc_idx, seq, 2, tokens)
        assert np.array_equal(helpers.build_sample_idx(*args, use_cpp=True),
                              helpers.build_sample_idx(*args, use_cpp=False))
        t_cpp = _best_time(lambda: helpers.build_sample_idx(*args, use_cpp=True))
        t_np = _best_time(lambda: helpers.build_sample_idx(*args, use_cpp=False))
        print(f"build_sample_idx 1M docs x 2 epochs, seq {seq} ({(2 * tokens - 1) // seq} "
              f"samples): C++ {t_cpp * 1e3:.1f} ms, NumPy {t_np * 1e3:.1f} ms, "
              f"ratio {t_np / t_cpp:.1f}x")
    weights = [0.2, 0.3, 0.5]
    t_cpp = _best_time(lambda: helpers.build_blending_indices(weights, 1_000_000, use_cpp=True))
    t_py = _best_time(lambda: helpers.build_blending_indices(weights, 1_000_000, use_cpp=False),
                      repeats=1)
    print(f"build_blending_indices 1M samples, 3 datasets: C++ {t_cpp * 1e3:.1f} ms, "
          f"Python {t_py * 1e3:.1f} ms, ratio {t_py / t_cpp:.1f}x")
