"""bench.gap_report on a hand-made trace: gaps found, charged to the launching thread's frames."""
import json

from bench.gap_report import report


def _trace(tmp_path):
    ev = [
        # host thread 1: a python frame covering the second gap's middle
        {"cat": "python_function", "name": "megazoo/layers/fp8.py(10): quantize", "ts": 90,
         "dur": 60, "tid": 1},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 5, "dur": 1, "tid": 1,
         "args": {"correlation": 1}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 30, "dur": 1, "tid": 1,
         "args": {"correlation": 2}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 139, "dur": 1, "tid": 1,
         "args": {"correlation": 3}},
        {"cat": "kernel", "name": "a", "ts": 10, "dur": 40, "args": {"correlation": 1}},
        # launched at 30, runs at 70: the 20 us gap is a wait, not a late launch
        {"cat": "kernel", "name": "b", "ts": 70, "dur": 30, "args": {"correlation": 2}},
        # launched at 139 while the device idled from 100: late by 40 us, charged to quantize
        {"cat": "kernel", "name": "c", "ts": 140, "dur": 10, "args": {"correlation": 3}},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    return str(path)


def test_gaps_are_found_and_charged(tmp_path, capsys):
    out = report(_trace(tmp_path), rows=5, min_us=5)
    assert out["span_us"] == 140
    assert out["wait_us"] == 20 and out["late_us"] == 40
    rows = {r["frames"]: r["us"] for r in out["rows"]}
    assert rows["megazoo/layers/fp8.py(10): quantize"] == 40
    assert "idle 0.1 ms" in capsys.readouterr().out


def test_small_gaps_are_ignored(tmp_path):
    out = report(_trace(tmp_path), rows=5, min_us=25)
    assert out["wait_us"] == 0 and out["late_us"] == 40
