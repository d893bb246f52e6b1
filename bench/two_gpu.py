"""Every two-GPU measurement in one driver: data-parallel scaling of pretrain_gpt.py, sparse
attention with Ulysses sp = 2, compressed gradient reduction, ZeRO-3 + CPU offload at tp = 2.

    python -m bench.two_gpu --out two_gpu/                       # all parts (see bench/README.md)
    python -m bench.two_gpu --parts dp --dp-batches 16 --out two_gpu/
    python -m bench.two_gpu --dry-run --parts sparse --out /tmp/two_gpu   # CPU, gloo, tiny

Each part runs its measurements as child processes (torchrun with 2 ranks where two are
needed, one process for the one-GPU baselines) and writes `OUT/<part>.json`; a later call
with the same --out adds to what earlier calls wrote (rows of the same name are replaced),
so a part can be split over several calls. After the parts ran, the ratios of everything in
OUT are printed and written to `OUT/summary.json` (bench/two_gpu_summary.py). What the
children print goes to `OUT/*.log` and `OUT/logs/` (pretrain_gpt.py's --log-json there too).

- dp: gpt-1.3b (train_bench.py's shape, vocabulary 2048), s 2048, micro-batch 4, bf16, at
  each --dp-batches: pretrain_gpt.py at dp = 1 and 2 in each of DP_VARIANTS (through
  bench/run_compare.py); DeepSpeed ZeRO-1 + HF GPT2 at dp = 2 (train_bench.py's child under
  torchrun); `python -m megazoo.plan --dp 2 --json` for each dp = 2 variant; torch.profiler
  at dp = 2 with overlap on and off (profile_train.py: exposed communication per step).
- sparse: ulysses_bench.py --sparse bigbird bslongformer at 64k and 128k, block 128.
- compress: bench/compression_bench.py under torchrun (dp = 2) where the module exists, and pretrain_gpt.py
  at dp = 2 with each row of COMPRESSION (step time, vs the plain NCCL all-reduce).
- offload: zero_bench.py --two-gpu (DeepSpeed and FSDP2 ZeRO-3 + CPU offload at tp = 2, each
  rank on its share of the host cores, as --cpu-threads does for pretrain_gpt.py).
- plain-offload: the plain engine's --optimizer-cpu-offload at tp = 2 and dp = 2 against
  DeepSpeed ZeRO-3 + CPU offload, and the largest model two GPUs train (bench/two_gpu_offload.py).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import sys

from bench import two_gpu_offload
from bench.common import (REPO, failure_line, module_command, results, run_command, torchrun,
                          write_json)
from bench.run_compare import run_variant
from bench.train_bench import SHAPES, model_flags

# pretrain_gpt.py flags of each gradient reduction at dp = 2 (1bit after a short warmup, as
# its convergence runs use it).
COMPRESSION = {
    "nccl": [],
    "topk": ["--gradient-compression", "topk", "--topk-ratio", "0.01"],
    "1bit": ["--gradient-compression", "1bit", "--compression-start-step", "10"],
}
# pretrain_gpt.py data-parallel variants, each run at dp = 1 and dp = 2.
DP_VARIANTS = {
    "overlap+distopt": ["--overlap-grad-reduce", "--use-distributed-optimizer"],
    "overlap": ["--overlap-grad-reduce"],
    "distopt": ["--use-distributed-optimizer"],
    "plain": [],
}
PROFILED = ("overlap+distopt", "distopt")  # exposed communication with overlap on and off
DP_EXTRAS = ("deepspeed", "plan", "profile")
PARTS = ("dp", "sparse", "compress", "offload", "plain-offload")
# pretrain_gpt.py flags of every run here: no checkpoint, no sample text, plain log lines.
RUN_FLAGS = ["--save", "", "--generate-tokens", "0", "--no-progress",
             "--data-cache-path", os.path.join(REPO, "data_cache")]


def pretrain_flags(cfg, global_batch: int) -> list[str]:
    """The shape, batch and iteration flags of one pretrain_gpt.py run (tiny with --dry-run)."""
    shape = SHAPES[cfg.shape]
    iters = 6 if cfg.dry_run else cfg.iters
    flags = model_flags(shape) + ["--micro-batch-size", str(shape["micro"]),
                                  "--global-batch-size", str(global_batch),
                                  "--train-iters", str(iters),
                                  "--log-interval", str(max(1, iters // 6)), "--eval-iters", "0"]
    return flags + ([] if cfg.dry_run else ["--bf16"])


def filename(name: str) -> str:
    """`name` as a file name: "+" is not carried back from the device machine."""
    return name.replace("+", "_")


def load(path: str) -> dict:
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return {}


def run_logged(cmd: list[str], timeout: float, log: str) -> tuple[int | None, str, str]:
    """Run `cmd` (bench.common.run_command); its stdout and stderr also go to the file `log`
    (the profiler's tables, the children's own prints) for reading after the session."""
    print("$ " + " ".join(cmd), flush=True)
    rc, out, err = run_command(cmd, timeout)
    with open(log, "w") as f:
        f.write(f"$ {' '.join(cmd)}\n# exit {rc}\n{out}\n# stderr\n{err}")
    return rc, out, err


def _failure(rc: int | None, timeout: float, err: str) -> dict:
    why = f"stopped after {timeout:.0f} s" if rc is None else f"exit {rc}: {failure_line(err)}"
    print(f"  failed: {why}", flush=True)
    return {"error": why}


def child_json(cmd: list[str], path: str, timeout: float) -> dict:
    """Run `cmd` (which writes JSON to `path`; log in `path`.log): its JSON, or {"error": why}."""
    if os.path.exists(path):
        os.remove(path)
    rc, out, err = run_logged(cmd, timeout, path + ".log")
    if rc == 0 and os.path.exists(path):
        return load(path)
    return _failure(rc, timeout, err or out)


def result_line(cmd: list[str], timeout: float, log: str) -> dict:
    """Run `cmd` and parse its last "RESULT {json}" line, or {"error": why}."""
    rc, out, err = run_logged(cmd, timeout, log)
    found = results(out)
    if rc == 0 and found:
        return found[-1]
    return _failure(rc, timeout, err)


def plan(flags: list[str]) -> dict:
    """`python -m megazoo.plan FLAGS --dp 2 --json`, in this process: GB allocated and total."""
    from megazoo.plan.cli import main as plan_main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = plan_main(flags + ["--dp", "2", "--json"])
        except SystemExit as exc:  # its parser's one-line error (a flag it does not know)
            rc = exc.code or 2
    if rc:
        return {"error": err.getvalue().strip()}
    est = json.loads(out.getvalue())
    return {"plan_alloc_gb": est["allocated"] / 1e9, "plan_gpu_gb": est["gpu_total"] / 1e9}


def part_dp(cfg) -> None:
    logs = os.path.join(cfg.out, "logs")
    os.makedirs(logs, exist_ok=True)
    for gb in cfg.dp_batches:
        path = os.path.join(cfg.out, f"dp_gb{gb}.json")
        saved = load(path)
        saved.update(shape=cfg.shape, global_batch=gb, seq=SHAPES[cfg.shape]["seq"])
        runs, plans = saved.setdefault("runs", {}), saved.setdefault("plan", {})
        common = pretrain_flags(cfg, gb)
        for name in cfg.dp_variants:
            for dp in (1, 2):
                key = f"{name}-dp{dp}"
                runs[key] = run_variant(filename(key), common + DP_VARIANTS[name], logs, cfg.timeout, dp)
            if "plan" in cfg.dp_extras:
                plans[name] = plan(common + DP_VARIANTS[name])
            write_json(path, saved)
        if "deepspeed" in cfg.dp_extras:
            cmd = module_command("train_bench", torchrun(2)) + ["--child", "deepspeed", cfg.shape, str(gb)]
            saved["deepspeed"] = result_line(cmd + (["--dry-run"] if cfg.dry_run else []), cfg.timeout,
                                             os.path.join(logs, f"deepspeed_gb{gb}.log"))
            write_json(path, saved)
        if "profile" in cfg.dp_extras:
            profiles = saved.setdefault("profile", {})
            for name in PROFILED:
                out = os.path.join(cfg.out, f"profile_gb{gb}_{filename(name)}.json")
                run = common + DP_VARIANTS[name] + RUN_FLAGS + ["--train-iters", "6"]
                cmd = module_command("profile_train", torchrun(2)) + [
                    "--skip", "3", "--steps", "3", "--rows", "15", "--out", out, "--", *run]
                profiles[name] = child_json(cmd, out, cfg.timeout)
            write_json(path, saved)


def part_sparse(cfg) -> None:
    path = os.path.join(cfg.out, "sparse.json")
    cmd = module_command("ulysses_bench", torchrun(2)) + [
        "--sparse", *cfg.sparse_modes, "--sparse-block", "128", "--seqs", *map(str, cfg.sparse_seqs),
        "--no-deepspeed", "--chunks", "--out", path + ".part"]
    write_json(path, child_json(cmd + (["--dry-run"] if cfg.dry_run else []), path + ".part", cfg.timeout))


def part_compress(cfg) -> None:
    path = os.path.join(cfg.out, "compress.json")
    saved = load(path)
    if importlib.util.find_spec("bench.compression_bench") is None:
        saved["reduction"] = {"error": "not available: bench/compression_bench.py is not on this branch"}
    else:
        cmd = module_command("compression_bench", torchrun(2)) + ["--out", path + ".part"]
        saved["reduction"] = child_json(cmd + (["--dry-run"] if cfg.dry_run else []),
                                        path + ".part", cfg.timeout)
    write_json(path, saved)
    logs = os.path.join(cfg.out, "logs")
    os.makedirs(logs, exist_ok=True)
    gb = cfg.dp_batches[0]
    steps = saved.setdefault("steps", {})
    saved["global_batch"], saved["seq"] = gb, SHAPES[cfg.shape]["seq"]
    for name, flags in COMPRESSION.items():
        steps[name] = run_variant(f"compress-{name}", pretrain_flags(cfg, gb) + flags, logs,
                                  cfg.timeout, 2)
        write_json(path, saved)


def part_offload(cfg) -> None:
    """zero_bench.py --two-gpu, one layout per torchrun child: each row's peak memory and
    host RSS are then that layout's alone."""
    from bench.zero_bench import TWO_GPU_LAYOUTS

    path = os.path.join(cfg.out, "offload.json")
    dry = ["--dry-run", "--iters", "2", "--warmup", "1"] if cfg.dry_run else []
    rows = []
    for layout in TWO_GPU_LAYOUTS:
        part = os.path.join(cfg.out, f"offload_{filename(layout).replace(' ', '_')}.json")
        cmd = module_command("zero_bench", torchrun(2)) + ["--two-gpu", "--layouts", layout, "--out", part]
        got = child_json(cmd + dry, part, cfg.timeout)
        rows += got if isinstance(got, list) else [{"layout": layout, **got}]
        write_json(path, {"rows": rows})


def parse_args(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--out", required=True, help="folder for each part's JSON (added to, not wiped)")
    p.add_argument("--dry-run", action="store_true", help="CPU, gloo, 2 ranks, tiny shapes")
    p.add_argument("--dp-batches", nargs="+", type=int, default=None,
                   help="global batches of the dp part (default 16 64; dry run 8); the compress "
                        "part uses the first")
    p.add_argument("--dp-variants", nargs="*", choices=list(DP_VARIANTS), default=list(DP_VARIANTS),
                   help="pretrain_gpt.py variants run at dp = 1 and 2 (none: --dp-variants)")
    p.add_argument("--dp-extras", nargs="*", choices=DP_EXTRAS, default=list(DP_EXTRAS),
                   help="what the dp part measures beside pretrain_gpt.py (none: --dp-extras)")
    p.add_argument("--sparse-modes", nargs="+", default=["bigbird", "bslongformer"])
    p.add_argument("--sparse-seqs", nargs="+", type=int, default=[65536, 131072])
    p.add_argument("--iters", type=int, default=24, help="pretrain_gpt.py iterations per run")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds per child process (default 420; dry run 300)")
    two_gpu_offload.add_flags(p)
    cfg = p.parse_args(argv)
    cfg.shape = "tiny" if cfg.dry_run else "gpt-1.3b"
    cfg.dp_batches = cfg.dp_batches or ([8] if cfg.dry_run else [16, 64])
    micro = SHAPES[cfg.shape]["micro"]
    bad = [gb for gb in cfg.dp_batches if gb % (2 * micro)]
    if bad:
        p.error(f"--dp-batches {bad[0]} must divide by micro-batch {micro} x 2 ranks")
    if cfg.iters < 7:
        p.error(f"--iters {cfg.iters}: give at least 7 (the first log interval is warm-up)")
    if cfg.offload_iters < 3 or cfg.largest_iters < 10:
        p.error(f"--offload-iters {cfg.offload_iters} / --largest-iters {cfg.largest_iters}: "
                "give at least 3 / 10")
    cfg.timeout = cfg.timeout or (300.0 if cfg.dry_run else 420.0)
    return cfg


def main(argv=None) -> int:
    cfg = parse_args(argv)
    os.makedirs(cfg.out, exist_ok=True)
    runners = {"dp": part_dp, "sparse": part_sparse, "compress": part_compress,
               "offload": part_offload, "plain-offload": two_gpu_offload.run_part}
    for part in cfg.parts:
        print(f"== {part}", flush=True)
        runners[part](cfg)
    from bench.two_gpu_summary import summarize

    return summarize(cfg.out)


if __name__ == "__main__":
    sys.exit(main())
