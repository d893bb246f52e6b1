"""bench/gelu_mlp_bench.py's --dry-run (CPU): its rows written; on CPU both paths run the
same torch ops (cuBLASLt cannot), so fused and unfused agree exactly."""
import json

from bench.gelu_mlp_bench import main


def test_dry_run_writes_its_rows(tmp_path):
    out = str(tmp_path / "gelu_mlp.json")
    assert main(["--dry-run", "--out", out]) == 0
    with open(out) as f:
        rows = json.load(f)["rows"]
    assert len(rows) == 1 and rows[0]["fwd_bwd_fused"] > 0 and rows[0]["fwd_bwd_unfused"] > 0
    assert rows[0]["diff"] == 0.0
