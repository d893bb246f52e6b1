"""The memory planner against short `pretrain_gpt.py` runs on one GPU: fsdp2 and DeepSpeed
ZeRO-3 with 1 and 8 micro-batches per step, optimizer offload on and off, the plain engine.

    python -m bench.plan_check --out plan_check.json        # on the GPU machine
    python -m bench.plan_check --only ds-offload-m8         # some rows, by name
    python -m bench.plan_check --with-plain-offload         # also --optimizer-cpu-offload rows
    python -m bench.plan_check --dry-run                    # CPU, a tiny model: the path only
    python -m bench.plan_check --replan a.json b.json       # CPU: plan measured rows again
    python -m bench.plan_check --only ds-offload-2b-m2      # DeepSpeed at 2.2B parameters

Each row runs `pretrain_gpt.py`'s own setup and training (`megazoo.training.run.setup`,
`loop.train`) for a few steps in a child process of its own, so its peaks are its own, on a
small LLaMA shape (16 layers, h 1536, GQA 12/4, ffn 4096: 0.41B parameters with the default
corpus's 2,048-token vocabulary), s 1024, micro-batch 2, bf16, full recompute. Measured:
`torch.cuda.max_memory_allocated` over the whole run (the model's build included, what the run
logs), the same after setup only (the build and the engine's start), `max_memory_reserved`,
and the peak host RSS (ru_maxrss, bytes), with the host's phases (`bench/host_probe.py`:
VmRSS, VmHWM and torch's pinned bytes after the build, the engine's start and each step).
Row `ds-offload-2b-m2` is DeepSpeed + offload on a 2.2B LLaMA (the issue's 5.2B blocks, 10 of
them: h 4096, GQA 32/8, ffn 14336): two sub-groups of 1.09e9 elements, whose pinned fp32
gradients round up to twice their size (8.6 GB each). Planned (`megazoo.plan.estimate_memory` of the same
flags, vocabulary 2,048): `peak_allocated` (training or build, whichever is larger), `build_peak`,
`gpu_total` less the CUDA context against reserved, and `host_per_gpu` (engines without
offload plan no host bytes: '-'). error = planned / measured - 1; the target is 5%.
The --optimizer-cpu-offload rows need an engine that implements the flag (opt in).
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time

from bench.common import (RESULT, failure_line, module_command, print_table, results,
                          run_command, write_json)
from bench.host_probe import recording

SHAPE = ["--family", "llama", "--num-layers", "16", "--hidden-size", "1536",
         "--num-attention-heads", "12", "--num-key-value-heads", "4", "--ffn-hidden-size", "4096",
         "--max-position-embeddings", "1024", "--seq-length", "1024", "--micro-batch-size", "2",
         "--bf16", "--recompute", "full"]
TINY = ["--family", "llama", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--num-key-value-heads", "2", "--ffn-hidden-size", "128",
        "--max-position-embeddings", "64", "--seq-length", "64", "--micro-batch-size", "2",
        "--recompute", "full", "--cpu-threads", "1"]
RUN = ["--train-iters", "3", "--log-interval", "1", "--eval-iters", "0", "--generate-tokens", "0",
       "--save", "", "--no-plot-curves", "--peak-tflops", "1000", "--no-progress",
       "--lr-warmup-iters", "0"]
FSDP2 = ["--zero-impl", "fsdp2", "--zero-stage", "3"]
DS = ["--deepspeed", "--zero-stage", "3"]
OFFLOAD = ["--offload-optimizer", "cpu"]
MID = ["--num-layers", "10", "--hidden-size", "4096", "--num-attention-heads", "32",
       "--num-key-value-heads", "8", "--ffn-hidden-size", "14336"]  # after SHAPE: these win
# name -> (engine flags, micro-batches per step); most telling first (a sweep may be cut short)
ROWS = {
    "ds-offload-m8": (DS + OFFLOAD, 8), "ds-offload-2b-m2": (DS + OFFLOAD, 2),
    "fsdp2-offload-m1": (FSDP2 + OFFLOAD, 1), "ds-m8": (DS, 8), "fsdp2-m8": (FSDP2, 8),
    "plain-m8": ([], 8), "ds-offload-m1": (DS + OFFLOAD, 1), "fsdp2-offload-m8": (FSDP2 + OFFLOAD, 8),
}
PLAIN_OFFLOAD = {
    "plain-offload-m8": (["--optimizer-cpu-offload"], 8),
    "plain-offload-half-bf16grads-m8": (["--optimizer-cpu-offload", "--optimizer-offload-fraction",
                                         "0.5", "--accumulate-grads-in-bf16"], 8),
}
VOCAB = 2048  # the default corpus's tokenizer


def flags_of(name: str, dry_run: bool) -> list[str]:
    engine, m = {**ROWS, **PLAIN_OFFLOAD}[name]
    shape = TINY if dry_run else SHAPE
    if "-2b-" in name and not dry_run:
        shape = shape + MID
    return shape + engine + ["--global-batch-size", str(2 * m)] + RUN


def planned(flags: list[str]) -> dict:
    """The planner's numbers for the run `flags` describe (CPU arithmetic)."""
    import dataclasses

    from megazoo.plan import GB, RUNTIME_BYTES, estimate_memory
    from megazoo.config.flags import parse_args

    args = parse_args(flags)
    args.model = dataclasses.replace(args.model, vocab_size=VOCAB)
    est = estimate_memory(args)
    return {"plan_peak_gb": est.peak_allocated / GB, "plan_build_gb": est.build_peak / GB,
            "plan_reserved_gb": (est.gpu_total - RUNTIME_BYTES) / GB,
            "plan_host_gb": est.host_per_gpu / GB if est.host_per_gpu else None,
            "plan_parts_gb": {k: getattr(est, k) / GB for k in
                              ("parameters", "gradients", "optimizer_states", "activations",
                               "communication_buffers")}}


def child(name: str, dry_run: bool) -> None:
    """Run one row's setup and training here; print its measurements as a RESULT line."""
    import torch

    from megazoo.config.flags import parse_args
    from megazoo.training.loop import train
    from megazoo.training.run import setup

    cuda = torch.cuda.is_available()
    mem = (lambda: torch.cuda.max_memory_allocated() / 1e9) if cuda else (lambda: None)
    rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # noqa: E731
    with recording([]) as phases:
        run = setup(parse_args(flags_of(name, dry_run)), print_fn=lambda *a, **k: None)
        after_setup = {"setup_alloc_gb": mem(), "setup_rss_gb": rss()}
        out = train(run)
    row = {"name": name, **after_setup, "peak_alloc_gb": mem(), "host_rss_gb": rss(),
           "loss_first": out["losses"][0], "loss_last": out["losses"][-1], "host_phases": phases}
    if cuda:
        row["peak_reserved_gb"] = torch.cuda.max_memory_reserved() / 1e9
    print(RESULT + json.dumps(row), flush=True)
    if torch.distributed.is_initialized() and torch.distributed.get_backend() != "gloo":
        torch.distributed.destroy_process_group()


def _error(plan, measured) -> float | None:
    return None if plan is None or not measured else plan / measured - 1


def _errors(row: dict) -> None:
    row["err_peak"] = _error(row["plan_peak_gb"], row["peak_alloc_gb"])
    row["err_build"] = _error(row["plan_build_gb"], row["setup_alloc_gb"])
    row["err_reserved"] = _error(row["plan_reserved_gb"], row.get("peak_reserved_gb"))
    row["err_host"] = _error(row["plan_host_gb"], row["host_rss_gb"])


def replan(paths: list[str]) -> list[dict]:
    """The measured rows of earlier sweeps (JSON files; a later file's row replaces an
    earlier one of the same name), planned again by today's planner."""
    rows = {}
    for path in paths:
        with open(path) as f:
            for row in json.load(f)["rows"]:
                if row.get("status") == "ok":
                    row.update(planned(flags_of(row["name"], False)))
                    _errors(row)
                    rows[row["name"]] = row
    return list(rows.values())


def sweep(names: list[str], dry_run: bool, timeout: float, budget: float) -> list[dict]:
    """Each row in its own child process, until `budget` seconds have passed."""
    rows, start = [], time.monotonic()
    for name in names:
        left = budget - (time.monotonic() - start)
        if left < 20:
            rows.append({"name": name, "status": "not run: budget spent"})
            continue
        cmd = module_command("plan_check") + ["--child", name] + (["--dry-run"] if dry_run else [])
        code, out, err = run_command(cmd, timeout=min(timeout, left))
        row = {"name": name, **planned(flags_of(name, dry_run))}
        got = results(out)
        if code != 0 or not got:
            row["status"] = "timed out" if code is None else f"failed: {failure_line(err)}"
        else:
            row.update(got[-1], status="ok")
            _errors(row)
        rows.append(row)
        print(f"{name}: {row['status']} ({time.monotonic() - start:.0f} s)", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--only", nargs="+", default=None, help="these rows only")
    parser.add_argument("--with-plain-offload", action="store_true",
                        help="also the plain engine's --optimizer-cpu-offload rows")
    parser.add_argument("--dry-run", action="store_true", help="tiny model on the CPU")
    parser.add_argument("--timeout", type=float, default=90, help="seconds per row")
    parser.add_argument("--budget", type=float, default=220, help="seconds for the sweep")
    parser.add_argument("--replan", nargs="+", default=None, metavar="JSON",
                        help="plan the measured rows of these --out files again (CPU)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.child:
        child(ns.child, ns.dry_run)
        return 0
    names = ns.only or list(ROWS) + (list(PLAIN_OFFLOAD) if ns.with_plain_offload else [])
    unknown = [n for n in names if n not in {**ROWS, **PLAIN_OFFLOAD}]
    if unknown:
        print(f"error: unknown row {unknown[0]}; rows: {', '.join({**ROWS, **PLAIN_OFFLOAD})}",
              file=sys.stderr)
        return 2
    if not ns.replan:
        rows = sweep(names, ns.dry_run, ns.timeout, ns.budget)
    else:
        try:
            rows = replan(ns.replan)
        except (OSError, ValueError, KeyError) as exc:  # not a file this benchmark wrote
            print(f"error: --replan {' '.join(ns.replan)}: {exc}: pass --out files of "
                  "bench/plan_check.py", file=sys.stderr)
            return 2
    print_table(rows, ["name", "peak_alloc_gb", "plan_peak_gb", "err_peak", "setup_alloc_gb",
                       "plan_build_gb", "peak_reserved_gb", "plan_reserved_gb", "err_reserved",
                       "setup_rss_gb", "host_rss_gb", "plan_host_gb", "err_host", "status"])
    write_json(ns.out, {"rows": rows, "shape": TINY if ns.dry_run else SHAPE, "run": RUN})
    return 0


if __name__ == "__main__":
    sys.exit(main())
