"""bench/wgrad_bench.py's --dry-run (CPU): the bf16 rows' code path, its result written, and
the fused accumulation equal to the float64 product up to bf16 rounding of dW (2^-8)."""
import json

from bench.wgrad_bench import main


def test_dry_run_writes_its_rows(tmp_path):
    out = str(tmp_path / "wgrad.json")
    assert main(["--dry-run", "--out", out]) == 0
    with open(out) as f:
        rows = json.load(f)["rows"]
    assert len(rows) == 1 and rows[0]["bf16_fused"] > 0
    assert rows[0]["bf16_err"] < 2 ** -8
