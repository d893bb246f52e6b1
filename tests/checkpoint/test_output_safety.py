"""Writers never delete what is not theirs: every converter and `save_checkpoint` into an
existing folder, the `--overwrite` rule, stale temp folders, unwritable outputs.

Each converter runs through its command-line entry point (what a user types), and each case
asserts the exit code, the one-line message, and that every file of the user is still there.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megazoo.checkpoint import CheckpointReader, save_checkpoint
from megazoo.checkpoint.output import OWNER_FILE, temp_dir
from megazoo.convert import megazoo_to_hf
from megazoo.convert.cli import (hf_to_megazoo_main, megazoo_to_hf_main, reshard_main,
                                 zero_to_megazoo_main)

from helpers.checkpoints import refused, snapshot, tiny_model


@pytest.fixture
def training_folder(tmp_path):
    """A --save folder as training leaves it: two iterations and `latest`."""
    save = tmp_path / "SAVE"
    for it in (10, 20):
        save_checkpoint(tiny_model(it), save / f"iter_{it:07d}")
    (save / "latest").write_text("20\n")
    return save


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_reshard_into_the_training_folder_it_reads_deletes_nothing(training_folder, capsys,
                                                                   overwrite):
    before = snapshot(training_folder)
    refused(reshard_main, ["--load", str(training_folder / "iter_0000010"),
                           "--out", str(training_folder), "--tp", "2", *overwrite],
            capsys, "is or contains the input")
    assert snapshot(training_folder) == before


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_hf_to_megazoo_onto_its_source_deletes_nothing(tmp_path, capsys, overwrite):
    save_checkpoint(tiny_model(), tmp_path / "mz")
    megazoo_to_hf(tmp_path / "mz", tmp_path / "D")
    before = snapshot(tmp_path / "D")
    refused(hf_to_megazoo_main, ["--hf-dir", str(tmp_path / "D"), "--out", str(tmp_path / "D"),
                                 *overwrite], capsys, "is or contains the input")
    assert snapshot(tmp_path / "D") == before


def test_megazoo_to_hf_keeps_a_tokenizer_and_readme(tmp_path, capsys):
    save_checkpoint(tiny_model(), tmp_path / "mz")
    out = tmp_path / "D"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")
    (out / "README.md").write_text("mine")
    argv = ["--load", str(tmp_path / "mz"), "--out", str(out)]
    refused(megazoo_to_hf_main, argv, capsys, "exists and is not empty; choose another --out "
                                              "or pass --overwrite")
    refused(megazoo_to_hf_main, argv + ["--overwrite"], capsys, "is not one, so it is kept")
    (out / "config.json").write_text("{}")  # now an HF folder, with files HF does not write
    refused(megazoo_to_hf_main, argv + ["--overwrite"], capsys,
            "would delete README.md, tokenizer.json")
    assert sorted(os.listdir(out)) == ["README.md", "config.json", "tokenizer.json"]
    assert (out / "README.md").read_text() == "mine"


def test_zero_to_megazoo_keeps_an_existing_folder(tmp_path, capsys):
    out = tmp_path / "D"
    out.mkdir()
    (out / "keep.txt").write_text("keep")
    refused(zero_to_megazoo_main, ["--load", str(tmp_path / "ds"), "--out", str(out)], capsys,
            "exists and is not empty")
    refused(zero_to_megazoo_main, ["--load", str(tmp_path / "ds"), "--out", str(out),
                                   "--overwrite"], capsys, "is not one, so it is kept")
    assert (out / "keep.txt").read_text() == "keep"


def test_overwrite_replaces_only_a_pure_checkpoint_of_the_same_kind(tmp_path, capsys):
    save_checkpoint(tiny_model(0), tmp_path / "a")
    save_checkpoint(tiny_model(1), tmp_path / "b")
    argv = ["--load", str(tmp_path / "a"), "--out", str(tmp_path / "b"), "--tp", "2"]
    refused(reshard_main, argv, capsys, "exists and is not empty")
    assert reshard_main(argv + ["--overwrite"]) == 0
    assert CheckpointReader(tmp_path / "b").layout["tp"] == 2
    assert sorted(os.listdir(tmp_path)) == ["a", "b"]  # no temp or old folder left


def test_save_checkpoint_follows_the_same_rule(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="exists and is not empty"):
        save_checkpoint(tiny_model(), folder)
    with pytest.raises(ValueError, match="is not one, so it is kept"):
        save_checkpoint(tiny_model(), folder, overwrite=True)
    assert os.listdir(folder) == ["notes.txt"]
    save_checkpoint(tiny_model(0), tmp_path / "c")
    save_checkpoint(tiny_model(1), tmp_path / "c", overwrite=True)
    assert CheckpointReader(tmp_path / "c").metadata["format"] == "megazoo-checkpoint-1"


def _leave_temp(path, pid: int | None) -> str:
    tmp = temp_dir(str(path))
    os.makedirs(tmp)
    with open(os.path.join(tmp, "model-pp000-tp000.safetensors"), "wb") as f:
        f.write(b"partial")
    if pid is not None:
        with open(os.path.join(tmp, OWNER_FILE), "w") as f:
            json.dump({"host": os.uname().nodename, "pid": pid}, f)
    return tmp


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temp_of_a_killed_writer_is_cleaned_and_named(tmp_path, capsys):
    tmp = _leave_temp(tmp_path / "c", _dead_pid())
    save_checkpoint(tiny_model(), tmp_path / "c")
    assert not os.path.exists(tmp)
    assert f"removed {tmp}" in capsys.readouterr().err


def test_temp_folder_not_provably_ours_is_named_not_deleted(tmp_path):
    tmp = _leave_temp(tmp_path / "c", None)
    with pytest.raises(ValueError, match="is in the way and was not written by this megazoo"):
        save_checkpoint(tiny_model(), tmp_path / "c")
    assert os.path.exists(os.path.join(tmp, "model-pp000-tp000.safetensors"))
    live = _leave_temp(tmp_path / "d", os.getppid())  # a process that is still running
    with pytest.raises(ValueError, match=f"is being written by process {os.getppid()}"):
        save_checkpoint(tiny_model(), tmp_path / "d")
    assert os.path.isdir(live)


def test_unwritable_out_names_the_output_folder(tmp_path, capsys):
    save_checkpoint(tiny_model(), tmp_path / "mz")
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "sub"
    err = refused(reshard_main, ["--load", str(tmp_path / "mz"), "--out", str(out)], capsys,
                  f"cannot create the output folder {out}")
    assert ".megazoo-tmp" not in err  # the internal temp folder is not the user's business


@pytest.mark.parametrize("how", ["save-folder", "symlink"])
def test_out_that_the_load_path_resolves_to_is_refused(training_folder, tmp_path, capsys, how):
    """`--load SAVE` means SAVE/iter_0000020 (its `latest`): an --out naming that folder, or
    a symlink to it, is the input itself, with or without --overwrite."""
    out = training_folder / "iter_0000020"
    if how == "symlink":
        os.symlink(out, tmp_path / "link")
        out = tmp_path / "link"
    before = snapshot(training_folder)
    for main, extra in ((reshard_main, ["--tp", "2"]), (megazoo_to_hf_main, [])):
        refused(main, ["--load", str(training_folder), "--out", str(out), "--overwrite", *extra],
                capsys, "is or contains the input")
    assert snapshot(training_folder) == before


def test_overwrite_onto_a_link_is_refused_and_leaves_no_old_link(tmp_path, capsys):
    save_checkpoint(tiny_model(0), tmp_path / "a")
    save_checkpoint(tiny_model(1), tmp_path / "b")
    (tmp_path / "link").symlink_to(tmp_path / "b")
    before = snapshot(tmp_path / "b")
    argv = ["--load", str(tmp_path / "a"), "--out", str(tmp_path / "link"), "--overwrite"]
    refused(reshard_main, argv, capsys, f"--out {tmp_path / 'link'} is a symbolic link")
    assert snapshot(tmp_path / "b") == before
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "link"]
