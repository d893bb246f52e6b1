"""Checkpoints to break: a tiny model to save, byte offsets of a tensor in a safetensors file,
corruption in place, and the converters' refused-command check."""
from __future__ import annotations

import json
import os
import struct
import zlib

from megazoo.checkpoint import checksums as hashes
from megazoo.models import ModelConfig, build_model

FILE = "model-pp000-tp000.safetensors"
KEY = "layers.1.mlp.fc1.weight"


def tiny_model(seed: int = 0):
    """A 2-layer GPT, h = 32, vocabulary 96, on CPU."""
    cfg = ModelConfig(family="gpt", num_layers=2, hidden_size=32, num_attention_heads=4,
                      vocab_size=96, max_position_embeddings=16)
    return build_model(cfg, None, device="cpu", seed=seed)


def refused(main, argv, capsys, message: str) -> str:
    """`main(argv)` exits 2 with one stderr line containing `message`; returns the line."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    return err


def tensor_span(file, key: str) -> tuple[int, int]:
    """[begin, end) byte offsets of `key`'s data in a safetensors file."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    begin, end = header[key]["data_offsets"]
    return 8 + n + begin, 8 + n + end


def patch_bytes(file, offset: int, data: bytes) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        f.write(data)


def reference_digest(raw: bytes, algorithm: str) -> str:
    """The checksum computed here from the library's own primitives, not megazoo's."""
    if algorithm == "crc32":
        return f"{zlib.crc32(raw):08x}"
    import xxhash
    return xxhash.xxh3_64(raw).hexdigest()


def make_nonfinite(ckpt) -> None:
    """inf over two elements of KEY, with the checksum in megazoo.json then made to match
    (computed with the hash library itself): the bytes verify, the values are unusable, and
    the finiteness check must still catch them."""
    begin, end = tensor_span(ckpt / FILE, KEY)
    patch_bytes(ckpt / FILE, begin + 8, struct.pack("<ff", float("inf"), float("inf")))
    meta = json.loads((ckpt / "megazoo.json").read_text())
    raw = (ckpt / FILE).read_bytes()[begin:end]
    meta[hashes.values_key(meta["checksum"])][FILE][KEY] = reference_digest(raw, meta["checksum"])
    (ckpt / "megazoo.json").write_text(json.dumps(meta))


def snapshot(folder) -> dict[str, bytes]:
    """Every file under `folder` with its bytes (what must survive a refused write)."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = f.read()
    return out
