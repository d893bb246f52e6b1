"""Checkpoints megazoo writes in DeepSpeed's format carry checksums, and every reader
(resuming with --deepspeed, zero_to_megazoo.py) verifies them and the values it loaded:

- a flipped exponent bit in a ZeRO optimizer shard (a finite, wrong master weight) is an
  error naming the file, in the converter (before anything is written) and on resume;
- a checksum entry removed from megazoo.json is an error unless --no-verify-checksums;
- a nan written into a shard, with its checksum made to match, is still refused.
One single-process ZeRO-1 run (gloo, CPU) makes the checkpoint; each test damages a copy.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.distributed as dist

from megazoo.convert.cli import zero_to_megazoo_main
from megazoo.training.run import main

from helpers.checkpoints import reference_digest, refused, snapshot
from helpers.runs import tiny_argv

SHARD = "zero/zero_pp_rank_0_mp_rank_00_optim_states.pt"
DS = ("--deepspeed", "--zero-stage", "1")


@pytest.fixture(scope="module")
def ds_save(data, tmp_path_factory):
    """The checkpoint; afterwards the one-rank process group the runs set up in this
    process is destroyed, so later tests see no world (they read WORLD_SIZE)."""
    save = tmp_path_factory.mktemp("ds") / "ck"
    assert main(tiny_argv(data, *DS, "--save", str(save), "--train-iters", "2",
                          "--eval-interval", "2", "--generate-tokens", "0")) == 0
    yield save
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def ckpt(ds_save, tmp_path):
    path = tmp_path / "ck"
    shutil.copytree(ds_save, path)
    return path


def masters(folder) -> torch.Tensor:
    state = torch.load(folder / SHARD, weights_only=False)
    return state["optimizer_state_dict"]["single_partition_of_fp32_groups"][0].detach()


def resume_error(data, save, capsys, *extra) -> str:
    before = snapshot(save)
    assert main(tiny_argv(data, *DS, "--save", str(save), "--load", str(save),
                          "--train-iters", "3", "--generate-tokens", "0", *extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert snapshot(save) == before
    return err[0]


def test_every_deepspeed_file_has_a_checksum(ckpt):
    meta = json.loads((ckpt / "iter_0000002" / "megazoo.json").read_text())
    files = {str(p.relative_to(ckpt / "iter_0000002"))
             for p in (ckpt / "iter_0000002" / "zero").iterdir()}
    assert set(meta["file_checksums"]) == files and SHARD in files
    for name, value in meta["file_checksums"].items():
        raw = (ckpt / "iter_0000002" / name).read_bytes()
        assert value == reference_digest(raw, meta["checksum"])


def test_flipped_exponent_bit_in_a_zero_shard(data, ckpt, tmp_path, capsys):
    folder = ckpt / "iter_0000002"
    raw = bytearray((folder / SHARD).read_bytes())
    offset = raw.find(masters(folder).numpy().tobytes())  # the fp32 masters, stored raw
    assert offset > 0
    raw[offset + 3] ^= 0x20  # element 0's exponent: finite, and far from its value
    (folder / SHARD).write_bytes(bytes(raw))
    assert torch.isfinite(masters(folder)).all()
    out = tmp_path / "out"
    refused(zero_to_megazoo_main, ["--load", str(ckpt), "--out", str(out)], capsys,
            f"checkpoint file {folder / SHARD} is corrupted")
    assert not out.exists()
    assert f"{folder / SHARD} is corrupted" in resume_error(data, ckpt, capsys)


def test_missing_checksum_entry_is_an_error_unless_told_not_to(data, ckpt, tmp_path, capsys):
    meta_file = ckpt / "iter_0000002" / "megazoo.json"
    meta = json.loads(meta_file.read_text())
    del meta["file_checksums"][SHARD]
    meta_file.write_text(json.dumps(meta))
    argv = ["--load", str(ckpt), "--out", str(tmp_path / "out")]
    refused(zero_to_megazoo_main, argv, capsys, f"records no checksum for {SHARD}")
    assert not (tmp_path / "out").exists()
    assert f"records no checksum for {SHARD}" in resume_error(data, ckpt, capsys)
    assert zero_to_megazoo_main(argv + ["--no-verify-checksums"]) == 0


def test_nan_under_a_matching_checksum_is_refused(data, ckpt, tmp_path, capsys):
    folder = ckpt / "iter_0000002"
    state = torch.load(folder / SHARD, weights_only=False)
    with torch.no_grad():
        state["optimizer_state_dict"]["single_partition_of_fp32_groups"][0][5] = float("nan")
    torch.save(state, folder / SHARD)
    meta = json.loads((folder / "megazoo.json").read_text())
    meta["file_checksums"][SHARD] = reference_digest((folder / SHARD).read_bytes(),
                                                     meta["checksum"])
    (folder / "megazoo.json").write_text(json.dumps(meta))
    refused(zero_to_megazoo_main, ["--load", str(ckpt), "--out", str(tmp_path / "out")],
            capsys, "holds 1 non-finite value")
    assert not (tmp_path / "out").exists()
    assert "holds 1 non-finite value" in resume_error(data, ckpt, capsys)


def test_a_truncated_shard_read_without_checksums_is_one_line(data, ckpt, tmp_path, capsys):
    shard = ckpt / "iter_0000002" / SHARD
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    err = resume_error(data, ckpt, capsys, "--no-verify-checksums")
    assert str(shard) in err and "truncated or damaged" in err
    refused(zero_to_megazoo_main, ["--load", str(ckpt), "--out", str(tmp_path / "out"),
                                   "--no-verify-checksums"], capsys, "truncated or damaged")


def test_generate_on_a_deepspeed_checkpoint_names_the_converter(ckpt, capsys):
    from megazoo.generation.cli import main as generate

    assert generate(["--load", str(ckpt), "--prompt", "a", "--tokenizer", "bytes"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "zero_to_megazoo.py --load" in err[0], err
