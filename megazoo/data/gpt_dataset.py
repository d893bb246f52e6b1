"""GPT pre-training samples over an :class:`IndexedDataset`, Megatron style.

Three index arrays turn a set of documents into fixed-length samples:

1. ``doc_idx``: the documents of every epoch back to back, each epoch shuffled with a
   seeded ``numpy.random.RandomState`` (so documents never repeat inside an epoch);
2. ``sample_idx``: ``(position in doc_idx, token offset)`` where each sample starts
   (:func:`megazoo.data.helpers.build_sample_idx`); a sample is ``seq_length + 1``
   tokens running across document boundaries;
3. ``shuffle_idx``: the order in which samples are served. Samples of the last epoch
   are shuffled separately and come after all others, so a partly used last epoch
   never displaces samples of the complete ones.

The arrays depend only on the documents, their sizes, ``seq_length``, ``seed`` and the
number of samples; they are cached as ``.npy`` files keyed by a hash of those.
"""

from __future__ import annotations

import hashlib
import os
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megazoo.data.helpers import build_sample_idx
from megazoo.data.indexed import IndexedDataset
from megazoo.data.splits import parse_split

_INDEX_FORMAT = "megazoo-gpt-index-v1"
_INDEX_NAMES = ("doc_idx", "sample_idx", "shuffle_idx")


@dataclass
class GPTDatasetConfig:
    """How documents become samples (shared by the train, valid and test splits)."""

    seq_length: int
    """Tokens a model sees per sample; each sample holds ``seq_length + 1`` tokens."""
    seed: int = 1234
    """Seed of the document and sample shuffles (same seed -> same samples)."""
    split: str = "969,30,1"
    """Train/valid/test proportions over documents, e.g. ``"969,30,1"`` or ``"98/2/0"``."""
    cache_dir: str | None = None
    """Where index ``.npy`` files go; ``None`` means next to the data files."""
    use_cache: bool = True
    """Read and write cached index files (False: always rebuild, in memory)."""
    use_cpp: bool | None = None
    """C++ index helpers: None = when available, True = required, False = NumPy."""

    def __post_init__(self) -> None:
        if not isinstance(self.seq_length, int) or self.seq_length < 1:
            raise ValueError(f"seq_length must be a positive integer, got {self.seq_length!r}")
        if not isinstance(self.seed, int) or self.seed < 0 or self.seed >= 2**32 - 1:
            raise ValueError(f"seed must be an integer in [0, 2**32 - 1), got {self.seed!r}")
        parse_split(self.split)  # raises a ValueError saying how to write it


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Fewest epochs whose tokens give at least ``num_samples`` samples."""
    if tokens_per_epoch < 1:
        raise ValueError("the documents hold no tokens; check the split or the data files")
    needed_tokens = num_samples * seq_length + 1
    return max(1, -(-needed_tokens // tokens_per_epoch))


def build_doc_idx(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState
                  ) -> np.ndarray:
    """Documents of ``num_epochs`` epochs, each epoch an independent permutation."""
    out = np.empty(num_epochs * documents.size, dtype=np.int64)
    for epoch in range(num_epochs):
        chunk = out[epoch * documents.size:(epoch + 1) * documents.size]
        chunk[:] = documents
        rng.shuffle(chunk)
    return out


def build_shuffle_idx(num_samples: int, num_first: int, rng: np.random.RandomState
                      ) -> np.ndarray:
    """Permute samples ``[0, num_first)`` and ``[num_first, num_samples)`` separately."""
    first = np.arange(num_first, dtype=np.int64)
    rng.shuffle(first)
    last = np.arange(num_first, num_samples, dtype=np.int64)
    rng.shuffle(last)
    return np.concatenate([first, last])


def _save_atomic(path: Path, array: np.ndarray) -> None:
    """np.save to a unique temporary name in the same directory, then rename into place.

    Several ranks may build the same index at once; each writes its own temporary file
    and the renames are atomic, so readers see a whole file or none.
    """
    tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as f:
            np.save(f, array, allow_pickle=False)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class GPTDataset:
    """Fixed-length samples (int64 arrays of ``seq_length + 1`` tokens) over documents.

    ``documents`` are sequence indices into ``indexed`` (one split's documents).
    ``num_samples`` is how many samples are wanted (None: one epoch's worth); enough
    epochs are stacked to provide them. ``ds[i]`` is the ``i``-th sample in shuffled
    order; ``ds.sample_tokens(k)`` is sample ``k`` in stream order.
    """

    def __init__(self, indexed: IndexedDataset, documents: np.ndarray,
                 num_samples: int | None, config: GPTDatasetConfig, name: str = "train"):
        self.indexed, self.config, self.name = indexed, config, name
        self.documents = np.ascontiguousarray(documents, dtype=np.int64)
        if self.documents.size == 0:
            raise ValueError(f"{name} split has no documents; change --split or add data")
        if self.documents.min() < 0 or self.documents.max() >= len(indexed):
            raise ValueError(f"{name} documents must index into the {len(indexed)} sequences")
        sizes = np.asarray(indexed.sizes, dtype=np.int64)
        self.tokens_per_epoch = int(sizes[self.documents].sum())
        if num_samples is None:
            num_samples = max(0, (self.tokens_per_epoch - 1) // config.seq_length)
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        self.num_samples = int(num_samples)
        self.num_epochs = num_epochs_needed(self.tokens_per_epoch, config.seq_length,
                                            self.num_samples)
        self.doc_idx, self.sample_idx, self.shuffle_idx = self._load_or_build(sizes)

    def cache_paths(self, sizes: np.ndarray) -> dict[str, Path]:
        """Cached ``.npy`` paths of the three index arrays, named by a hash of everything
        they depend on."""
        h = hashlib.sha256(_INDEX_FORMAT.encode())
        h.update(repr((self.config.seq_length, self.config.seed, self.num_samples,
                       self.num_epochs, self.name)).encode())
        h.update(self.documents.tobytes())
        h.update(sizes[self.documents].tobytes())
        prefix = Path(self.indexed.path_prefix)
        folder = Path(self.config.cache_dir) if self.config.cache_dir else prefix.parent
        stem = f"{prefix.name}_{self.name}_{h.hexdigest()[:20]}"
        return {n: folder / f"{stem}_{n}.npy" for n in _INDEX_NAMES}

    def _load_or_build(self, sizes: np.ndarray) -> tuple[np.ndarray, ...]:
        """Read cached index arrays, or build them (and try to cache them)."""
        paths = self.cache_paths(sizes) if self.config.use_cache else {}
        if paths and all(p.is_file() for p in paths.values()):
            try:
                return tuple(np.load(paths[n], mmap_mode="r", allow_pickle=False)
                             for n in _INDEX_NAMES)
            except (OSError, ValueError):
                pass  # unreadable cache: rebuild and overwrite it below
        arrays = self._build(sizes)
        if paths:
            try:
                paths[_INDEX_NAMES[0]].parent.mkdir(parents=True, exist_ok=True)
                for name, array in zip(_INDEX_NAMES, arrays):
                    _save_atomic(paths[name], array)
            except OSError as exc:
                warnings.warn(f"could not cache GPT dataset indices ({exc}); set "
                              "GPTDatasetConfig.cache_dir to a writable directory", stacklevel=3)
        return arrays

    def _build(self, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Build doc_idx, sample_idx and shuffle_idx from the seed."""
        cfg = self.config
        rng = np.random.RandomState(cfg.seed)
        doc_idx = build_doc_idx(self.documents, self.num_epochs, rng)
        sample_idx = build_sample_idx(sizes, doc_idx, cfg.seq_length, self.num_epochs,
                                      self.tokens_per_epoch, use_cpp=cfg.use_cpp)
        total = sample_idx.shape[0] - 1
        first = ((self.num_epochs - 1) * self.tokens_per_epoch - 1) // cfg.seq_length
        first = min(max(first, 0), total) if self.num_epochs > 1 else total
        shuffle_idx = build_shuffle_idx(total, first, np.random.RandomState(cfg.seed + 1))
        return doc_idx, sample_idx, shuffle_idx

    def __len__(self) -> int:
        return self.num_samples

    def sample_tokens(self, k: int) -> np.ndarray:
        """Sample ``k`` in stream (unshuffled) order: ``seq_length + 1`` int64 tokens."""
        (i0, off0), (i1, off1) = self.sample_idx[k:k + 2].tolist()
        get = self.indexed.get
        if i0 == i1:
            return get(int(self.doc_idx[i0]), off0, off1 - off0 + 1).astype(np.int64)
        parts = [get(int(self.doc_idx[i0]), off0)]
        parts += [get(int(d)) for d in self.doc_idx[i0 + 1:i1]]
        parts.append(get(int(self.doc_idx[i1]), 0, off1 + 1))
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples} samples")
        return self.sample_tokens(int(self.shuffle_idx[i]))
