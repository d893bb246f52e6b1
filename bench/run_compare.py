"""Train the same run several ways through `pretrain_gpt.py` and compare what a user would:
tokens/s, the training and validation loss at the end, peak GPU memory, and the loss curves.

    python -m bench.run_compare --common "--model gpt-350m --bf16 --train-iters 500" \
        --variant bf16= --variant fp8="--fp8-format hybrid" --logs runs/ --out fp8_loss.json
    python -m bench.run_compare --dry-run       # two tiny CPU runs: checks the plumbing
    python -m bench.run_compare --nproc 2 ...   # each variant on 2 ranks through torchrun

Each variant is one `pretrain_gpt.py` process (its own peak memory) with the `--common` flags
followed by its own; the run's `--log-json` goes to `--logs/NAME.jsonl`, so
`python -m megazoo.plot runs/*.jsonl --out curves.png` overlays the curves (done here too when
`--plot` is given). tokens/s is the median of the logged intervals after the first (which holds
compilation and allocator warm-up); `vs_first` divides by the first variant's.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile

from bench.common import REPO, child_env, failure_line, print_table, run_command, torchrun, write_json

DRY_FLAGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
             "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 4 "
             "--train-iters 8 --log-interval 2 --eval-interval 4 --eval-iters 1")


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, sep, flags = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: write NAME=FLAGS (FLAGS may be empty)")
    return name, shlex.split(flags)


def summarize(log_path: str) -> dict:
    """tokens/s, losses, peak GPU memory and host RSS (rank 0's) from one run's --log-json."""
    with open(log_path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    steps = [r for r in records if "tokens_per_s" in r]
    valid = [r for r in records if "valid_loss" in r]
    if not steps:
        raise RuntimeError(f"{log_path} has no training records")
    rates = [r["tokens_per_s"] for r in steps[1:]] or [steps[-1]["tokens_per_s"]]
    out = {"iterations": steps[-1]["iteration"], "tokens_per_s": statistics.median(rates),
           "train_loss": steps[-1]["loss"]}
    if valid:
        out["valid_loss"] = valid[-1]["valid_loss"]
    for key, name in (("gpu_max_allocated_gb", "peak_gb"), ("host_rss_gb", "host_rss_gb")):
        peaks = [r[key] for r in steps if key in r]
        if peaks:
            out[name] = max(peaks)
    out["losses"] = [r["loss"] for r in steps]
    return out


def run_variant(name: str, flags: list[str], logs: str, timeout: float | None,
                nproc: int = 1, env: dict | None = None,
                script: str = "pretrain_gpt.py") -> dict:
    """One pretrain_gpt.py run (through torchrun with `nproc` ranks when > 1), summarized;
    `env`: variables set for it on top of this process's environment; `script` (relative to
    the repository) may be another entry point taking its flags."""
    log = os.path.join(logs, f"{name}.jsonl")
    if os.path.exists(log):
        os.remove(log)
    launcher = torchrun(nproc) if nproc > 1 else [sys.executable]
    cmd = [*launcher, os.path.join(REPO, script), "--save", "",
           "--generate-tokens", "0", "--no-progress", "--log-json", os.path.abspath(log),
           "--data-cache-path", os.path.join(REPO, "data_cache"), *flags]
    print(f"[{name}] {shlex.join(cmd[1:])}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        rc, _, err = run_command(cmd, timeout, cwd=tmp, env=child_env(**(env or {})))
    error = None if rc == 0 else (
        failure_line(err) if rc is not None else
        f"stopped after {timeout:.0f} s (--timeout); the row is what was logged")
    row = {"variant": name, "nproc": nproc}
    try:
        row.update(summarize(log))
    except (OSError, RuntimeError) as exc:
        error = error or str(exc)
    if error:
        row["error"] = " ".join(error.split())[-300:]
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--common", default="", help="pretrain_gpt.py flags every variant gets")
    p.add_argument("--variant", type=parse_variant, action="append", default=[],
                   help="NAME=FLAGS, repeatable; the first is the reference")
    p.add_argument("--logs", default="run_compare_logs", help="folder for each run's log JSON")
    p.add_argument("--timeout", type=float, default=None, help="seconds per variant")
    p.add_argument("--plot", default=None, help="also write the overlaid curves to this PNG")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--nproc", type=int, default=1,
                   help="ranks per variant: > 1 launches each through torchrun (data parallel "
                        "unless the flags say otherwise; tokens/s counts all ranks)")
    p.add_argument("--dry-run", action="store_true", help="two tiny CPU runs")
    args = p.parse_args(argv)
    common = shlex.split(DRY_FLAGS if args.dry_run else args.common)
    variants = args.variant or ([("a", []), ("b", ["--lr", "5e-4"])] if args.dry_run else [])
    if not variants:
        p.error("give at least one --variant NAME=FLAGS")
    if args.nproc < 1:
        p.error(f"--nproc {args.nproc}: give 1 or more ranks")
    os.makedirs(args.logs, exist_ok=True)
    rows = [run_variant(name, common + flags, args.logs, args.timeout, args.nproc)
            for name, flags in variants]
    first = rows[0].get("tokens_per_s")
    for row in rows:
        if first and "tokens_per_s" in row:
            row["vs_first"] = row["tokens_per_s"] / first
    print_table(rows, ["variant", "iterations", "tokens_per_s", "vs_first", "train_loss",
                       "valid_loss", "peak_gb", "error"])
    write_json(args.out, {"common": args.common, "variants": [[n, shlex.join(f)] for n, f in variants],
                          "rows": rows})
    if args.plot:
        from megazoo.plot import main as plot_main
        plot_main([os.path.join(args.logs, f"{n}.jsonl") for n, _ in variants] + ["--out", args.plot])
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
