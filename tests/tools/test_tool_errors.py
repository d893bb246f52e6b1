"""The command-line tools' user and environment errors: one line naming the path and what to
do, exit status 2, nothing left behind. preprocess_data.py on a full disk leaves no
PREFIX.bin.tmp-*, and removes (or names) what a killed run left; converters name the flag of
the path an OSError is about; prompts and checkpoint files that are not UTF-8 or not JSON are
named; no command takes abbreviated flags; under torchrun the line is printed once, and is the
root cause of torchrun's failure summary."""
from __future__ import annotations

import argparse
import ast
import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.checkpoints import tiny_model
from megazoo import cli, errors
from megazoo.checkpoint import save_checkpoint
from megazoo.checkpoint.resolve import resolve_checkpoint
from megazoo.convert import cli as convert_cli
from megazoo.data import IndexedDataset, indexed
from megazoo.data.preprocess import main as preprocess
from megazoo.errors import ERROR_FILE_ENV, report_error
from megazoo.generation.cli import main as generate

ROOT = Path(__file__).resolve().parents[2]


def one_line(capsys, code) -> str:
    out, err = capsys.readouterr()
    assert code == 2 and len(err.strip().splitlines()) == 1, (code, err)
    return err.strip()


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "in.txt"
    path.write_text("first line\nsecond line\n" * 50)
    return path


def test_preprocess_on_a_full_disk_leaves_no_temp_files(text, tmp_path, monkeypatch, capsys):
    real_open = open

    def full_disk(path, mode="r", *args, **kwargs):  # temp files land on a full disk
        if ".tmp-" in str(path) and "w" in mode:
            real_open(path, mode).close()
            return real_open("/dev/full", mode, *args, **kwargs)
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(indexed, "open", full_disk, raising=False)
    prefix = tmp_path / "out"
    err = one_line(capsys, preprocess(["--input", str(text), "--output-prefix", str(prefix),
                                       "--tokenizer-type", "ByteLevelTokenizer"]))
    assert err.startswith(f"error: --output-prefix {prefix}: no space left on the disk of ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]


def test_default_corpus_on_a_full_disk_leaves_no_training_text(tmp_path, monkeypatch):
    from megazoo.training import default_corpus

    monkeypatch.setattr(default_corpus, "stdlib_files", lambda mb: [Path(argparse.__file__)])

    def full_disk(self, data, encoding=None):  # half the text written, then ENOSPC
        Path.write_bytes(self, data[: len(data) // 2].encode())
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    monkeypatch.setattr(default_corpus.Path, "write_text", full_disk)
    with pytest.raises(OSError):
        default_corpus.prepare_default_corpus(str(tmp_path), 0.01, 300, log=lambda _: None)
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == []


def test_preprocess_removes_a_killed_runs_temp_files_and_names_others(text, tmp_path, capsys):
    prefix = tmp_path / "out"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()  # a pid now gone
    (tmp_path / f"out.bin.tmp-{dead}-abc123").write_bytes(b"\0" * 64)
    (tmp_path / f"out.idx.tmp-{dead}-abc123").write_bytes(b"\0" * 8)
    legacy = tmp_path / f"out.bin.tmp-{'a' * 32}"
    legacy.write_bytes(b"\0")
    assert preprocess(["--input", str(text), "--output-prefix", str(prefix),
                       "--tokenizer-type", "ByteLevelTokenizer"]) == 0
    out = capsys.readouterr().out
    assert f"removed {tmp_path}/out.bin.tmp-{dead}-abc123, left by an interrupted run" in out
    assert f"warning: {legacy} left by another run of this --output-prefix" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == \
        sorted(["in.txt", "out.bin", "out.idx", "out.tokenizer.json", legacy.name])
    assert len(IndexedDataset(prefix)) == 1


def test_converter_names_the_flag_of_the_path_and_what_to_do(tmp_path, capsys):
    out = tmp_path / "out"

    def action(_):
        raise OSError(errno.EROFS, "Read-only file system", str(out / "model.safetensors"))

    err = one_line(capsys, convert_cli._run(action, None, {"--out": str(out),
                                                           "--load": str(tmp_path / "ck")}))
    assert err == (f"error: --out {out}: {out}/model.safetensors is on a read-only file "
                   f"system: choose a writable --out")

    def refused(_):
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "ck" / "x"))

    err = one_line(capsys, convert_cli._run(refused, None, {"--out": str(out),
                                                            "--load": str(tmp_path / "ck")}))
    assert err.startswith(f"error: --load {tmp_path / 'ck'}: permission denied for ")


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "ck"
    save_checkpoint(tiny_model(), path)
    return path


def test_prompts_that_are_not_utf8_are_named(checkpoint, tmp_path, capsys):
    base = ["--load", str(checkpoint), "--tokenizer", "bytes", "--max-new-tokens", "2"]
    err = one_line(capsys, generate(base + ["--prompt", "ok", "--prompt", "a\udcffb"]))
    assert err.startswith("error: --prompt 2 is not valid UTF-8 text")
    prompts = tmp_path / "p.txt"
    prompts.write_bytes(b"fine\n\xff\xfebad\n")
    err = one_line(capsys, generate(base + ["--prompt-file", str(prompts)]))
    assert err.startswith(f"error: --prompt-file {prompts} is not UTF-8 text (byte 0xff")


@pytest.mark.parametrize("content, says", [(b'{"format": \xff}', "is not UTF-8 text"),
                                           (b'{"format": ', "is not valid JSON (line 1"),
                                           (b"[1, 2]", "holds a JSON list, not an object")])
def test_a_broken_megazoo_json_is_named(checkpoint, capsys, content, says):
    (checkpoint / "megazoo.json").write_bytes(content)
    err = one_line(capsys, generate(["--load", str(checkpoint), "--prompt", "a"]))
    assert err.startswith(f"error: {checkpoint}/megazoo.json {says}")


def test_a_latest_that_is_not_text_is_named(checkpoint, tmp_path):
    save = tmp_path / "save"
    save.mkdir()
    os.rename(checkpoint, save / "iter_0000001")
    (save / "latest").write_bytes(b"\xff\xfe1")
    with pytest.raises(ValueError, match=f"{save}/latest is not UTF-8 text"):
        resolve_checkpoint(save)


def test_no_command_takes_abbreviated_flags(monkeypatch):
    parsers = []
    real = argparse.ArgumentParser.parse_known_args

    def record(self, *args, **kwargs):
        parsers.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", record)
    for name, target in cli.COMMANDS.items():
        with pytest.raises(SystemExit) as exit_info:
            getattr(cli, target.split(":")[1])(["--help"])
        assert exit_info.value.code == 0 and parsers, name
        assert parsers[-1].allow_abbrev is False, name


def test_every_parser_in_the_source_refuses_abbreviations():
    """The benchmarks' and modules' own parsers too (HintingParser turns them off itself)."""
    lenient = []
    for path in sorted([*(ROOT / "megazoo").rglob("*.py"), *(ROOT / "bench").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(
                    node.func, "id", None)) == "ArgumentParser" and not any(
                    k.arg == "allow_abbrev" and getattr(k.value, "value", None) is False
                    for k in node.keywords):
                lenient.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert lenient == []


def test_report_error_prints_on_rank_0_only_and_fills_the_error_file(tmp_path, monkeypatch,
                                                                      capsys):
    error_file = tmp_path / "error.json"
    monkeypatch.setenv(ERROR_FILE_ENV, str(error_file))
    monkeypatch.setenv("RANK", "1")
    waited = []  # rank 1 records its error only after the delay: rank 0's file is the first
    monkeypatch.setattr(errors.time, "sleep", lambda s: waited.append((s, error_file.exists())))
    assert report_error("--save x is on a read-only file system") == 2
    assert waited == [(errors.OTHER_RANK_EXIT_DELAY_S, False)]
    assert capsys.readouterr().err == ""
    record = json.loads(error_file.read_text())["message"]
    assert record["message"] == "error: --save x is on a read-only file system"
    monkeypatch.setenv("RANK", "0")
    assert report_error("bad\n  input", code=1) == 1
    assert capsys.readouterr().err == "error: bad input\n"


def test_under_torchrun_the_line_is_printed_once_and_is_the_root_cause(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                             "2", str(ROOT / "pretrain_gpt.py"), "--train-iter", "3"],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    line = ("pretrain_gpt.py: error: unrecognized argument --train-iter: did you mean "
            "--train-iters? (pretrain_gpt.py --help lists every flag)")
    lines = (result.stdout + result.stderr).splitlines()
    assert result.returncode != 0 and lines.count(line) == 1, result.stderr
    root_cause = result.stderr[result.stderr.index("Root Cause"):]
    assert f"traceback : {line}" in root_cause and "exitcode  : 2" in root_cause
