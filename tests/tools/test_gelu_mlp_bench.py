"""bench/gelu_mlp_bench.py's --dry-run (CPU): the benchmark runs and writes one row with every
column. The fused MLP's arithmetic is checked in tests/layers/test_gelu_mlp.py (on CPU both
paths run the same torch ops, so the row's `diff` says nothing there and is not asserted)."""
import json
import math

from bench.gelu_mlp_bench import main

COLUMNS = ("M", "h", "ffn", "fwd_fused", "fwd_unfused", "fwd_bwd_fused", "fwd_bwd_unfused", "diff")


def test_dry_run_writes_its_rows(tmp_path):
    out = str(tmp_path / "gelu_mlp.json")
    assert main(["--dry-run", "--out", out]) == 0
    with open(out) as f:
        rows = json.load(f)["rows"]
    assert len(rows) == 1 and set(rows[0]) == set(COLUMNS)
    assert all(rows[0][k] > 0 for k in COLUMNS[3:7]) and math.isfinite(rows[0]["diff"])
