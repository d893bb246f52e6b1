"""Checkpoints to break: a tiny model to save, byte offsets of a tensor in a safetensors file,
corruption in place, and the converters' refused-command check."""
from __future__ import annotations

import json
import struct

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


def make_nonfinite(ckpt) -> None:
    """inf over two elements of KEY, in a checkpoint without checksums (as written before
    they existed: a checksum recorded by the writer vouches for finite bytes, so the
    finiteness check is what catches this one)."""
    begin, _ = tensor_span(ckpt / FILE, KEY)
    patch_bytes(ckpt / FILE, begin + 8, struct.pack("<ff", float("inf"), float("inf")))
    meta = json.loads((ckpt / "megazoo.json").read_text())
    del meta[hashes.values_key(meta["checksum"])]
    (ckpt / "megazoo.json").write_text(json.dumps(meta))
