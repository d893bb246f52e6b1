"""Files of a checkpoint: dtype names, a streaming safetensors writer, JSON.

**Streaming writer.** A safetensors file is an 8-byte little-endian header length, a JSON
header {key: {"dtype", "shape", "data_offsets": [begin, end]}} (padded with spaces to a
multiple of 8 bytes), then the raw little-endian bytes of each tensor. All shapes and dtypes
of a rank file are known from its meta model before any tensor exists, so `SafetensorsWriter`
writes the header first and then each tensor as it arrives: memory holds one tensor, never the
whole file. Files are read back with `safetensors.safe_open` (lazy, memory-mapped).

Where a checkpoint may be written and the temp-folder + rename protocol live in `output.py`.
"""
from __future__ import annotations

import json
import struct

import torch

DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int8: "I8",
          torch.uint8: "U8", torch.bool: "BOOL"}


def dtype_name(dtype: torch.dtype) -> str:
    """"float32" for torch.float32 (the JSON spelling)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """torch.float16 for "float16" / "fp16" / "torch.float16"; ValueError otherwise."""
    aliases = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16",
               "float": "float32"}
    key = aliases.get(name, str(name).removeprefix("torch."))
    dtype = getattr(torch, key, None)
    if not isinstance(dtype, torch.dtype) or dtype not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: use float32, float16 or bfloat16")
    return dtype


class SafetensorsWriter:
    """Write one safetensors file tensor by tensor, in the order of `specs`.

        with SafetensorsWriter(file, {"a": (torch.float32, (2, 3))}) as w:
            w.write("a", tensor)    # exactly once per key, in order; cast to the spec dtype
    """

    def __init__(self, path: str, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]]):
        self.path, self.specs = path, dict(specs)
        header, offset = {}, 0
        for key, (dtype, shape) in self.specs.items():
            if dtype not in DTYPES:
                raise ValueError(f"{key}: dtype {dtype} cannot be stored; use float32/16 or bfloat16")
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
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
        self._file.write(data.reshape(-1).view(torch.uint8).numpy().data)

    def close(self) -> None:
        missing = list(self._order)
        self._file.close()
        if missing:
            raise ValueError(f"{self.path}: tensors {missing[:3]} were never written")

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._file.close()


def write_json(file: str, data: dict) -> None:
    with open(file, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
