"""Files of a checkpoint: dtype names, a streaming safetensors writer and reader, JSON.

A safetensors file is an 8-byte little-endian header length, a JSON header {key: {"dtype",
"shape", "data_offsets": [begin, end]}} (padded with spaces to a multiple of 8 bytes), then
the raw bytes of each tensor. The shapes and dtypes of a rank file are known from its meta
model before any tensor exists, so `SafetensorsWriter` writes the header first and then each
tensor as it arrives (memory holds one tensor, never the whole file); `read_tensor` reads one
back in pieces. Any safetensors reader opens these files too.

The writer refuses a tensor holding inf or nan and records a checksum of each tensor's bytes
as it writes them (`checksums.py` chooses the hash), which the reader checks as it reads: no
second pass over the data either way. Both checks run on a `BackgroundChecks` thread while the
caller writes (or reads) the next tensor: the hashes and torch release the GIL.
"""
from __future__ import annotations

import json
import math
import struct
from concurrent.futures import ThreadPoolExecutor

import torch

from .checksums import default_algorithm, digest

DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int8: "I8",
          torch.uint8: "U8", torch.bool: "BOOL"}


def dtype_name(dtype: torch.dtype) -> str:
    """"float32" for torch.float32 (the JSON spelling)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """torch.float16 for "float16" / "fp16" / "torch.float16"; ValueError otherwise, also for
    an integer or bool dtype (weights cast to one are zeros and sign bits, not a model)."""
    aliases = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
               "float": "float32"}
    key = aliases.get(name, str(name).removeprefix("torch."))
    dtype = getattr(torch, key, None)
    if not isinstance(dtype, torch.dtype) or dtype not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: use float32, float16 or bfloat16")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype {name!r} is not a floating-point type (model weights cast to "
                         f"it are lost): use float32, float16 or bfloat16")
    return dtype


def tensor_bytes(tensor: torch.Tensor):
    """The raw little-endian bytes of a CPU tensor, as a buffer (no copy when contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data


# Bytes read per call when reading a tensor: each piece is hashed while still in the CPU cache.
READ_CHUNK = 1 << 20
_BY_NAME = {name: dtype for dtype, name in DTYPES.items()}


def read_header(path: str) -> tuple[int, dict[str, tuple]]:
    """(where the data starts, {key: (dtype, shape, begin, end)}) of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    unknown = sorted({v["dtype"] for v in header.values()} - set(_BY_NAME))
    if unknown:
        raise ValueError(f"{path} holds tensors of dtype {unknown}, which megazoo checkpoints "
                         f"do not use ({', '.join(_BY_NAME)})")
    return 8 + n, {k: (_BY_NAME[v["dtype"]], tuple(v["shape"]), *v["data_offsets"])
                   for k, v in header.items()}


def read_tensor(f, start: int, entry: tuple, hasher=None) -> torch.Tensor:
    """One tensor (`entry` from `read_header`) from the open unbuffered file `f`, read into
    its own memory piece by piece; `hasher` (a `checksums.Hasher`) sees each piece as it
    arrives. ValueError if the file ends early."""
    dtype, shape, begin, end = entry
    out = torch.empty(shape, dtype=dtype)
    view, pos = memoryview(tensor_bytes(out)), 0
    f.seek(start + begin)
    while pos < end - begin:
        got = f.readinto(view[pos:pos + min(READ_CHUNK, end - begin - pos)])
        if not got:
            raise ValueError(f"the file ends {end - begin - pos} bytes early")
        if hasher is not None:
            hasher.update(view[pos:pos + got])
        pos += got
    return out


def nonfinite_count(tensor: torch.Tensor) -> int:
    """How many elements are inf or nan (0 for integer tensors). A sum is non-finite when any
    element is, and much faster than `isfinite(t).all()`; the exact count runs only then."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return 0
    wide = torch.float64 if tensor.dtype == torch.float64 else torch.float32
    if torch.isfinite(tensor.sum(dtype=wide)):
        return 0
    return int((~torch.isfinite(tensor)).sum())


class NonFiniteError(ValueError):
    """A tensor holds inf or nan where only finite values may be."""


def check_finite(key: str, tensor: torch.Tensor) -> None:
    """NonFiniteError naming `key` if the tensor holds inf or nan."""
    bad = nonfinite_count(tensor)
    if bad:
        raise NonFiniteError(f"tensor {key!r} holds {bad} non-finite value"
                             f"{'s' if bad > 1 else ''} (inf or nan)")


class BackgroundChecks:
    """Run checks one at a time on a worker thread, overlapping the caller's I/O.

    `submit(fn, *args)` first waits for the previous check (raising its error), so at most
    one check is pending and memory holds at most one extra tensor; `close()` waits for the
    last one. An error surfaces at the next submit or at close, naming its own tensor.
    """

    def __init__(self):
        self._pool, self._last = ThreadPoolExecutor(1, thread_name_prefix="megazoo-check"), None

    def submit(self, fn, *args) -> None:
        self.wait()
        self._last = self._pool.submit(fn, *args)

    def wait(self) -> None:
        last, self._last = self._last, None
        if last is not None:
            last.result()

    def close(self, wait: bool = True) -> None:
        try:
            if wait:
                self.wait()
        finally:
            self._pool.shutdown(wait=True)


class SafetensorsWriter:
    """Write one safetensors file tensor by tensor, in the order of `specs`.

        with SafetensorsWriter(file, {"a": (torch.float32, (2, 3))}) as w:
            w.write("a", tensor)    # exactly once per key, in order; cast to the spec dtype
        w.checksums                 # {key: hex checksum of the bytes written}
        w.algorithm                 # its hash ("xxh3_64" or "crc32"; default: the fastest here)

    A tensor with inf or nan raises `NonFiniteError` naming its key (nothing after it is
    written; the caller discards the file).
    """

    def __init__(self, path: str, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                 algorithm: str | None = None):
        self.path, self.specs = path, dict(specs)
        self.algorithm = algorithm or default_algorithm()
        self.checksums: dict[str, str] = {}
        self._checks = BackgroundChecks()
        header, offset = {}, 0
        for key, (dtype, shape) in self.specs.items():
            if dtype not in DTYPES:
                raise ValueError(f"{key}: dtype {dtype} cannot be stored; use float32/16 or bfloat16")
            nbytes = math.prod(shape) * dtype.itemsize
            header[key] = {"dtype": DTYPES[dtype], "shape": list(shape),
                           "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        header["__metadata__"] = {"format": "pt"}
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self._order = iter(self.specs)
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(text)) + text)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        expected = next(self._order, None)
        if key != expected:
            raise ValueError(f"{self.path}: expected tensor {expected!r} next, got {key!r}")
        dtype, shape = self.specs[key]
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"{key}: shape {tuple(tensor.shape)} does not match the planned {tuple(shape)}")
        data = tensor.detach().to(device="cpu", dtype=dtype).contiguous()
        raw = tensor_bytes(data)
        self._checks.submit(self._check, key, data, raw)
        self._file.write(raw)

    def _check(self, key: str, data: torch.Tensor, raw) -> None:
        check_finite(key, data)
        self.checksums[key] = digest(raw, self.algorithm)

    def close(self) -> None:
        missing = list(self._order)
        try:
            self._checks.close()
        finally:
            self._file.close()
        if missing:
            raise ValueError(f"{self.path}: tensors {missing[:3]} were never written")

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._checks.close(wait=False)
            self._file.close()


def write_json(file: str, data: dict) -> None:
    with open(file, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
