"""`python -m megazoo.plot`: curves of several --log-json runs in one picture; bad input is one
line and exit 2."""
from __future__ import annotations

import json

import pytest

from megazoo import plot


def write_log(path, rate: float, with_tokens: bool = True) -> None:
    lines = [{"tokens_per_step": 256}] if with_tokens else []
    lines += [{"iteration": i, "loss": 7.0 - 0.1 * i, "lr": 1e-4 * i, "grad_norm": 1.0 + i,
               "tokens_per_s": rate, "host_rss_gb": 0.4} for i in range(1, 6)]
    lines.append({"iteration": 5, "valid_loss": 6.6})
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")


def test_two_runs_overlaid(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    write_log(tmp_path / "a.jsonl", 1000.0)
    write_log(tmp_path / "b.jsonl", 2000.0)
    out = tmp_path / "curves.png"
    assert plot.main([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    said = capsys.readouterr().out
    assert "loss (nats/token), learning rate, tokens/s, gradient norm, memory (GB)" in said
    assert "MFU" not in said  # no run logged it
    records, tokens = plot.read_log(str(tmp_path / "a.jsonl"))
    assert tokens == 256 and plot.series(records, "valid_loss", tokens) == ([1280], [6.6])


def test_iteration_axis_without_tokens_per_step(tmp_path):
    write_log(tmp_path / "a.jsonl", 1000.0, with_tokens=False)
    records, tokens = plot.read_log(str(tmp_path / "a.jsonl"))
    assert tokens is None and plot.series(records, "loss", tokens)[0] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("content, message", [
    (None, "cannot read"), ("not json\n", ":1 is not a JSON line"),
    ('{"a": 1}\n', "holds no logged iterations")])
def test_bad_logs_are_one_line_exit_2(tmp_path, capsys, content, message):
    path = tmp_path / "x.jsonl"
    if content is not None:
        path.write_text(content)
    assert plot.main([str(path), "--out", str(tmp_path / "o.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err
