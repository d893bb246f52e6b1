"""megazoo and megatron-core side by side at every layout of one 2- or 4-GPU machine, one call.

    source .gpu/setup.sh && python -m bench.multi_gpu_sweep --out $OUT/sweep     # all GPUs
    python -m bench.multi_gpu_sweep --dry-run --out /tmp/sweep                  # CPU, gloo, tiny

For each shape (gpt-1.3b: 24 x 2048, 16 heads, s 2048, micro-batch 4, global batch 64;
llama-8b-8l: 8 x 4096, 32 / 8 heads, ffn 14336, s 4096, micro-batch 1, global batch 32), bf16,
the default corpus's 2,048-token vocabulary: megazoo's `pretrain_gpt.py` (distributed
optimizer, overlapped reduction and gather, `bench.run_compare.run_variant`) and megatron-core's
local spec (`bench.mcore_peer`) on one GPU, then at every layout the machine's N GPUs allow
(`layouts`): dp N, tp + SP, tp x dp, tp x pp interleaved, pp interleaved, and megazoo's own
Ulysses sp and ZeRO-3 (FSDP2, and DeepSpeed where it imports). Every row's tokens/s is the
median of its iterations after warm-up; scaling = tokens/s / (N x the same program's one-GPU
tokens/s in this run); `vs mcore` = megazoo's tokens/s / megatron-core's at the same layout.
Writes OUT/<shape>.json after every row (a later call adds to it) and prints the tables last.
NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")

from bench.common import module_command, print_table, torchrun, write_json  # noqa: E402
from bench.mcore_peer import SHAPES  # noqa: E402
from bench.run_compare import run_variant  # noqa: E402
from bench.train_bench import model_flags  # noqa: E402
from bench.two_gpu import child_json  # noqa: E402

BATCHES = {"gpt-1.3b": 64, "llama-8b-8l": 32, "tiny": 8, "tiny-llama": 8}
DISTOPT = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]


def layouts(n: int, layers: int, vpp: int = 2) -> dict:
    """{row name: (tp, pp, vpp, megazoo-only flags or None)} for N GPUs: megatron-core runs
    the rows whose last item is None too (the same tp / pp / vpp, SP where tp > 1). The
    pipeline rows hold `vpp` virtual stages per rank (named in the row where it is not 2)."""
    rows = {f"dp{n}": (1, 1, 1, None)}
    chunks = "" if vpp == 2 else f" vpp{vpp}"
    for tp in (t for t in (2, 4) if t <= n):
        rows[f"tp{tp}+SP" + (f" x dp{n // tp}" if tp < n else "")] = (tp, 1, 1, None)
    if n == 4 and layers % (2 * vpp) == 0:
        rows["tp2+SP x pp2 interleaved" + chunks] = (2, 2, vpp, None)
    if layers % (n * vpp) == 0:
        rows[f"pp{n} interleaved" + chunks] = (1, n, vpp, None)
    rows[f"Ulysses sp{n}"] = (1, 1, 1, ["--ds-sequence-parallel-size", str(n)])
    rows[f"ZeRO-3 fsdp2 dp{n}"] = (1, 1, 1, ["--zero-impl", "fsdp2", "--zero-stage", "3"])
    if importlib.util.find_spec("deepspeed") is not None:
        rows[f"ZeRO-3 deepspeed dp{n}"] = (1, 1, 1, ["--deepspeed", "--zero-stage", "3"])
    return rows


def megazoo_flags(shape_name: str, cfg, tp: int, pp: int, vpp: int, own) -> list[str]:
    shape = SHAPES[shape_name]
    flags = model_flags(shape) + [
        "--micro-batch-size", str(shape["micro"]), "--global-batch-size",
        str(BATCHES[shape_name]), "--train-iters", str(cfg.iters),
        "--log-interval", str(cfg.log_interval), "--eval-iters", "0"]
    flags += [] if cfg.dry_run else ["--bf16"]
    zero = own is not None and bool({"--zero-impl", "--deepspeed"} & set(own))
    if cfg.cuda_graph and not zero:  # what --enable-cuda-graph captures: the plain engine
        flags += ["--enable-cuda-graph"]
    if own is not None:  # ZeRO engines shard and reduce by themselves
        given = cfg.fsdp_blocks_per_unit is not None and "fsdp2" in own
        units = ["--fsdp-blocks-per-unit", str(cfg.fsdp_blocks_per_unit)] if given else []
        return flags + ([] if zero else DISTOPT) + own + units
    flags += DISTOPT
    if tp > 1:
        flags += ["--tensor-model-parallel-size", str(tp), "--sequence-parallel"]
        flags += ["--tp-comm-overlap"] if cfg.tp_comm_overlap else []
    if pp > 1:
        per = shape["layers"] // (pp * vpp)
        flags += ["--pipeline-model-parallel-size", str(pp),
                  "--num-layers-per-virtual-pipeline-stage", str(per)]
    return flags


def mcore_row(shape_name: str, cfg, nproc: int, tp: int, pp: int, vpp: int) -> dict:
    path = os.path.join(cfg.out, "mcore_row.json")
    cmd = module_command("mcore_peer", torchrun(nproc)) + [  # one GPU too: env:// rendezvous
        "--shape", shape_name, "--tp", str(tp), "--pp", str(pp), "--vpp", str(vpp),
        "--global-batch", str(BATCHES[shape_name]), "--out", path]
    cmd += (["--sp"] if tp > 1 else []) + (["--dry-run"] if cfg.dry_run else [])
    return child_json(cmd, path, cfg.timeout)


def run_shape(shape_name: str, cfg) -> dict:
    path = os.path.join(cfg.out, f"{shape_name}.json")
    saved = json.load(open(path)) if os.path.exists(path) else {}
    saved.update(shape=shape_name, gpus=cfg.gpus, global_batch=BATCHES[shape_name])
    rows = saved.setdefault("rows", {})
    logs = os.path.join(cfg.out, "logs")
    os.makedirs(logs, exist_ok=True)
    plan = {"one GPU": (1, 1, 1, 1, None)}
    rows_here = layouts(cfg.gpus, SHAPES[shape_name]["layers"], cfg.vpp)
    plan.update({k: (cfg.gpus, *v) for k, v in rows_here.items()})
    for name, (nproc, tp, pp, vpp, own) in plan.items():
        if cfg.rows and name not in cfg.rows:
            continue
        key = f"{shape_name} {name}".replace(" ", "_").replace("+", "_")
        flags = megazoo_flags(shape_name, cfg, tp, pp, vpp, own)
        row = {"gpus": nproc, "megazoo": run_variant(key, flags, logs, cfg.timeout, nproc)}
        if own is None and cfg.peer:
            row["mcore"] = mcore_row(shape_name, cfg, nproc, tp, pp, vpp)
        rows[name] = row
        write_json(path, saved)
    return saved


def table(saved: dict) -> list[dict]:
    """Rows with scaling against N x one GPU and the ratio to megatron-core."""
    rows = saved.get("rows", {})
    one = rows.get("one GPU", {})
    base = {k: (one.get(k) or {}).get("tokens_per_s") for k in ("megazoo", "mcore")}
    out = []
    for name, row in rows.items():
        mz, mc = ((row.get(k) or {}).get("tokens_per_s") for k in ("megazoo", "mcore"))
        n = row["gpus"]
        out.append({"layout": name, "GPUs": n, "megazoo tok/s": mz,
                    "scaling": mz / (n * base["megazoo"]) if mz and base["megazoo"] else None,
                    "mcore tok/s": mc,
                    "mcore scaling": mc / (n * base["mcore"]) if mc and base["mcore"] else None,
                    "vs mcore": mz / mc if mz and mc else None,
                    "error": (row.get("megazoo") or {}).get("error") or (row.get("mcore") or {}).get("error")})
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for the JSON and the logs")
    p.add_argument("--shapes", nargs="+", default=["gpt-1.3b", "llama-8b-8l"],
                   choices=["gpt-1.3b", "llama-8b-8l"])
    p.add_argument("--gpus", type=int, default=None, help="GPUs per row (default: all visible)")
    p.add_argument("--rows", nargs="*", default=None, help="only these row names")
    p.add_argument("--vpp", type=int, default=2,
                   help="virtual pipeline stages per rank in the pipeline rows")
    p.add_argument("--iters", type=int, default=12, help="pretrain_gpt.py iterations per row")
    p.add_argument("--timeout", type=float, default=None, help="seconds per child (default 420)")
    p.add_argument("--dry-run", action="store_true", help="CPU, gloo, 2 ranks, tiny shapes")
    p.add_argument("--cuda-graph", action="store_true",
                   help="megazoo's rows with the plain engine add --enable-cuda-graph")
    p.add_argument("--tp-comm-overlap", action="store_true",
                   help="megazoo's tensor-parallel rows add --tp-comm-overlap")
    p.add_argument("--fsdp-blocks-per-unit", type=int, default=None,
                   help="megazoo's FSDP2 rows add --fsdp-blocks-per-unit N (default: theirs)")
    p.add_argument("--no-peer", dest="peer", action="store_false",
                   help="megazoo's rows only (megatron-core's were measured in another call)")
    cfg = p.parse_args(argv)
    if cfg.dry_run:
        cfg.shapes = ["tiny" if s.startswith("gpt") else "tiny-llama" for s in cfg.shapes]
        cfg.gpus, cfg.iters = cfg.gpus or 2, 6
    else:
        import torch

        cfg.gpus = cfg.gpus or torch.cuda.device_count()
    if cfg.gpus not in (2, 4):
        p.error(f"--gpus {cfg.gpus}: the sweep runs on 2 or 4 GPUs")
    if cfg.vpp < 2:
        p.error(f"--vpp {cfg.vpp}: the pipeline rows are interleaved, 2 or more per rank")
    cfg.log_interval = max(1, cfg.iters // 4)  # the first interval is warm-up
    cfg.timeout = cfg.timeout or (300.0 if cfg.dry_run else 420.0)
    return cfg


def main(argv=None) -> int:
    cfg = parse_args(argv)
    os.makedirs(cfg.out, exist_ok=True)
    results = {s: run_shape(s, cfg) for s in cfg.shapes}
    for shape, saved in results.items():
        print(f"\n== {shape}, {saved['gpus']} GPUs, global batch {saved['global_batch']}")
        print_table(table(saved), ["layout", "GPUs", "megazoo tok/s", "scaling", "mcore tok/s",
                                   "mcore scaling", "vs mcore", "error"])
    write_json(os.path.join(cfg.out, "summary.json"), {s: table(v) for s, v in results.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
