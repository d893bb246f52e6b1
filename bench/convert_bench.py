"""HF -> megazoo conversion: peak memory and throughput of the streaming converter (CPU).

    python -m bench.convert_bench                 # llama-7b shapes, fp16 on disk (~13.5 GB)
    python -m bench.convert_bench --small         # a tiny llama: a dry run in seconds
    python -m bench.convert_bench --tp 2 --pp 2 --dtype bf16 --dir /scratch/bench

Writes a random LLaMA in Hugging Face format (config.json + safetensors shards of <= 5 GB and
their index), tensor by tensor with megazoo's streaming safetensors writer, so this process
never holds more than one tensor; then runs `checkpoints_tools/hf_to_megazoo.py` as a child
process and reports, as one JSON line: the child's peak RSS (ru_maxrss from wait4; the random
model is written by another child so that the parent, whose RSS a child inherits in
ru_maxrss, stays small), the RSS of a child that only imports the converter, the
largest tensor, the bytes converted, wall time and GB/s (bytes read / wall time, including
the child's start-up; core_GB_per_s: over the conversion time the CLI reports). The
streaming claim is peak_over_startup_GB <= largest tensor + ~1 GB. Needs twice the model
size free on disk; the temp directory is deleted unless --keep.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from bench.common import REPO, child_env
from megazoo.checkpoint.files import parse_dtype
from megazoo.convert import ADAPTERS, hf_config
from megazoo.convert.api import hf_shapes
from megazoo.convert.hf_io import write_hf_weights
from megazoo.models import ModelConfig, resolve_config

SMALL = ModelConfig(family="llama", num_layers=2, hidden_size=256, num_attention_heads=8,
                    num_key_value_heads=4, ffn_hidden_size=688, vocab_size=1000,
                    max_position_embeddings=256)


def write_random_hf(cfg: ModelConfig, directory: str, dtype: torch.dtype, seed: int = 0) -> dict:
    """A random HF LLaMA of `cfg`'s shapes; one tensor in memory at a time."""
    shapes = hf_shapes(cfg, ADAPTERS["llama"].rules(cfg))
    gen = torch.Generator().manual_seed(seed)
    tensors = ((key, torch.randn(shape, generator=gen, dtype=torch.float32).mul_(0.02).to(dtype))
               for key, shape in shapes.items())
    write_hf_weights(directory, {k: (dtype, s) for k, s in shapes.items()}, tensors)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf_config(cfg, dtype), f, indent=1)
    elements = [torch.Size(s).numel() for s in shapes.values()]
    size = torch.empty((), dtype=dtype).element_size()
    return {"tensors": len(shapes), "bytes": sum(elements) * size, "largest_bytes": max(elements) * size}


def _write_in_child(cfg: ModelConfig, directory: str, dtype: torch.dtype) -> dict:
    """write_random_hf in a spawned process: a child inherits its parent's RSS high-water
    mark at fork (Linux counts it in ru_maxrss), so the parent must stay small."""
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=_write_job, args=(cfg, directory, dtype))
    child.start()
    child.join()
    if child.exitcode != 0:
        raise SystemExit(f"writing the random model failed (exit code {child.exitcode})")
    with open(os.path.join(directory, "bench_info.json")) as f:
        return json.load(f)


def _write_job(cfg: ModelConfig, directory: str, dtype: torch.dtype) -> None:
    info = write_random_hf(cfg, directory, dtype)
    with open(os.path.join(directory, "bench_info.json"), "w") as f:
        json.dump(info, f)


def _wait(cmd: list[str]) -> tuple[float, str, int]:
    """Run cmd; return (wall seconds, stdout, peak RSS bytes of that child)."""
    start = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=child_env())
    stdout = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"{cmd[1]} failed with exit code {code}")
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: KiB on Linux, bytes on macOS
    return wall, stdout, usage.ru_maxrss * scale


def run_converter(hf_dir: str, out: str, args) -> tuple[float, float, int, int]:
    """Run the CLI in a child -> (wall s, conversion s as the CLI reports it, peak RSS bytes,
    peak RSS bytes of a child that only imports the converter: the start-up baseline)."""
    cmd = [sys.executable, os.path.join(REPO, "checkpoints_tools", "hf_to_megazoo.py"),
           "--hf-dir", hf_dir, "--out", out, "--tp", str(args.tp), "--pp", str(args.pp)]
    wall, stdout, peak = _wait(cmd)
    found = re.search(r"in ([0-9.]+) s", stdout)
    _, _, baseline = _wait([sys.executable, "-c", "import megazoo.convert.api, safetensors.torch"])
    return wall, float(found.group(1)) if found else wall, peak, baseline


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="a tiny llama instead of llama-7b")
    parser.add_argument("--dtype", default="fp16", help="on-disk dtype: fp16 or bf16")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dir", default=None, help="where to put the temp directory")
    parser.add_argument("--keep", action="store_true", help="keep the written files")
    args = parser.parse_args(argv)
    cfg = SMALL if args.small else resolve_config("llama-7b")
    dtype = parse_dtype(args.dtype)
    root = tempfile.mkdtemp(prefix="convert_bench-", dir=args.dir)
    try:
        hf_dir, out = os.path.join(root, "hf"), os.path.join(root, "megazoo")
        os.makedirs(hf_dir)
        start = time.perf_counter()
        info = _write_in_child(cfg, hf_dir, dtype)
        info["write_s"] = round(time.perf_counter() - start, 2)
        wall, core, peak, baseline = run_converter(hf_dir, out, args)
        gb = 1e9
        result = {"model": "small-llama" if args.small else "llama-7b", "dtype": str(dtype),
                  "tp": args.tp, "pp": args.pp, **info, "convert_s": round(wall, 2),
                  "GB_per_s": round(info["bytes"] / gb / wall, 3),
                  "convert_core_s": core, "core_GB_per_s": round(info["bytes"] / gb / max(core, 1e-3), 3),
                  "peak_rss_GB": round(peak / gb, 3), "startup_rss_GB": round(baseline / gb, 3),
                  "peak_over_startup_GB": round((peak - baseline) / gb, 3),
                  "largest_tensor_GB": round(info["largest_bytes"] / gb, 3),
                  "parent_peak_rss_GB": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                              * 1024 / gb, 3)}
        print(json.dumps(result))
        return result
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
