"""What checkpoint integrity costs: CRC-32 and the inf / nan test against save and load time.

    PYTHONPATH=$PWD python bench/checksum_bench.py [--layers 12 --hidden 1024] [--dir /tmp]

Prints the raw rates (GB/s) of zlib.crc32, blake2b, the sum-first non-finite test and
`isfinite(t).all()` on 256 MB, then `save_checkpoint` (weights + two fp32 moments, as
training writes) and `load_model_weights` (with the moments) of a GPT, each timed with the
checks on and with them stubbed out; the difference is the cost of the checks.
"""
from __future__ import annotations

import argparse
import hashlib
import shutil
import tempfile
import zlib
from unittest import mock

import torch

from megazoo.checkpoint import files, load_model_weights, save_checkpoint
from megazoo.models import ModelConfig, build_model

from common import time_ms


CPU = torch.device("cpu")


def timed(fn, repeats: int = 5) -> float:
    """Fastest of `repeats` calls after one warm-up, seconds: on a host shared with other
    jobs the fastest call is the one least disturbed by them."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        best = min(best, time_ms(fn, CPU, warmup=0, iters=1) / 1e3)
    return best


def rate(fn, nbytes: int, repeats: int = 5) -> float:
    """GB/s of `fn` over `nbytes`."""
    return nbytes / timed(fn, repeats) / 1e9


def raw_rates() -> None:
    t = torch.randn(64 * 2 ** 20)
    raw = files.tensor_bytes(t)
    n = t.numel() * 4
    print(f"zlib.crc32          {rate(lambda: zlib.crc32(raw), n):6.2f} GB/s")
    print(f"blake2b             {rate(lambda: hashlib.blake2b(raw).digest(), n, 2):6.2f} GB/s")
    print(f"nonfinite_count     {rate(lambda: files.nonfinite_count(t), n):6.2f} GB/s")
    print(f"isfinite(t).all()   {rate(lambda: bool(torch.isfinite(t).all()), n):6.2f} GB/s")


def checkpoint_times(layers: int, hidden: int, folder: str) -> None:
    cfg = ModelConfig(family="gpt", num_layers=layers, hidden_size=hidden,
                      num_attention_heads=16, vocab_size=32000, max_position_embeddings=2048)
    model = build_model(cfg, None, device="cpu", seed=0)
    aux = {p: {n: torch.randn_like(w) * 1e-3 for n, w in model.named_parameters()}
           for p in ("exp_avg", "exp_avg_sq")}
    gbytes = 3 * sum(w.numel() * 4 for w in model.parameters()) / 1e9
    path = f"{folder}/ck"

    def save():
        shutil.rmtree(path, ignore_errors=True)
        save_checkpoint(model, path, aux=aux)

    def load(checks: bool):
        load_model_weights(model, path, aux_prefixes=("exp_avg", "exp_avg_sq"),
                           verify_checksums=checks, allow_nonfinite=not checks)

    on_save, on_load = timed(save), timed(lambda: load(True))
    off_load = timed(lambda: load(False))
    with mock.patch.object(files.zlib, "crc32", lambda b: 0), \
            mock.patch.object(files, "nonfinite_count", lambda t: 0):
        off_save = timed(save)
    print(f"checkpoint {gbytes:.2f} GB (weights + 2 moments, fp32), in {folder}")
    for what, on, bare in (("save", on_save, off_save), ("load", on_load, off_load)):
        print(f"{what}: {on:.2f} s with checks, {bare:.2f} s without: "
              f"{100 * (on - bare) / on:+.1f}% of the {what} time")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp folder)")
    args = parser.parse_args()
    raw_rates()
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        checkpoint_times(args.layers, args.hidden, folder)


if __name__ == "__main__":
    main()
