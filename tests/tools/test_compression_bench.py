"""The GPU compression benchmark's --dry-run (CPU, gloo, tiny sizes): one process and two
ranks under torchrun, every algorithm timed, the byte ratios of the codecs."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(launcher, out):
    cmd = [*launcher, "-m", "bench.compression_bench", "--dry-run", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_dry_run_one_process_and_two_ranks(tmp_path):
    one = _run([sys.executable], tmp_path / "one.json")
    assert [r["algorithm"] for r in one["rows"]] == ["topk_0.01", "1bit", "2bit"]
    assert all(r["ms"] > 0 and r["pct_of_allreduce"] > 0 for r in one["rows"])
    two = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"],
               tmp_path / "two.json")
    ratios = {r["algorithm"]: r["ratio"] for r in two["rows"]}
    assert ratios["dense_fp32"] == 1 and ratios["dense_bf16"] == 2
    assert 28 < ratios["1bit"] <= 32 and 14 < ratios["2bit"] <= 16 and ratios["topk_0.01"] > 40
