"""Checkpoint integrity: checksums recorded at save and verified at load (and in the
converters), no checkpoint written with inf / nan, none loaded with them unless allowed.

Corruptions are made on the bytes of real checkpoints: a flipped byte in one tensor's data
region, inf written over a weight (with the checksum then made to match, so only the
finiteness check can catch it). Checkpoints are written with each hash: xxh3_64 (the default
where xxhash is installed) and crc32 (the fallback, and what older checkpoints hold).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from megazoo.checkpoint import checksums as hashes
from megazoo.checkpoint import (CheckpointReader, load_model_weights, load_pretrained,
                                save_checkpoint, write_checkpoint)
from megazoo.checkpoint.files import NonFiniteError, nonfinite_count
from megazoo.convert.cli import megazoo_to_hf_main, reshard_main
from megazoo.parallel.state import ParallelState
from megazoo.training.checkpoint import save_training_checkpoint

from helpers.checkpoints import (FILE, KEY, make_nonfinite, reference_digest, patch_bytes, refused, tensor_span,
                                 tiny_model)

def without_xxhash(monkeypatch) -> None:
    """As in an install without the xxhash package: CRC-32 is written, xxh3 cannot be read."""
    monkeypatch.setattr(hashes, "xxhash", None)


@pytest.fixture(params=["xxh3_64", "crc32"])
def algorithm(request, monkeypatch):
    if request.param == "xxh3_64":
        pytest.importorskip("xxhash")
    else:
        without_xxhash(monkeypatch)
    return request.param


@pytest.fixture
def ckpt(tmp_path, algorithm):
    model = tiny_model()
    aux = {"exp_avg": {n: torch.full_like(p, 0.5) for n, p in model.named_parameters()}}
    save_checkpoint(model, tmp_path / "ck", aux=aux)
    return tmp_path / "ck"


def test_every_tensor_has_a_checksum_of_its_bytes(ckpt, algorithm):
    meta = json.loads((ckpt / "megazoo.json").read_text())
    sums = meta[hashes.values_key(algorithm)][FILE]
    assert meta["checksum"] == algorithm and len(sums) == 2 * len(meta["params"])
    begin, end = tensor_span(ckpt / FILE, KEY)
    raw = (ckpt / FILE).read_bytes()[begin:end]
    assert sums[KEY] == reference_digest(raw, algorithm)
    assert sorted(os.listdir(ckpt)) == ["megazoo.json", FILE]  # no checksum notes left


def test_flipped_byte_is_an_error_naming_file_and_tensor(ckpt):
    begin, _ = tensor_span(ckpt / FILE, KEY)
    patch_bytes(ckpt / FILE, begin + 5, b"\x5a")
    with pytest.raises(ValueError, match=f"{FILE} is corrupted: tensor '{KEY}' has checksum"):
        load_pretrained(ckpt)
    load_pretrained(ckpt, verify_checksums=False)  # the check is what refused it


def test_flipped_aux_byte_is_caught_when_the_aux_tensor_is_read(ckpt):
    begin, _ = tensor_span(ckpt / FILE, f"exp_avg/{KEY}")
    patch_bytes(ckpt / FILE, begin, b"\x01")
    model = tiny_model()
    load_model_weights(model, ckpt)  # weights only: the aux tensor is never read
    with pytest.raises(ValueError, match=f"tensor 'exp_avg/{KEY}' has checksum"):
        load_model_weights(model, ckpt, aux_prefixes=("exp_avg",))


@pytest.mark.parametrize("edit", ["drop-values", "rename-algorithm-key", "drop-one-entry"])
def test_a_missing_checksum_is_an_error_unless_told_not_to(ckpt, edit):
    """Editing megazoo.json must not switch verification off: no values, the hash's key
    renamed (so the CRC-32 default finds no values), one tensor's entry dropped."""
    meta = json.loads((ckpt / "megazoo.json").read_text())
    algorithm = meta["checksum"]
    if edit == "drop-values":
        del meta[hashes.values_key(algorithm)]
        message = "records no .* checksums under"
    elif edit == "rename-algorithm-key":
        meta["checksum_algorithm"] = meta.pop("checksum")
        message = "records no checksums" if algorithm == "crc32" else "records no checksums \\(no"
    else:
        del meta[hashes.values_key(algorithm)][FILE][KEY]
        message = f"records no checksum for tensor '{KEY}' of {FILE}"
    (ckpt / "megazoo.json").write_text(json.dumps(meta))
    if not (edit == "rename-algorithm-key" and algorithm == "crc32"):  # crc32: still verified
        with pytest.raises(ValueError, match=message + ".*--no-verify-checksums"):
            load_pretrained(ckpt)
    model = load_pretrained(ckpt, verify_checksums=False)
    assert torch.equal(dict(model.named_parameters())[KEY], dict(tiny_model().named_parameters())[KEY])


@pytest.mark.parametrize("files", [[], "x", ["model-pp000-tp001.safetensors"]])
def test_an_edited_file_list_is_one_line(ckpt, tmp_path, capsys, files):
    meta = json.loads((ckpt / "megazoo.json").read_text())
    (ckpt / "megazoo.json").write_text(json.dumps({**meta, "files": files}))
    for verify in ([], ["--no-verify-checksums"]):
        refused(reshard_main, ["--load", str(ckpt), "--out", str(tmp_path / "o"), *verify],
                capsys, "megazoo.json lists the files")
    with pytest.raises(ValueError, match="the file was edited or damaged"):
        load_pretrained(ckpt, verify_checksums=False)


@pytest.mark.parametrize("main", [reshard_main, megazoo_to_hf_main])
def test_converters_verify_checksums_unless_told_not_to(ckpt, tmp_path, capsys, main):
    begin, _ = tensor_span(ckpt / FILE, KEY)
    patch_bytes(ckpt / FILE, begin, b"\xff\xff")
    argv = ["--load", str(ckpt), "--out", str(tmp_path / "out")]
    refused(main, argv, capsys, f"{FILE} is corrupted: tensor '{KEY}'")
    assert not (tmp_path / "out").exists()
    assert main([*argv, "--no-verify-checksums"]) == 0


def test_write_checkpoint_records_checksums_that_verify(ckpt, tmp_path):
    reader = CheckpointReader(ckpt)
    write_checkpoint(reader.config, tmp_path / "tp2", reader.full_tensor, tp=2)
    meta = json.loads((tmp_path / "tp2" / "megazoo.json").read_text())
    assert set(meta[hashes.values_key(meta["checksum"])]) == {"model-pp000-tp000.safetensors",
                                      "model-pp000-tp001.safetensors"}
    load_pretrained(tmp_path / "tp2")


@pytest.mark.parametrize("where", ["weight", "aux"])
def test_nonfinite_tensor_is_never_saved(tmp_path, where):
    model = tiny_model()
    aux = {"exp_avg": {n: torch.zeros_like(p) for n, p in model.named_parameters()}}
    target = dict(model.named_parameters())[KEY] if where == "weight" else aux["exp_avg"][KEY]
    with torch.no_grad():
        target[1, 2], target[0, 0] = float("inf"), float("nan")
    key = KEY if where == "weight" else f"exp_avg/{KEY}"
    with pytest.raises(NonFiniteError, match=f"not saving .*ck: tensor '{key}' holds 2 "
                                             r"non-finite values \(inf or nan\)"):
        save_checkpoint(model, tmp_path / "ck", aux=aux)
    assert os.listdir(tmp_path) == []  # nothing published, temp folder gone


def test_write_checkpoint_refuses_nonfinite(ckpt, tmp_path):
    reader = CheckpointReader(ckpt)

    def full(key):
        t = reader.full_tensor(key)
        return t.fill_(float("-inf")) if key == KEY else t

    with pytest.raises(NonFiniteError, match=f"tensor '{KEY}' holds"):
        write_checkpoint(reader.config, tmp_path / "out", full)
    assert not (tmp_path / "out").exists()


def test_loading_nonfinite_is_an_error_unless_allowed(ckpt):
    make_nonfinite(ckpt)
    with pytest.raises(ValueError, match=f"{FILE}: tensor '{KEY}' holds 2 non-finite values"):
        load_pretrained(ckpt)
    with pytest.raises(ValueError, match=f"{FILE}: tensor '{KEY}' holds 2 non-finite values"):
        load_pretrained(ckpt, verify_checksums=False)
    model = load_pretrained(ckpt, allow_nonfinite=True)
    assert nonfinite_count(dict(model.named_parameters())[KEY].detach()) == 2


class _Engine:
    """The one method save_training_checkpoint needs, saving `model` as training does."""

    def __init__(self, model):
        self.model = model

    def save(self, path, extra):
        save_checkpoint(self.model, path, extra=extra)


def test_latest_never_moves_to_a_nonfinite_checkpoint(tmp_path):
    state, model = ParallelState.single(), tiny_model()
    save_training_checkpoint(_Engine(model), str(tmp_path), 10, {}, state)
    with torch.no_grad():
        dict(model.named_parameters())[KEY][0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match=f"not saving .*iter_0000020: tensor '{KEY}' holds 1 "
                                             "non-finite value .*; latest still names iteration 10$"):
        save_training_checkpoint(_Engine(model), str(tmp_path), 20, {}, state)
    assert (tmp_path / "latest").read_text().strip() == "10"
    assert sorted(os.listdir(tmp_path)) == ["iter_0000010", "latest"]


def test_nonfinite_count_is_exact_where_the_sum_overflows():
    big = torch.full((4,), 3e38)  # finite values whose float32 sum is inf
    assert nonfinite_count(big) == 0
    big[2] = float("nan")
    assert nonfinite_count(big) == 1
    assert nonfinite_count(torch.tensor([1.0, float("-inf")], dtype=torch.bfloat16)) == 1
    assert nonfinite_count(torch.arange(5)) == 0


def _save_with_inf_on_rank_1(root: str) -> str:
    from megazoo.models import ModelConfig, build_model
    from megazoo.parallel import ParallelConfig

    state = ParallelState.initialize(ParallelConfig(tp=2))
    cfg = ModelConfig(family="gpt", num_layers=2, hidden_size=32, num_attention_heads=4,
                      vocab_size=96, max_position_embeddings=16)
    model = build_model(cfg, state, device="cpu", seed=0)
    if state.tp.rank == 1:
        with torch.no_grad():
            dict(model.named_parameters())[KEY][0, 0] = float("inf")
    try:
        save_checkpoint(model, os.path.join(root, "ck"), state=state)
    except NonFiniteError as exc:
        return str(exc)
    return "saved"


def test_nonfinite_on_one_rank_stops_the_save_on_every_rank(tmp_path):
    from megazoo.testing import run_distributed

    rank0, rank1 = run_distributed(_save_with_inf_on_rank_1, 2, str(tmp_path), timeout=120)
    assert "another rank found a tensor holding inf or nan" in rank0
    assert f"tensor '{KEY}' holds 1 non-finite value (inf or nan)" in rank1
    assert os.listdir(tmp_path) == []
