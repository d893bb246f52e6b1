"""What a run leaves to look at: the --log-json token record, TensorBoard events, an offline
Weights & Biases run, the curves picture next to the checkpoints, log lines without progress
bar redraws when the output is not a terminal, and one line for each missing package."""
import json
import sys

import pytest

from megazoo.config.run import LoggingConfig
from megazoo.training.log_writers import open_writers
from megazoo.training.run import run_training
from helpers.runs import make_data, tiny_argv


def test_run_writes_token_record_tensorboard_wandb_and_curves(tmp_path, monkeypatch, capsys):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    pytest.importorskip("matplotlib")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    data, save, log = make_data(tmp_path), tmp_path / "ck", tmp_path / "log.jsonl"
    run_training(tiny_argv(data, "--train-iters", "3", "--save", str(save), "--progress",
                           "--plot-curves", "--log-json", str(log), "--tensorboard-dir",
                           str(tmp_path / "tb"), "--wandb-project", "megazoo-test",
                           "--wandb-exp-name", "tiny"))
    out, err = capsys.readouterr()
    records = [json.loads(x) for x in log.read_text().splitlines()]
    assert records[0]["tokens_per_step"] == 4 * 32  # global batch x sequence length
    assert [r["iteration"] for r in records if "loss" in r] == [1, 2, 3]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "valid_loss"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3]
    runs = list((save / "wandb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("run-*.wandb"))
    assert (save / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert f"curves: {save / 'curves.png'}" in out
    assert "each logged loss is that one iteration's mean over its 4 x 32 tokens" in out
    assert "(last 3 iterations)" in out
    assert "\r" not in out + err  # captured output is not a terminal: no progress bar


def test_missing_packages_are_one_line_each(monkeypatch, tmp_path):
    for name in ("wandb", "torch.utils.tensorboard"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    said = []
    cfg = LoggingConfig(tensorboard_dir=str(tmp_path / "tb"), wandb_project="p")
    assert open_writers(cfg, None, {}, said.append) == []
    assert said == ['tensorboard is not installed: --tensorboard-dir ignored (pip install '
                    'tensorboard, or pip install -e ".[test]")',
                    'wandb is not installed: --wandb-project ignored (pip install wandb, or '
                    'pip install -e ".[test]")']


def test_curves_without_matplotlib_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    data, save = make_data(tmp_path), tmp_path / "ck"
    run_training(tiny_argv(data, "--train-iters", "1", "--save", str(save), "--plot-curves",
                           "--generate-tokens", "0", "--eval-iters", "0"))
    out = capsys.readouterr().out
    assert f'no {save / "curves.png"}: matplotlib is not installed: pip install -e ".[plot]" (or pip install matplotlib)' in out
    assert not (save / "curves.png").exists() and (save / "latest").exists()
