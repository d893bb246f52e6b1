"""Messages that name the thing: bad flags, data paths, encodings, a `latest` without its
checkpoint, another run's --save folder, resuming with other data settings, DeepSpeed build
locks, and the leftovers of killed runs cleaned at the next start."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from megazoo.checkpoint import save_checkpoint
from megazoo.checkpoint.output import remove_leftovers
from megazoo.config.flags import parse_args
from megazoo.training.run import parse_run_args
from megazoo.data import IndexedDatasetBuilder
from megazoo.training import ds_ops
from megazoo.checkpoint.resolve import resolve_checkpoint
from megazoo.config.ds_config import read_ds_config
from megazoo.training.default_corpus import LEFTOVERS
from megazoo.training.run_checks import prepare_save_dir, resume_warnings

from helpers.checkpoints import tiny_model
from helpers.run_args import tiny_args

ROOT = Path(__file__).resolve().parents[2]
from megazoo.data import preprocess as preprocess_data  # noqa: E402


def one_line_exit_2(argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and len(err.splitlines()) == 1, err
    return err


def test_unknown_flag_and_preset_suggest_the_nearest(capsys):
    err = one_line_exit_2(["--num-layerz", "3"], capsys)
    assert "unrecognized argument --num-layerz: did you mean --num-layers?" in err
    err = one_line_exit_2(["--model", "gpt-125"], capsys)
    assert "--model 'gpt-125' is not one of its choices: did you mean --model gpt-125m?" in err


def test_deepspeed_config_not_utf8_names_file_and_flag(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_bytes(b'{"train_batch_size": 8, "x": "\xff"}')
    with pytest.raises(ValueError, match=r"--deepspeed_config .*ds.json is not UTF-8 text "
                                         r"\(byte 0xff at offset 30\)"):
        read_ds_config(str(bad))


@pytest.fixture
def prefix(tmp_path):
    with IndexedDatasetBuilder(tmp_path / "corpus", np.uint16) as b:
        b.add_document([1, 2, 3])
    return str(tmp_path / "corpus")


def test_data_path_naming_the_bin_file_says_drop_bin(prefix):
    with pytest.raises(FileNotFoundError, match=f"drop .bin \\(--data-path {prefix}\\)"):
        parse_run_args(["--data-path", prefix + ".bin", "--tokenizer-type", "ByteLevelTokenizer"])


def test_missing_data_path_is_reported_before_the_tokenizer(prefix, tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.idx not found"):
        parse_run_args(["--data-path", str(tmp_path / "nothing")])
    with pytest.raises(ValueError, match="--data-path needs --tokenizer-type"):
        parse_run_args(["--data-path", prefix])


@pytest.mark.parametrize("errors, docs, note", [
    ("strict", None, r"t.txt:2 is not utf-8 text \(byte 0xff at offset 0\): pass --encoding"),
    ("replace", 3, "skipped empty documents 0\n"),
    ("skip", 2, "skipped undecodable documents 1")])
def test_preprocess_non_utf8_input(tmp_path, capsys, errors, docs, note):
    (tmp_path / "t.txt").write_bytes(b"good line\n\xff\xfe bad\nanother\n")
    argv = ["--input", str(tmp_path / "t.txt"), "--split-lines", "--output-prefix",
            str(tmp_path / "out"), "--tokenizer-type", "ByteLevelTokenizer", "--errors", errors]
    assert preprocess_data.main(argv) == (2 if docs is None else 0)
    out = capsys.readouterr()
    assert re.search(note, out.err + out.out), out
    if docs is not None:
        assert f"documents {docs}," in out.out


def test_latest_naming_a_missing_checkpoint_points_at_the_previous(tmp_path):
    save_checkpoint(tiny_model(), tmp_path / "iter_0000010")
    (tmp_path / "latest").write_text("20\n")
    with pytest.raises(FileNotFoundError, match="iter_0000020 is missing; the previous "
                                                f"checkpoint {tmp_path}/iter_0000010 is there"):
        resolve_checkpoint(str(tmp_path))


@pytest.fixture
def other_run(tmp_path):
    """A --save folder of a finished run of tiny_model, seed 1234."""
    save_checkpoint(tiny_model(), tmp_path / "ck" / "iter_0000010",
                    extra={"args": {"training": {"seed": 1234}}})
    (tmp_path / "ck" / "latest").write_text("10\n")
    return tmp_path / "ck"


def test_saving_into_another_runs_folder_is_refused(other_run):
    with pytest.raises(ValueError, match=r"holds another run's checkpoints \(iteration 10: "
                                         r"num_layers 2 \(this run 3\), seed 1234 \(this run 7\)"
                                         r"\): pass --load"):
        prepare_save_dir(tiny_args(other_run, "--num-layers", "3", "--seed", "7"), True, print)
    with pytest.raises(ValueError, match="checkpoints up to iteration 10 of an earlier run: "
                                         ".*or pass --overwrite-checkpoints"):
        prepare_save_dir(tiny_args(other_run), True, print)
    prepare_save_dir(tiny_args(other_run, "--load", str(other_run)), True, print)  # resuming
    lines = []
    prepare_save_dir(tiny_args(other_run, "--seed", "7", "--overwrite-checkpoints"), True,
                     lines.append)
    assert "--overwrite-checkpoints: saving over them" in lines[0]


def test_resuming_with_other_seq_length_or_tokenizer_warns():
    args = parse_args(["--seq-length", "64"])
    extra = {"args": {"data": {"seq_length": 128, "tokenizer_type": "HFTokenizer"}}}
    args.data.tokenizer_type = "ByteLevelTokenizer"
    assert resume_warnings(args, extra) == [
        "the checkpoint was trained with --seq-length 128, this run uses --seq-length 64",
        "the checkpoint was trained with --tokenizer-type HFTokenizer, this run uses "
        "--tokenizer-type ByteLevelTokenizer"]
    assert resume_warnings(args, {"args": {"data": {"seq_length": 64}}}) == []


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


def test_leftovers_of_dead_runs_are_removed_and_nothing_else(tmp_path):
    dead, live = dead_pid(), os.getppid()
    names = [f".latest.tmp{dead}", f".latest.tmp{live}", "latest", "notes.txt",
             f"train_text.{dead}.txt", f"tok.{dead}.model", f"train_text.{live}.txt",
             f"train_text.{dead}.txt.bak"]
    for name in names:
        (tmp_path / name).write_text("x")
    lines = []
    prepare_save_dir(tiny_args(tmp_path, "--load", str(tmp_path)), True, lines.append)
    assert lines == [f"removed {tmp_path}/.latest.tmp{dead}, left by a killed run"]
    removed = remove_leftovers(str(tmp_path), LEFTOVERS)
    assert sorted(removed) == sorted(str(tmp_path / n) for n in
                                     (f"train_text.{dead}.txt", f"tok.{dead}.model"))
    assert sorted(os.listdir(tmp_path)) == sorted(
        [f".latest.tmp{live}", "latest", "notes.txt", f"train_text.{live}.txt",
         f"train_text.{dead}.txt.bak"])


def test_deepspeed_build_lock_stale_or_live(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "cpu_adam" / "lock"
    lock.parent.mkdir()
    lock.write_text("")
    lines = []
    ds_ops.before_build("cpu_adam", lines.append)  # fresh lock, not held: within the grace
    assert lines == [f"waiting for another process building DeepSpeed's cpu_adam op (lock {lock})",
                     f"building DeepSpeed's cpu_adam op, about 2 minutes the first time "
                     f"(cached in {tmp_path}/cpu_adam)"]
    old = time.time() - ds_ops.HOLDER_GRACE_S - 5
    os.utime(lock, (old, old))
    with pytest.raises(ValueError, match=f"{lock} is left by a killed build of DeepSpeed's "
                                         f"cpu_adam op \\(no process holds it\\).*rm {lock}"):
        ds_ops.check_lock("cpu_adam", print)
    with open(lock) as held:  # this process holds it: a build in progress
        assert ds_ops.lock_holders(str(lock)) == [os.getpid()]
        lines.clear()
        ds_ops.check_lock("cpu_adam", lines.append)
        assert lines == [f"waiting for process {os.getpid()} building DeepSpeed's cpu_adam op "
                         f"(lock {lock})"]
        ancient = time.time() - ds_ops.STALE_AFTER_S - 60
        os.utime(lock, (ancient, ancient))
        with pytest.raises(ValueError, match="longer than any build takes"):
            ds_ops.check_lock("cpu_adam", print)
    assert held.closed
    (tmp_path / "cpu_adam" / "cpu_adam.so").write_text("")
    lock.unlink()
    lines.clear()
    ds_ops.before_build("cpu_adam", lines.append)
    assert lines == []  # built, no lock: nothing to say


def test_training_never_builds_shm_comm():
    pytest.importorskip("deepspeed")
    import deepspeed.ops

    ds_ops.prepare_ops({"zero_optimization": {"stage": 1}}, announce=False)
    assert deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] is False
