"""bench/two_gpu.py, the two-GPU driver: its ratios, the profiler's exposed-communication
count, and one part's CPU dry run end to end (gloo, 2 ranks)."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from bench.profile_train import exposed_communication
from bench.two_gpu_summary import summarize

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _event(name, start, end, device=torch.autograd.DeviceType.CUDA):
    return SimpleNamespace(name=name, device_type=device,
                           time_range=SimpleNamespace(start=start, end=end))


def test_exposed_communication_is_collective_time_no_compute_covers():
    events = [_event("ncclDevKernel_AllReduce", 0, 10), _event("ncclDevKernel_AllReduce", 20, 30),
              _event("gemm", 5, 25), _event("gemm", 6, 8),  # nested compute counts once
              _event("ncclKernel_host_side", 40, 50, torch.autograd.DeviceType.CPU)]  # not a kernel
    comm, exposed = exposed_communication(events, on_gpu=True)
    assert (comm, exposed) == (20, 10)
    # the fused async-TP ops: a peer copy beside a GEMM is hidden, a barrier after it is not
    fused = [_event("Memcpy PtoP (Device -> Device)", 0, 10), _event("gemm", 0, 12),
             _event("c10d::symmetric_memory::barrier_kernel", 12, 15),
             _event("Memcpy DtoD (Device -> Device)", 15, 20)]  # a local copy is compute
    assert exposed_communication(fused, on_gpu=True) == (13, 3)
    cpu = [_event("gloo:all_reduce", 0, 10, torch.autograd.DeviceType.CPU),
           _event("aten::mm", 8, 20, torch.autograd.DeviceType.CPU),
           _event("ProfilerStep", 0, 100, torch.autograd.DeviceType.CPU)]  # neither: ignored
    assert exposed_communication(cpu, on_gpu=False) == (10, 8)


def test_summary_ratios(tmp_path):
    dp = {"global_batch": 16, "seq": 2048,
          "runs": {"overlap-dp1": {"tokens_per_s": 100.0}, "overlap-dp2": {"tokens_per_s": 190.0,
                                                                            "peak_gb": 21.0}},
          "plan": {"overlap": {"plan_alloc_gb": 20.0}}, "deepspeed": {"tokens_per_s": 95.0},
          "profile": {"overlap": {"exposed_comm_ms": 3.0, "comm_ms": 9.0, "step_ms": 300.0}}}
    (tmp_path / "dp_gb16.json").write_text(json.dumps(dp))
    (tmp_path / "compress.json").write_text(json.dumps({
        "global_batch": 16, "seq": 2048, "reduction": {"error": "not available"},
        "steps": {"nccl": {"tokens_per_s": 200.0}, "topk": {"tokens_per_s": 250.0}}}))
    (tmp_path / "offload.json").write_text(json.dumps({"rows": [
        {"layout": "tp2+offload", "tokens_s": 3000.0}, {"layout": "tp2+offload fsdp2", "tokens_s": 4500.0}]}))
    assert summarize(str(tmp_path)) == 0
    out = json.loads((tmp_path / "summary.json").read_text())
    row = out["dp"][0]
    assert row["variant"] == "overlap"
    assert abs(row["efficiency"] - 0.95) < 1e-12 and abs(row["vs_deepspeed"] - 2.0) < 1e-12
    assert abs(row["peak_vs_plan"] - 1.05) < 1e-12 and row["exposed_ms"] == 3.0
    assert out["dp"][1]["variant"] == "deepspeed-zero1-hf"
    steps = {r["algorithm"]: r for r in out["compress"]["steps"]}
    assert abs(steps["topk"]["vs_nccl"] - 1.25) < 1e-12
    assert abs(steps["nccl"]["step_ms"] - 16 * 2048 / 200.0 * 1e3) < 1e-6
    assert abs(out["offload"][1]["vs_deepspeed_tp2"] - 1.5) < 1e-12


@pytest.mark.slow
def test_sparse_part_dry_run(tmp_path):
    """The sparse part on CPU: two gloo ranks of block-sparse Ulysses against one process.

    Tolerance 1e-5: float32 math attention over at most 1024 keys of O(1) values; the ranks
    compute the same heads with the same operations as the one process, so any difference
    is float32 rounding of the matmuls' blocking."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (REPO, os.environ.get("PYTHONPATH"))))}
    proc = subprocess.run([sys.executable, "-m", "bench.two_gpu", "--dry-run", "--parts", "sparse",
                           "--out", str(tmp_path)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((tmp_path / "sparse.json").read_text())["rows"]
    assert {r["mode"] for r in rows} == {"bigbird", "bslongformer"}
    for r in rows:
        assert r["block"] == 128 and r["max_diff"] <= 1e-5
        assert r["eff_sparse"] > 0 and r["x_dense"] > 0
    assert "eff_sparse" in proc.stdout  # the summary table was printed


def test_plain_offload_summary_ratios(tmp_path):
    """Each row against DeepSpeed in its layout, dp = 2 against twice the one-GPU row, and
    measured memory over planned (exact arithmetic on the numbers given)."""
    rows = {"1 gpu": {"name": "dp1", "tokens_per_s": 100.0, "fraction": 0.5},
            "dp2": {"name": "dp2", "tokens_per_s": 190.0, "fraction": 0.5, "peak_gb": 42.0,
                    "plan_peak_gb": 40.0, "host_rss_gb": 30.0, "plan_host_gb": 32.0,
                    "losses": [8.0, 7.5, 7.0]},
            "deepspeed": {"name": "ds", "tokens_per_s": 95.0}}
    (tmp_path / "plain_offload_dp2.json").write_text(json.dumps({"layout": "dp2", "rows": rows}))
    (tmp_path / "plain_offload_largest.json").write_text(json.dumps({"layout": "largest", "rows": {
        "largest": {"name": "largest tp2", "error": "stopped", "num_parameters": 15e9,
                    "finite_and_falling": False}}}))
    assert summarize(str(tmp_path)) == 0
    got = {r["row"]: r for r in json.loads((tmp_path / "summary.json").read_text())["plain_offload"]}
    assert got["dp1"]["vs_deepspeed"] is None and got["dp1"]["efficiency"] is None
    assert abs(got["dp2"]["vs_deepspeed"] - 2.0) < 1e-12 and abs(got["dp2"]["efficiency"] - 0.95) < 1e-12
    assert abs(got["dp2"]["peak_vs_plan"] - 1.05) < 1e-12 and abs(got["dp2"]["host_vs_plan"] - 0.9375) < 1e-12
    assert (got["dp2"]["loss_first"], got["dp2"]["loss_last"]) == (8.0, 7.0)
    assert abs(got["ds"]["vs_deepspeed"] - 1.0) < 1e-12 and got["ds"]["efficiency"] is None
    assert got["largest tp2"]["error"] == "stopped" and got["largest tp2"]["plan_params_b"] == 15.0
    assert got["largest tp2"]["falling"] is False and got["largest tp2"]["tokens_s"] is None


@pytest.mark.slow
def test_plain_offload_part_dry_run(tmp_path):
    """The plain-offload part on CPU (gloo, 2 ranks, tiny shapes), its dp2 and largest layouts
    without the DeepSpeed rows: every row trains, dp2's rows run at the fractions they name,
    and the largest row trains the larger of the planner's tp = 2 and dp = 2 answers."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (REPO, os.environ.get("PYTHONPATH"))))}
    proc = subprocess.run([sys.executable, "-m", "bench.two_gpu", "--dry-run", "--parts", "plain-offload",
                           "--offload-layouts", "dp2", "largest", "--no-offload-peer", "--offload-iters", "3",
                           "--out", str(tmp_path)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((tmp_path / "plain_offload_dp2.json").read_text())["rows"]
    assert set(rows) == {"1 gpu", "dp2", "dp2 planned"}
    # 0.5: the dry run's fixed fraction; 0: the planner's, whose 80 GB GPU holds a tiny model
    assert [rows[k]["fraction"] for k in ("1 gpu", "dp2", "dp2 planned")] == [0.5, 0.5, 0.0]
    for row in rows.values():
        assert "error" not in row and row["tokens_per_s"] > 0 and len(row["losses"]) == 3
        assert f"--optimizer-offload-fraction {row['fraction']:g}" in row["flags"]
    largest = json.loads((tmp_path / "plain_offload_largest.json").read_text())["rows"]["largest"]
    asked = largest["asked"]
    assert set(asked) == {"tp2", "dp2"} and all("command" in a for a in asked.values())
    assert largest["num_parameters"] == max(a["num_parameters"] for a in asked.values())
    assert largest["num_parameters"] == asked[largest["layout"]]["num_parameters"]
    assert "error" not in largest and len(largest["losses"]) == 12
    assert largest["finite_and_falling"]  # 12 deterministic CPU steps of the tiny model
    assert "plain-offload:" in proc.stdout  # the summary table was printed
