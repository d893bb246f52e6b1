"""Memory-mapped token datasets: ``PREFIX.bin`` (token ids) + ``PREFIX.idx`` (index).

The layout follows Megatron-LM's ``MMIDIDX`` format (version 1), so files interoperate:

``.idx`` (little endian)::

    magic        9 bytes   b"MMIDIDX\\x00\\x00"
    version      uint64    1
    dtype code   uint8     8 = uint16, 4 = int32, 5 = int64
    num_seqs     uint64    number of sequences
    num_docs     uint64    number of document boundaries (= documents + 1)
    sizes        int32     [num_seqs]  tokens per sequence
    pointers     int64     [num_seqs]  byte offset of each sequence in .bin
    doc_idx      int64     [num_docs]  sequence index where each document starts,
                                       ending with num_seqs

``.bin``: the sequences' token ids back to back, in the dtype above. The builder
writes one sequence per document, so sequence ``i`` is document ``i``.
"""

from __future__ import annotations

import json
import os
import re
import struct
import uuid
from pathlib import Path

import numpy as np

from ..leftovers import remove_leftovers
from .provenance import record_path

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES: dict[int, np.dtype] = {8: np.dtype(np.uint16), 4: np.dtype(np.int32),
                                    5: np.dtype(np.int64)}
_HEADER = struct.Struct("<9sQBQQ")
_REBUILD_HINT = "run tools/preprocess_data.py again to rebuild it"


def best_dtype(vocab_size: int) -> np.dtype:
    """Smallest token dtype for a vocabulary: uint16 below 65500 ids, else int32."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def check_data_prefix(path_prefix: str | os.PathLike, must_exist: bool = True) -> None:
    """FileNotFoundError saying what to change: a prefix naming one of the files itself
    ("corpus.bin") is told to drop the suffix; with `must_exist`, PREFIX.idx and PREFIX.bin
    must exist."""
    prefix = str(path_prefix)
    for suffix in (".bin", ".idx"):
        stem = prefix.removesuffix(suffix)
        if stem != prefix and not data_file_paths(prefix)[0].is_file():
            raise FileNotFoundError(f"--data-path {prefix} names a data file; give the prefix "
                                    f"of the pair: drop {suffix} (--data-path {stem})")
    for path in data_file_paths(prefix) if must_exist else ():
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found; create it with "
                                    f"tools/preprocess_data.py --output-prefix {prefix}")


def check_data_path(data_path: list[str], must_exist: bool) -> None:
    """`check_data_prefix` for every prefix of a --data-path (weights and prefixes, or one
    prefix): the run's parsing calls it before the tokenizer checks, since a wrong path is
    the first thing to fix (files must exist only when that tokenizer error would come
    first; else opening them says so)."""
    from .splits import parse_data_prefix

    for _, prefix in parse_data_prefix(data_path):
        check_data_prefix(prefix, must_exist=must_exist)


def data_file_paths(path_prefix: str | os.PathLike) -> tuple[Path, Path]:
    """Return ``(PREFIX.idx, PREFIX.bin)``."""
    prefix = str(path_prefix)
    return Path(prefix + ".idx"), Path(prefix + ".bin")


def _temp_names(path_prefix) -> tuple[str, str]:
    """(regex of this prefix's temp file names with a `pid` group, regex of the names older
    builders used: a uuid alone)."""
    names = "|".join(re.escape(p.name) for p in (*data_file_paths(path_prefix),
                                                  record_path(path_prefix)))
    return rf"(?:{names})\.tmp-(?P<pid>\d+)-[0-9a-f]+", rf"(?:{names})\.tmp-[0-9a-f]{{32}}"


def clean_temp_files(path_prefix) -> tuple[list[str], list[str]]:
    """Remove the temp files a killed builder of `path_prefix` left (its process is gone);
    return (removed, others in the way: of a live builder, or of an older megazoo)."""
    folder = data_file_paths(path_prefix)[1].parent
    ours, legacy = _temp_names(path_prefix)
    removed = remove_leftovers(str(folder), ours)
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        names = []
    others = [str(folder / n) for n in names if re.fullmatch(ours, n) or re.fullmatch(legacy, n)]
    return removed, others


class IndexedDatasetBuilder:
    """Write a dataset document by document; files appear only at :meth:`finalize`.

    Data goes to temporary files next to the target (``PREFIX.bin.tmp-<pid>-<uuid>``),
    renamed into place at the end, so a reader never sees a half-written dataset. As a
    context manager, a clean exit finalizes and an exception removes the temporary files (a
    killed writer's are removed by the next run: `clean_temp_files`). `tokenizer`, a
    `Tokenizer.record()`, is written to ``PREFIX.tokenizer.json`` with the pair (see
    `provenance`); without it, a record left by an earlier build is removed.
    """

    def __init__(self, path_prefix: str | os.PathLike, dtype: np.dtype | type = np.uint16,
                 tokenizer: dict | None = None):
        self.dtype = np.dtype(dtype)
        codes = {known: code for code, known in DTYPE_CODES.items()}
        if self.dtype not in codes:
            raise ValueError(f"token dtype {self.dtype} is not supported; use uint16, int32 or "
                             "int64 (best_dtype(vocab_size) picks one)")
        self._code = codes[self.dtype]
        self._idx_path, self._bin_path = data_file_paths(path_prefix)
        if not self._bin_path.parent.is_dir():
            raise FileNotFoundError(f"output directory {self._bin_path.parent} does not exist; "
                                    "create it first")
        suffix = f".tmp-{os.getpid()}-{uuid.uuid4().hex}"
        self._tmp_bin = self._bin_path.with_name(self._bin_path.name + suffix)
        self._tmp_idx = self._idx_path.with_name(self._idx_path.name + suffix)
        self._record, self._record_path = tokenizer, record_path(path_prefix)
        self._tmp_record = self._record_path.with_name(self._record_path.name + suffix)
        self._bin = open(self._tmp_bin, "wb")
        self._sizes: list[int] = []
        self._limits = (np.iinfo(self.dtype).min, np.iinfo(self.dtype).max)

    def add_document(self, ids) -> None:
        """Append one document (any 1-D sequence of token ids, may be empty)."""
        if self._bin is None:
            raise ValueError("builder already finalized or aborted; make a new one")
        arr = np.asarray(ids)
        if arr.ndim != 1:
            raise ValueError(f"a document must be a 1-D list of token ids, got shape {arr.shape}")
        if arr.size and (arr.min() < self._limits[0] or arr.max() > self._limits[1]):
            raise ValueError(f"token ids span [{arr.min()}, {arr.max()}], outside {self.dtype}; "
                             "build with a wider dtype (best_dtype(vocab_size))")
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes(order="C"))
        self._sizes.append(int(arr.size))

    def finalize(self) -> None:
        """Write the index and move both files into place."""
        if self._bin is None:
            raise ValueError("builder already finalized or aborted")
        self._bin.close()
        self._bin = None
        sizes = np.asarray(self._sizes, dtype=np.int64)
        if sizes.size and sizes.max() > np.iinfo(np.int32).max:
            self.abort()
            raise ValueError("a document longer than 2**31-1 tokens cannot be indexed; split it")
        pointers = np.zeros(sizes.size, dtype=np.int64)
        np.cumsum(sizes[:-1] * self.dtype.itemsize, out=pointers[1:])
        doc_idx = np.arange(sizes.size + 1, dtype=np.int64)
        with open(self._tmp_idx, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, self._code, sizes.size, doc_idx.size))
            f.write(sizes.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(doc_idx.astype("<i8").tobytes())
        if self._record is not None:
            self._tmp_record.write_text(json.dumps({"tokenizer": self._record}, indent=1))
        os.replace(self._tmp_bin, self._bin_path)
        os.replace(self._tmp_idx, self._idx_path)
        if self._record is None:
            self._record_path.unlink(missing_ok=True)
        else:
            os.replace(self._tmp_record, self._record_path)

    def abort(self) -> None:
        """Drop everything written so far (temporary files only), also on a full disk (where
        closing fails to flush what is buffered)."""
        if self._bin is not None:
            try:
                self._bin.close()
            except OSError:
                pass
            self._bin = None
        for path in (self._tmp_bin, self._tmp_idx, self._tmp_record):
            path.unlink(missing_ok=True)

    def __enter__(self) -> "IndexedDatasetBuilder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
            return
        try:
            self.finalize()
        except BaseException:
            self.abort()
            raise


def _read_index(idx_path: Path) -> tuple[np.dtype, np.ndarray, np.ndarray, np.ndarray]:
    """Parse and validate a .idx file; returns (dtype, sizes, pointers, doc_idx)."""
    raw = np.memmap(idx_path, dtype=np.uint8, mode="r") if idx_path.stat().st_size else b""
    if len(raw) < _HEADER.size:
        raise ValueError(f"{idx_path} is truncated ({len(raw)} bytes, header needs "
                         f"{_HEADER.size}); {_REBUILD_HINT}")
    magic, version, code, num_seqs, num_docs = _HEADER.unpack(bytes(raw[:_HEADER.size]))
    if magic != MAGIC:
        raise ValueError(f"{idx_path} is not a megazoo/Megatron index (bad magic bytes); "
                         f"{_REBUILD_HINT}")
    if version != VERSION:
        raise ValueError(f"{idx_path} has index version {version}, this reader knows "
                         f"{VERSION}; {_REBUILD_HINT}")
    if code not in DTYPE_CODES:
        raise ValueError(f"{idx_path} has unknown dtype code {code}; {_REBUILD_HINT}")
    expected = _HEADER.size + 12 * num_seqs + 8 * num_docs
    if len(raw) != expected:
        raise ValueError(f"{idx_path} has {len(raw)} bytes, its header promises {expected} "
                         f"(truncated or corrupt); {_REBUILD_HINT}")
    start = _HEADER.size
    sizes = np.frombuffer(raw, dtype="<i4", count=num_seqs, offset=start)
    pointers = np.frombuffer(raw, dtype="<i8", count=num_seqs, offset=start + 4 * num_seqs)
    doc_idx = np.frombuffer(raw, dtype="<i8", count=num_docs, offset=start + 12 * num_seqs)
    return DTYPE_CODES[code], sizes, pointers, doc_idx


class IndexedDataset:
    """Read-only view of ``PREFIX.bin`` / ``PREFIX.idx`` through ``numpy.memmap``.

    ``ds[i]`` is sequence ``i`` (a NumPy array in the stored dtype, no copy), ``len(ds)``
    the number of sequences, ``ds.sizes`` their lengths (int32) and ``ds.doc_idx`` the
    document boundaries (int64 sequence indices, ``num_documents + 1`` entries).
    """

    def __init__(self, path_prefix: str | os.PathLike):
        self.path_prefix = str(path_prefix)
        idx_path, bin_path = data_file_paths(path_prefix)
        check_data_prefix(path_prefix)
        self.dtype, self.sizes, self._pointers, self.doc_idx = _read_index(idx_path)
        self._check_consistency(bin_path)
        nbytes = bin_path.stat().st_size
        self._data = (np.memmap(bin_path, dtype=self.dtype, mode="r") if nbytes
                      else np.empty(0, dtype=self.dtype))

    def _check_consistency(self, bin_path: Path) -> None:
        """Cross-check the index against itself and the .bin size (vectorised)."""
        sizes, pointers, doc_idx = self.sizes, self._pointers, self.doc_idx
        item = self.dtype.itemsize
        expected_bytes = int(sizes.astype(np.int64).sum()) * item
        actual = bin_path.stat().st_size
        problem = None
        if actual != expected_bytes:
            problem = f"{bin_path} has {actual} bytes, the index expects {expected_bytes}"
        elif sizes.size and (sizes.min() < 0 or pointers[0] != 0 or np.any(
                np.diff(pointers) != sizes[:-1].astype(np.int64) * item)):
            problem = "sizes and pointers of the index disagree"
        elif (doc_idx.size == 0 or doc_idx[0] != 0 or doc_idx[-1] != sizes.size
              or np.any(np.diff(doc_idx) < 0)):
            problem = "document boundaries are not increasing from 0 to the sequence count"
        if problem:
            raise ValueError(f"dataset {self.path_prefix} is corrupt: {problem}; {_REBUILD_HINT}")

    def __len__(self) -> int:
        return int(self.sizes.size)

    @property
    def num_tokens(self) -> int:
        """Total number of tokens."""
        return int(self._data.size)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end if None)."""
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"sequence {idx} out of range for {n} sequences")
        idx = int(idx) % n
        size = int(self.sizes[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"slice [{offset}, {offset + length}) outside sequence {idx} "
                             f"of length {size}")
        start = int(self._pointers[idx]) // self.dtype.itemsize + offset
        return self._data[start:start + length]

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(idx)

    def __repr__(self) -> str:
        return (f"IndexedDataset({self.path_prefix!r}, sequences={len(self)}, "
                f"tokens={self.num_tokens}, dtype={self.dtype})")
