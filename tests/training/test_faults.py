"""Fault injection: kill -9 during a save and resume exactly; kill one of two gloo ranks and
see the other end; corrupt a checkpoint (truncate, flip bytes, delete a shard, inf) and get
one clear error line. (Converters into an existing folder: tests/checkpoint/test_output_safety.py.)

Kills hit a chosen point: $MEGAZOO_FAULT="point:iter_0000006" makes the process announce that
point on stderr and sleep there (`megazoo.checkpoint.output.fault_point`), and the test sends
SIGKILL once it reads the announcement. A resumed run repeats the uninterrupted one bit for
bit (same CPU kernels, same order), so losses are compared exactly.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from megazoo.checkpoint import CheckpointReader
from megazoo.checkpoint.output import FAULT_ENV
from megazoo.convert import reshard
from megazoo.training.run import main, run_training

from helpers.checkpoints import FILE, KEY, make_nonfinite, patch_bytes, tensor_span
from helpers.runs import ROOT, tiny_argv


def launch(argv, **env) -> subprocess.Popen:
    """pretrain_gpt.py in a child process (stderr piped, read by `wait_for`)."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **env}
    return subprocess.Popen([sys.executable, str(ROOT / "pretrain_gpt.py"), *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=full_env)


def wait_for(proc: subprocess.Popen, text: str, stream: str = "stderr") -> None:
    """Read the child's lines until one contains `text` (fails if the child exits first)."""
    pipe = getattr(proc, stream)
    seen = []
    for line in pipe:
        seen.append(line)
        if text in line:
            return
    proc.wait()
    pytest.fail(f"child exited ({proc.returncode}) before {text!r}:\n{''.join(seen[-20:])}")


@pytest.mark.slow
@pytest.mark.parametrize("point", ["save-files-written", "before-latest"])
def test_kill_during_save_then_resume_is_exact(data, reference, tmp_path, point):
    losses, ref_save = reference[0]["losses"], reference[1]
    save = tmp_path / "ck"
    proc = launch(tiny_argv(data, "--save", str(save), "--save-interval", "3"),
                  **{FAULT_ENV: f"{point}:iter_0000006"})
    wait_for(proc, f"megazoo fault point {point} reached")
    proc.kill()
    proc.communicate()
    assert (save / "latest").read_text().strip() == "3"  # still the complete checkpoint
    rest = run_training(tiny_argv(data, "--save", str(save), "--load", str(save)))["losses"]
    assert rest == losses[3:]
    assert (save / "latest").read_text().strip() == "6"
    assert sorted(os.listdir(save)) == ["iter_0000003", "iter_0000006", "latest", "metrics.jsonl"]
    ours, ref = CheckpointReader(save / "iter_0000006"), CheckpointReader(ref_save / "iter_0000006")
    assert all(ours.full_tensor(n).equal(ref.full_tensor(n)) for n in ref.names())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_killing_one_of_two_ranks_ends_the_other_within_60_s(data):
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "2"}
    argv = tiny_argv(data, "--train-iters", "100000", "--eval-interval", "100000")
    ranks = [launch(argv, **env, RANK=str(r), LOCAL_RANK=str(r)) for r in range(2)]
    try:
        wait_for(ranks[0], "iteration 2 |", stream="stdout")  # both ranks are training
        ranks[1].kill()
        start = time.monotonic()
        ranks[0].wait(timeout=60)  # raises TimeoutExpired (a hang) otherwise
        assert ranks[0].returncode != 0, "the surviving rank must not report success"
        print(f"surviving rank exited {time.monotonic() - start:.1f} s after its peer was killed")
    finally:
        for proc in ranks:
            proc.kill()
            proc.communicate()


@pytest.fixture
def damaged(reference, tmp_path):
    """A copy of the reference run's iteration-6 checkpoint, to damage."""
    path = tmp_path / "ck"
    shutil.copytree(reference[1] / "iter_0000006", path)
    return path


def eval_error(data, path, capsys, *extra) -> str:
    """The one error line of `--eval-only --load path` (exit 2)."""
    assert main(tiny_argv(data, "--load", str(path), "--eval-only", *extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_truncated_checkpoint_file(data, damaged, capsys):
    with open(damaged / FILE, "r+b") as f:
        f.truncate(os.path.getsize(damaged / FILE) // 2)
    assert f"checkpoint file {damaged / FILE} is damaged or truncated" in \
        eval_error(data, damaged, capsys)


def test_flipped_bytes_then_no_verify_checksums_loads(data, damaged, capsys):
    begin, end = tensor_span(damaged / FILE, KEY)
    for offset in range(begin, end, (end - begin) // 16)[:16]:  # 16 flips, as reported
        patch_bytes(damaged / FILE, offset, b"\x40")
    assert f"{damaged / FILE} is corrupted: tensor '{KEY}' has checksum" in \
        eval_error(data, damaged, capsys)
    assert main(tiny_argv(data, "--load", str(damaged), "--eval-only",
                          "--no-verify-checksums")) == 0


def test_deleted_shard(data, reference, tmp_path, capsys):
    tp2 = tmp_path / "tp2"
    reshard(reference[1] / "iter_0000006", tp2, tp=2)
    (tp2 / "model-pp000-tp001.safetensors").unlink()
    assert f"checkpoint file {tp2}/model-pp000-tp001.safetensors is missing" in \
        eval_error(data, tp2, capsys)


def test_nonfinite_tensor_then_allow_nonfinite_load(data, damaged, capsys):
    make_nonfinite(damaged)
    assert f"{damaged / FILE}: tensor '{KEY}' holds 2 non-finite values" in \
        eval_error(data, damaged, capsys)
    assert main(tiny_argv(data, "--load", str(damaged), "--eval-only",
                          "--allow-nonfinite-load")) == 0


@pytest.mark.parametrize("signum", [2, 15])  # SIGINT (Ctrl-C), SIGTERM
def test_a_signal_saves_the_step_then_resume_is_exact(data, reference, tmp_path, monkeypatch,
                                                       capsys, signum):
    """The signal arrives during step 2 (not a save interval): the step ends, iter_0000002 is
    saved, one line names it; resuming repeats the uninterrupted run bit for bit, and
    metrics.jsonl holds each iteration once."""
    import json
    import signal

    from megazoo.training import loop

    losses, ref_save = reference[0]["losses"], reference[1]
    real = loop.seed_step

    def seed_then_signal(seed, iteration, state):
        real(seed, iteration, state)
        if iteration == 1:  # inside the second step
            signal.raise_signal(signum)

    monkeypatch.setattr(loop, "seed_step", seed_then_signal)
    save = tmp_path / "ck"
    argv = tiny_argv(data, "--save", str(save), "--save-interval", "3")
    assert main(argv) == 128 + signum
    err = capsys.readouterr().err.strip().splitlines()
    name = signal.Signals(signum).name
    assert err == [f"{name} at iteration 2: saved {save / 'iter_0000002'}; resume with "
                   f"--load {save} (same flags)"]
    assert (save / "latest").read_text().strip() == "2"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored
    monkeypatch.setattr(loop, "seed_step", real)
    rest = run_training(argv + ["--load", str(save)])["losses"]
    assert rest == losses[2:]
    ours, ref = CheckpointReader(save / "iter_0000006"), CheckpointReader(ref_save / "iter_0000006")
    assert all(ours.full_tensor(n).equal(ref.full_tensor(n)) for n in ref.names())
    logged = [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]
    iterations = [r["iteration"] for r in logged if "loss" in r]
    assert iterations == [1, 2, 3, 4, 5, 6]


def test_a_signal_without_save_stops_with_one_line(data, monkeypatch, capsys):
    import signal

    from megazoo.training import loop

    real = loop.seed_step
    monkeypatch.setattr(loop, "seed_step", lambda seed, it, state: (
        real(seed, it, state), it == 0 and signal.raise_signal(signal.SIGINT)))
    assert main(tiny_argv(data)) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["SIGINT at iteration 1: stopped; nothing saved (no --save), pass --save DIR "
                   "to keep a checkpoint when interrupted"]


def test_records_a_killed_segment_logged_past_its_checkpoint_appear_once(data, reference,
                                                                         tmp_path):
    """As after kill -9 between logging iteration 6 and saving it: latest names 3, and
    metrics.jsonl holds 4..6 already; the resumed run logs them again, replacing them."""
    import json

    save = tmp_path / "ck"
    shutil.copytree(reference[1], save)
    shutil.rmtree(save / "iter_0000006")
    (save / "latest").write_text("3\n")
    run_training(tiny_argv(data, "--save", str(save), "--save-interval", "3", "--load",
                           str(save)))
    logged = [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in logged if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert [r["iteration"] for r in logged if "valid_loss" in r] == [3, 6]
