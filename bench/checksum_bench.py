"""What checkpoint integrity costs: the checksum and the inf / nan test against save and load.

    python -m bench.checksum_bench [--layers 6 --hidden 1024] [--dir /tmp] [--repeats 5]

Prints the raw rates (GB/s, one thread) of each checksum megazoo can record (xxh3_64,
crc32), blake2b for scale, the sum-first non-finite test and `isfinite(t).all()` on 256 MB;
then, per checksum, `save_checkpoint` (weights + two fp32 moments, as training writes) and
`load_model_weights` (with the moments) of a GPT, each timed three ways: all checks on, the
checksum stubbed out (the non-finite test alone), and every check stubbed out. The
differences are the cost of the checks, as a share of the time with them.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import shutil
import tempfile
from unittest import mock

import torch

from bench.common import time_ms
from megazoo.checkpoint import checksums, files, load_model_weights, save_checkpoint
from megazoo.models import ModelConfig, build_model

CPU = torch.device("cpu")
AUX = ("exp_avg", "exp_avg_sq")


def timed(fn, repeats: int) -> float:
    """Fastest of `repeats` calls after one warm-up, seconds: on a host shared with other
    jobs the fastest call is the one least disturbed by them."""
    return interleaved([fn], repeats)[0]


def raw_rates(repeats: int) -> None:
    t = torch.randn(64 * 2 ** 20)
    raw, n = files.tensor_bytes(t), t.numel() * 4
    rows = [(name, lambda a=name: checksums.digest(raw, a)) for name in checksums.ALGORITHMS
            if name != checksums.XXH3 or checksums.xxhash is not None]
    rows += [("blake2b", lambda: hashlib.blake2b(raw).digest()),
             ("nonfinite_count", lambda: files.nonfinite_count(t)),
             ("isfinite(t).all()", lambda: bool(torch.isfinite(t).all()))]
    for name, fn in rows:
        print(f"{name:20s}{n / timed(fn, repeats) / 1e9:6.2f} GB/s")


def stubbed(hash_too: bool, finite_too: bool):
    """A context in which the checksum and / or the non-finite test cost nothing."""
    stack = contextlib.ExitStack()
    if hash_too:
        stack.enter_context(mock.patch.object(files, "digest", lambda raw, algorithm: "0"))
    if finite_too:
        stack.enter_context(mock.patch.object(files, "nonfinite_count", lambda t: 0))
    return stack


def interleaved(fns: list, repeats: int) -> list[float]:
    """Fastest of `repeats` calls of each of `fns`, seconds, the calls taken in rounds (one of
    each per round, after one warm-up round): a burst of load from other jobs on the host
    then slows every variant alike instead of the one measured at the time."""
    best = [float("inf")] * len(fns)
    for round_ in range(repeats + 1):
        for i, fn in enumerate(fns):
            t = time_ms(fn, CPU, warmup=0, iters=1) / 1e3
            best[i] = best[i] if round_ == 0 else min(best[i], t)
    return best


def checkpoint_times(model, aux, path: str, algorithm: str, repeats: int) -> dict:
    """{"save"|"load": (all checks, the non-finite test alone, no check)} seconds, the
    checkpoint written with `algorithm`."""
    loaded = f"{path}-load"

    def save(hash_off: bool, finite_off: bool):
        def run():
            shutil.rmtree(path, ignore_errors=True)
            with stubbed(hash_off, finite_off):
                save_checkpoint(model, path, aux=aux)
        return run

    def load(verify: bool, finite: bool):
        return lambda: load_model_weights(model, loaded, aux_prefixes=AUX,
                                          verify_checksums=verify, allow_nonfinite=not finite)

    hide = mock.patch.object(checksums, "xxhash", None) if algorithm == checksums.CRC32 \
        else contextlib.nullcontext()
    with hide:
        shutil.rmtree(loaded, ignore_errors=True)
        save_checkpoint(model, loaded, aux=aux)  # a checkpoint with real checksums to load
        saves = interleaved([save(False, False), save(True, False), save(True, True)], repeats)
        # Verified tensors skip the non-finite test (their bytes are the finite ones written),
        # so a load pays the checksum alone; unverified, it pays the non-finite test instead.
        loads = interleaved([load(True, True), load(False, True), load(False, False)], repeats)
    shutil.rmtree(loaded)
    return {"save": saves, "load": loads}


def report(algorithm: str, times: dict) -> None:
    for what, (on, no_hash, bare) in times.items():
        print(f"{algorithm:8s} {what}: {on:.3f} s with checks, {no_hash:.3f} s without the "
              f"checksum, {bare:.3f} s without any: checks {100 * (on - bare) / on:+.1f}%, "
              f"checksum {100 * (on - no_hash) / on:+.1f}% of the {what} time")


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp folder)")
    args = parser.parse_args()
    raw_rates(args.repeats)
    cfg = ModelConfig(family="gpt", num_layers=args.layers, hidden_size=args.hidden,
                      num_attention_heads=16, vocab_size=32000, max_position_embeddings=2048)
    model = build_model(cfg, None, device="cpu", seed=0)
    aux = {p: {n: torch.randn_like(w) * 1e-3 for n, w in model.named_parameters()} for p in AUX}
    gbytes = 3 * sum(w.numel() * 4 for w in model.parameters()) / 1e9
    algorithms = [a for a in checksums.ALGORITHMS
                  if a != checksums.XXH3 or checksums.xxhash is not None]
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        print(f"checkpoint {gbytes:.2f} GB (weights + 2 moments, fp32), in {folder}")
        for algorithm in algorithms:
            report(algorithm, checkpoint_times(model, aux, f"{folder}/ck", algorithm,
                                               args.repeats))


if __name__ == "__main__":
    main()
