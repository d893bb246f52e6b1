"""The ratios of a `bench/two_gpu.py` output folder: printed as tables, written to summary.json.

    python -m bench.two_gpu_summary two_gpu/

- dp: per global batch and variant, tokens/s at dp = 1 and 2, scaling efficiency
  tokens/s(dp2) / (2 tokens/s(dp1)), dp = 2 against DeepSpeed ZeRO-1 + HF GPT2 at dp = 2,
  peak GPU memory at dp = 2 (rank 0) against the planner's allocated estimate, and the
  profiled step: communication and exposed communication per step (profile_train.py).
- sparse: per length and layout, sparse vs dense time at sp = 2 and the Ulysses efficiency
  t(1 GPU) / (2 t(2 GPUs)) of the sparse and the dense layer.
- compress: the reduction benchmark's own rows, and pretrain_gpt.py's step time at dp = 2
  per algorithm against the plain NCCL all-reduce.
- offload: tokens/s of each ZeRO-3 layout and FSDP2's against DeepSpeed's at tp = 2.
- plain-offload: per layout, each row's tokens/s against DeepSpeed ZeRO-3 + CPU offload in the
  same layout, dp = 2's scaling efficiency against the one-GPU row, GPU peak and rank 0's host
  RSS against the planner, and the largest model's losses.
"""
from __future__ import annotations

import glob
import json
import os
import sys

from bench.common import print_table, write_json


def _load(path: str):
    with open(path) as f:
        return json.load(f)


def _ratio(a, b):
    return a / b if a and b else None


def dp_rows(saved: dict) -> list[dict]:
    runs, plans = saved.get("runs", {}), saved.get("plan", {})
    ds = saved.get("deepspeed", {})
    profiles = saved.get("profile", {})
    names = sorted({k.rsplit("-dp", 1)[0] for k in runs})
    rows = []
    for name in names:
        one, two = runs.get(f"{name}-dp1", {}), runs.get(f"{name}-dp2", {})
        plan, prof = plans.get(name, {}), profiles.get(name, {})
        row = {"gb": saved.get("global_batch"), "variant": name,
               "tok_s_dp1": one.get("tokens_per_s"), "tok_s_dp2": two.get("tokens_per_s"),
               "peak_gb": two.get("peak_gb"), "plan_gb": plan.get("plan_alloc_gb"),
               "exposed_ms": prof.get("exposed_comm_ms"), "comm_ms": prof.get("comm_ms"),
               "step_ms": prof.get("step_ms")}
        row["efficiency"] = _ratio(row["tok_s_dp2"], 2 * (row["tok_s_dp1"] or 0))
        row["vs_deepspeed"] = _ratio(row["tok_s_dp2"], ds.get("tokens_per_s"))
        row["peak_vs_plan"] = _ratio(row["peak_gb"], row["plan_gb"])
        errors = [e for e in (one.get("error"), two.get("error"), plan.get("error"),
                              prof.get("error")) if e]
        if errors:
            row["error"] = errors[0][-160:]
        rows.append(row)
    if ds:
        rows.append({"gb": saved.get("global_batch"), "variant": "deepspeed-zero1-hf",
                     "tok_s_dp2": ds.get("tokens_per_s"), "peak_gb": ds.get("peak_gb"),
                     "error": (ds.get("error") or "")[-160:] or None})
    return rows


DP_COLUMNS = ["gb", "variant", "tok_s_dp1", "tok_s_dp2", "efficiency", "vs_deepspeed", "peak_gb",
              "plan_gb", "peak_vs_plan", "step_ms", "comm_ms", "exposed_ms", "error"]
SPARSE_COLUMNS = ["seq", "mode", "dense_ms", "sparse_ms", "x_dense", "eff_sparse", "eff_dense",
                  "max_diff"]
OFFLOAD_COLUMNS = ["layout", "tokens_s", "vs_deepspeed_tp2", "mfu", "peak_alloc_gb",
                   "plan_alloc_gb", "host_rss_gb"]


def compress_rows(saved: dict) -> list[dict]:
    steps = saved.get("steps", {})
    tokens = (saved.get("global_batch") or 0) * (saved.get("seq") or 0)
    base = steps.get("nccl", {}).get("tokens_per_s")
    rows = []
    for name, run in steps.items():
        rate = run.get("tokens_per_s")
        rows.append({"algorithm": name, "step_ms": tokens / rate * 1e3 if rate else None,
                     "vs_nccl": _ratio(rate, base), "error": (run.get("error") or "")[-160:] or None})
    return rows


def offload_rows(saved: dict) -> list[dict]:
    rows = [dict(r) for r in saved.get("rows", []) if isinstance(r, dict)]
    base = next((r.get("tokens_s") for r in rows if r.get("layout") == "tp2+offload"), None)
    for r in rows:
        r["vs_deepspeed_tp2"] = _ratio(r.get("tokens_s"), base)
    return rows


PLAIN_OFFLOAD_COLUMNS = ["layout", "row", "fraction", "tokens_s", "vs_deepspeed", "efficiency",
                         "peak_gb", "peak_vs_plan", "host_rss_gb", "host_vs_plan", "loss_first",
                         "loss_last", "falling", "plan_params_b", "error"]


def plain_offload_rows(saved: dict) -> list[dict]:
    """One row per run of a plain_offload_<layout>.json: the ratios the targets are about."""
    runs = saved.get("rows", {})
    base = runs.get("deepspeed", {}).get("tokens_per_s")
    one = runs.get("1 gpu", {}).get("tokens_per_s")
    rows = []
    for key, run in runs.items():
        losses = run.get("losses") or [None]
        rate = run.get("tokens_per_s")
        rows.append({
            "layout": saved.get("layout"), "row": run.get("name", key),
            "fraction": run.get("fraction"), "tokens_s": rate,
            "vs_deepspeed": _ratio(rate, base) if key != "1 gpu" else None,
            "efficiency": _ratio(rate, 2 * (one or 0)) if key.startswith("dp2") else None,
            "peak_gb": run.get("peak_gb"), "peak_vs_plan": _ratio(run.get("peak_gb"), run.get("plan_peak_gb")),
            "host_rss_gb": run.get("host_rss_gb"),
            "host_vs_plan": _ratio(run.get("host_rss_gb"), run.get("plan_host_gb")),
            "loss_first": losses[0], "loss_last": losses[-1],
            "falling": run.get("finite_and_falling"),
            "plan_params_b": run["num_parameters"] / 1e9 if "num_parameters" in run else None,
            "error": (run.get("error") or "")[-160:] or None})
    return rows


def summarize(out: str) -> int:
    """Print and write (OUT/summary.json) the ratios of every part found in `out`."""
    summary = {}
    dp = [r for p in sorted(glob.glob(os.path.join(out, "dp_gb*.json"))) for r in dp_rows(_load(p))]
    if dp:
        print("\n## dp: pretrain_gpt.py at dp = 1 and 2 (tokens/s count all ranks)")
        print_table(dp, DP_COLUMNS)
        summary["dp"] = dp
    parts = {name: _load(os.path.join(out, f"{name}.json")) for name in ("sparse", "compress", "offload")
             if os.path.exists(os.path.join(out, f"{name}.json"))}
    if "sparse" in parts:
        rows = parts["sparse"].get("rows") or [parts["sparse"]]
        print("\n## sparse: block-sparse Ulysses, sp = 2 (eff = t(1 GPU) / (2 t(2 GPUs)))")
        print_table(rows, SPARSE_COLUMNS + (["error"] if "error" in parts["sparse"] else []))
        summary["sparse"] = rows
    if "compress" in parts:
        reduction = parts["compress"].get("reduction", {})
        print("\n## compress: gradient reduction benchmark")
        print(json.dumps(reduction, indent=1)[:2000])
        rows = compress_rows(parts["compress"])
        print("\n## compress: pretrain_gpt.py step at dp = 2 per algorithm")
        print_table(rows, ["algorithm", "step_ms", "vs_nccl", "error"])
        summary["compress"] = {"reduction": reduction, "steps": rows}
    if "offload" in parts:
        rows = offload_rows(parts["offload"])
        print("\n## offload: ZeRO-3 at tp = 2 / sp = 2 (zero_bench.py --two-gpu)")
        print_table(rows or [parts["offload"]], OFFLOAD_COLUMNS + ["error"])
        summary["offload"] = rows or parts["offload"]
    plain = [r for p in sorted(glob.glob(os.path.join(out, "plain_offload_*.json")))
             for r in plain_offload_rows(_load(p))]
    if plain:
        print("\n## plain-offload: --optimizer-cpu-offload vs DeepSpeed ZeRO-3 + CPU offload "
              "(efficiency = tokens/s(dp 2) / (2 tokens/s(1 GPU)); vs plan: measured / planned)")
        print_table(plain, PLAIN_OFFLOAD_COLUMNS)
        summary["plain_offload"] = plain
    write_json(os.path.join(out, "summary.json"), summary)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m bench.two_gpu_summary OUT_FOLDER", file=sys.stderr)
        sys.exit(2)
    sys.exit(summarize(sys.argv[1]))
