"""bench/host_pace.py: the host's time per micro-batch per layout on the fake process group,
and the planner constants it fits (the GPU numbers come from `--device cuda`)."""
import json

import pytest

from bench import host_pace


def test_cpu_rows_and_fit(tmp_path, capsys):
    out = tmp_path / "pace.json"
    assert host_pace.main(["--layers", "2", "--heads", "4", "--seq", "16", "--steps", "2",
                           "--repeats", "1", "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert set(saved["rows"]) == set(host_pace.LAYOUTS)
    assert all(r["ms_per_micro_batch"] > 0 for r in saved["rows"].values())
    assert saved["fit"]["host_block_ms"] > 0 and saved["fit"]["host_collective_ms"] >= 0
    assert "fit: host_block_ms" in capsys.readouterr().out


def test_fit_arithmetic():
    """tp1 gives the time per block; tp2 + SP's extra time spread over its 8 calls per block
    (2 all-gathers and 2 reduce-scatters each way)."""
    args = host_pace.parse_args(["--layers", "4", "--heads", "4"])
    rows = {"tp1": {"ms_per_micro_batch": 8.0}, "tp2+SP": {"ms_per_micro_batch": 11.2}}
    fit = host_pace.fit(rows, args)
    assert fit["host_block_ms"] == pytest.approx(2.0)
    assert fit["host_collective_ms"] == pytest.approx(3.2 / (4 * 8))


def test_refuses_a_split_that_does_not_divide(capsys):
    with pytest.raises(SystemExit):
        host_pace.parse_args(["--seq", "15", "--layouts", "tp2+SP"])
    assert "must divide by 2" in capsys.readouterr().err
