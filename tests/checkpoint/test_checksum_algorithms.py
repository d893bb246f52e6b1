"""Which hash a checkpoint records, and that every recorded kind still verifies: xxh3_64
checkpoints, CRC-32 ones (the fallback without xxhash, and every checkpoint written before
xxh3), CRC-32 ones from before megazoo.json named its hash, and the errors when this install
cannot compute the recorded hash."""
from __future__ import annotations

import json

import pytest
import torch

from megazoo.checkpoint import checksums as hashes
from megazoo.checkpoint import load_pretrained, save_checkpoint
from megazoo.checkpoint.save import SUMS_SUFFIX, _gather_checksums

from helpers.checkpoints import FILE, KEY, patch_bytes, tensor_span, tiny_model


def saved(path, monkeypatch, algorithm: str):
    """A tiny checkpoint written with `algorithm` (crc32: as an install without xxhash)."""
    if algorithm == "xxh3_64":
        pytest.importorskip("xxhash")
    with monkeypatch.context() as m:
        if algorithm == "crc32":
            m.setattr(hashes, "xxhash", None)
        save_checkpoint(tiny_model(), path)
    assert json.loads((path / "megazoo.json").read_text())["checksum"] == algorithm
    return path


def edit_metadata(ckpt, **changes) -> None:
    meta = json.loads((ckpt / "megazoo.json").read_text())
    for key, value in changes.items():
        if value is None:
            del meta[key]
        else:
            meta[key] = value
    (ckpt / "megazoo.json").write_text(json.dumps(meta))


def flip(ckpt) -> None:
    begin, _ = tensor_span(ckpt / FILE, KEY)
    patch_bytes(ckpt / FILE, begin + 3, b"\xa5")


def test_the_default_hash_is_xxh3_where_xxhash_is_installed(monkeypatch):
    pytest.importorskip("xxhash")
    assert hashes.default_algorithm() == "xxh3_64"
    monkeypatch.setattr(hashes, "xxhash", None)
    assert hashes.default_algorithm() == "crc32"


def test_xxh3_values_are_where_older_readers_do_not_look(tmp_path, monkeypatch):
    """A megazoo from before xxh3 reads "checksums" as CRC-32: an xxh3 checkpoint keeps its
    values under another key, so such a reader loads it unchecked rather than refusing every
    tensor as corrupted."""
    meta = json.loads((saved(tmp_path / "ck", monkeypatch, "xxh3_64") / "megazoo.json").read_text())
    assert "checksums" not in meta and FILE in meta["checksums_xxh3_64"]


@pytest.mark.parametrize("named", [True, False], ids=["named", "unnamed"])
def test_crc32_checkpoints_verify_where_xxhash_is_installed(tmp_path, monkeypatch, named):
    """Written without xxhash (or before the hash was named: no "checksum" field), read with
    it: the CRC-32 values are checked as CRC-32."""
    ckpt = saved(tmp_path / "ck", monkeypatch, "crc32")
    if not named:
        edit_metadata(ckpt, checksum=None)
    load_pretrained(ckpt)
    flip(ckpt)
    with pytest.raises(ValueError, match=f"{FILE} is corrupted: tensor '{KEY}' has checksum "
                                         r"[0-9a-f]{8}, megazoo.json recorded [0-9a-f]{8};"):
        load_pretrained(ckpt)


@pytest.mark.parametrize("case", ["xxh3 without xxhash", "unknown hash"])
def test_a_hash_this_install_cannot_compute_is_one_clear_error(tmp_path, monkeypatch, case):
    """Refused before any tensor is read, naming what to do; --no-verify-checksums loads."""
    if case == "xxh3 without xxhash":
        ckpt = saved(tmp_path / "ck", monkeypatch, "xxh3_64")
        monkeypatch.setattr(hashes, "xxhash", None)
        message = "records xxh3_64 checksums and the xxhash package is not installed: pip install"
    else:
        ckpt = saved(tmp_path / "ck", monkeypatch, "crc32")
        edit_metadata(ckpt, checksum="sha3")
        message = "records 'sha3' checksums, which this megazoo does not know"
    with pytest.raises(ValueError, match=message):
        load_pretrained(ckpt)
    load_pretrained(ckpt, verify_checksums=False)


def test_xxh3_catches_a_flip_in_the_last_byte(tmp_path, monkeypatch):
    ckpt = saved(tmp_path / "ck", monkeypatch, "xxh3_64")
    _, end = tensor_span(ckpt / FILE, KEY)
    data = (ckpt / FILE).read_bytes()[end - 1]
    patch_bytes(ckpt / FILE, end - 1, bytes([data ^ 1]))
    with pytest.raises(ValueError, match=f"tensor '{KEY}' has checksum [0-9a-f]{{16}}"):
        load_pretrained(ckpt)


def test_ranks_that_hashed_differently_are_refused(tmp_path):
    for name, algorithm in (("a", "crc32"), ("b", "xxh3_64")):
        (tmp_path / (name + SUMS_SUFFIX)).write_text(
            json.dumps({"checksum": algorithm, "checksums": {}}))
    with pytest.raises(RuntimeError, match="different checksums .*install xxhash on every node"):
        _gather_checksums(str(tmp_path), ["a", "b"])


def test_digest_of_an_empty_tensor():
    raw = torch.empty(0).numpy().data
    assert hashes.digest(raw, "crc32") == "00000000"
    with pytest.raises(ValueError, match="unknown checksum algorithm 'md5'"):
        hashes.digest(raw, "md5")


@pytest.mark.parametrize("algorithm", ["xxh3_64", "crc32"])
def test_piecewise_read_equals_safetensors_and_the_one_shot_hash(tmp_path, monkeypatch,
                                                                 algorithm):
    """Tensors of every stored dtype read in 100-byte pieces (odd sizes: the last piece is
    short): the values safetensors reads, and the hash of the pieces equals the digest of
    the whole buffer."""
    from safetensors.torch import load_file

    from megazoo.checkpoint import files

    if algorithm == "xxh3_64":
        pytest.importorskip("xxhash")
    monkeypatch.setattr(files, "READ_CHUNK", 100)
    g = torch.Generator().manual_seed(0)
    tensors = {"f32": torch.randn(7, 33, generator=g), "bf16": torch.randn(301, generator=g).bfloat16(),
               "f16": torch.randn(3, 5, generator=g).half(), "i64": torch.arange(40),
               "empty": torch.empty(0, 4), "scalar": torch.tensor(2.5)}
    file = str(tmp_path / "t.safetensors")
    with files.SafetensorsWriter(file, {k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()},
                                 algorithm) as writer:
        for key, t in tensors.items():
            writer.write(key, t)
    start, entries = files.read_header(file)
    reference = load_file(file)
    with open(file, "rb", buffering=0) as f:
        for key in tensors:
            hasher = hashes.Hasher(algorithm)
            got = files.read_tensor(f, start, entries[key], hasher)
            assert got.dtype == reference[key].dtype and torch.equal(got, reference[key]), key
            assert hasher.hexdigest() == writer.checksums[key], key


def test_a_truncated_file_is_named(tmp_path, monkeypatch):
    ckpt = saved(tmp_path / "ck", monkeypatch, "crc32")
    file = ckpt / FILE
    begin, _ = tensor_span(file, KEY)
    data = file.read_bytes()
    from megazoo.checkpoint import CheckpointReader

    reader = CheckpointReader(ckpt)  # header intact: the cut is found when KEY is read
    file.write_bytes(data[:begin + 10])
    with pytest.raises(ValueError, match=f"{FILE}: cannot read '{KEY}' \\(the file ends "
                                         r"\d+ bytes early\)"):
        reader.full_tensor(KEY)
