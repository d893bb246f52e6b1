"""The GPU compression benchmark's --dry-run (CPU, gloo, tiny sizes): one process (its own
one-rank group, as a child process) and two ranks (spawned by the test harness), every
algorithm timed, the byte ratios of the codecs."""
import json
import os
import subprocess
import sys
from pathlib import Path

from megazoo.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]


def _two_ranks(out: str) -> None:
    sys.path.insert(0, str(ROOT))
    from bench.compression_bench import main

    assert main(["--dry-run", "--out", out]) == 0


def test_dry_run_one_process_and_two_ranks(tmp_path):
    out = tmp_path / "one.json"
    proc = subprocess.run([sys.executable, "-m", "bench.compression_bench", "--dry-run",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=240, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = json.loads(out.read_text())
    assert [r["algorithm"] for r in one["rows"]] == ["topk_0.01", "topk_0.01_eager", "1bit", "2bit",
                                                      "1bit_eager", "2bit_eager"]
    assert all(r["ms"] > 0 and r["pct_of_allreduce"] > 0 for r in one["rows"])
    run_distributed(_two_ranks, 2, str(tmp_path / "two.json"), timeout=240)
    two = json.loads((tmp_path / "two.json").read_text())
    ratios = {r["algorithm"]: r["ratio"] for r in two["rows"]}
    assert ratios["dense_fp32"] == 1 and ratios["dense_bf16"] == 2
    assert 28 < ratios["1bit"] <= 32 and 14 < ratios["2bit"] <= 16 and ratios["topk_0.01"] > 40
