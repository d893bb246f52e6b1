"""Would Huffman coding shrink the compressed gradient bytes? Measured on a real gradient.

    python -m bench.huffman_measure [--steps 50]

Trains the default pretrain_gpt.py model (one process, CPU) for `--steps` steps, takes the
next step's reduced gradient (the plain engine's flat fp32 buffer), compresses it the way a
dp = 2 run does (1bit / 2bit phase 1: two chunks; topk 0.01), and for each byte stream on
the wire (packed codes, scales, topk values, topk offsets) reports its size, the Shannon
entropy of its bytes, and the exact size of a byte-wise Huffman code of it (code table
included: 256 code lengths). For the topk offsets also the entropy of the sorted offsets'
gaps (the best case of a gap code). Then it times a byte-wise Huffman decoder (table walk in
NumPy over the bit stream; the walk is sequential, so it is a loop) on the largest stream.
Results: bench/README.md ("Huffman coding").
"""
from __future__ import annotations

import argparse
import heapq
import math
import time

import numpy as np
import torch

from megazoo.compress.codecs import BlockCodec, TopKCodec


def huffman_lengths(counts: np.ndarray) -> np.ndarray:
    """Code length of each of 256 byte values (0 for values that never occur)."""
    heap = [(int(c), i, (i,)) for i, c in enumerate(counts) if c]
    lengths = np.zeros(256, dtype=np.int64)
    if len(heap) == 1:
        lengths[heap[0][1]] = 1
        return lengths
    heapq.heapify(heap)
    tie = 256
    while len(heap) > 1:
        c1, _, s1 = heapq.heappop(heap)
        c2, _, s2 = heapq.heappop(heap)
        for sym in s1 + s2:
            lengths[sym] += 1
        heapq.heappush(heap, (c1 + c2, tie, s1 + s2))
        tie += 1
    return lengths


def stream_stats(name: str, data: np.ndarray) -> dict:
    counts = np.bincount(data, minlength=256)
    p = counts[counts > 0] / data.size
    entropy = float(-(p * np.log2(p)).sum())
    coded = int((counts * huffman_lengths(counts)).sum() + 7) // 8 + 256
    return {"stream": name, "bytes": int(data.size), "entropy_bits_per_byte": entropy,
            "huffman_bytes": coded, "huffman_saving_pct": 100.0 * (1 - coded / data.size)}


def trained_gradient(steps: int) -> torch.Tensor:
    from megazoo.config.flags import parse_args
    from megazoo.training.run import setup

    torch.set_num_threads(1)
    run = setup(parse_args(["--save", "", "--no-progress"]), print_fn=lambda *a, **k: None)
    for it in range(steps + 1):
        run.engine.train_step(run.data.train_batch(it, run.state))
    return run.engine.buffers.main_grad.clone()


def streams(grad: torch.Tensor) -> list[tuple[str, np.ndarray]]:
    """The wire byte streams of each algorithm for this gradient (dp = 2 chunking)."""
    out = []
    k = grad.numel() // 2
    x = grad[:2 * k].view(2, k)
    kb = -(-k // 1024) * 1024
    counts = torch.full((kb // 1024,), 1024.0)
    counts[-1] = k - (kb // 1024 - 1) * 1024
    padded = torch.nn.functional.pad(x, (0, kb - k))
    for bits in (1, 2):
        wire = BlockCodec(bits, 1024, torch.float32).encode(padded, counts)
        split = kb * bits // 8
        out.append((f"{bits}bit codes", wire[:, :split].reshape(-1).numpy()))
        out.append((f"{bits}bit scales", wire[:, split:].reshape(-1).numpy()))
    codec = TopKCodec(0.01, torch.float32)
    wire = codec.encode_with_error(grad, torch.zeros_like(grad))
    chunks, _, kk = codec.shape(grad.numel())
    split = chunks * kk * 4
    out.append(("topk values", wire[0, :split].numpy()))
    out.append(("topk offsets", wire[0, split:].numpy()))
    return out


def gap_entropy(offsets: np.ndarray, per_chunk: int) -> float:
    """Bits per index of an ideal code of the offsets' gaps, sorted within each chunk."""
    idx = (offsets.view(np.int16).astype(np.int64) + 32768).reshape(-1, per_chunk)
    gaps = np.diff(np.sort(idx, axis=1), axis=1, prepend=0)
    _, counts = np.unique(gaps, return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum())


def decode_rate(data: np.ndarray, symbols: int = 20_000) -> float:
    """Million symbols per second of a byte-wise canonical Huffman decoder walking the bit
    stream of the first `symbols` bytes of `data` (one bit per step, a lookup per bit)."""
    lengths = huffman_lengths(np.bincount(data, minlength=256))
    table, encode, code, prev = {}, {}, 0, None
    for length, sym in sorted((int(lengths[s]), s) for s in range(256) if lengths[s]):
        code = 0 if prev is None else (code + 1) << (length - prev)
        table[(length, code)], encode[sym], prev = sym, (code, length), length
    bits = [(c >> (n - 1 - b)) & 1 for s in data[:symbols].tolist()
            for c, n in (encode[s],) for b in range(n)]
    start = time.perf_counter()
    out, acc, length = [], 0, 0
    for bit in bits:
        acc, length = (acc << 1) | bit, length + 1
        sym = table.get((length, acc))
        if sym is not None:
            out.append(sym)
            acc = length = 0
    assert out == data[:symbols].tolist()
    return len(out) / (time.perf_counter() - start) / 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args(argv)
    grad = trained_gradient(args.steps)
    print(f"gradient of {grad.numel():,} elements after {args.steps} steps")
    rows = []
    for name, data in streams(grad):
        rows.append(stream_stats(name, data))
        print(rows[-1])
        if name == "topk offsets":
            per_chunk = TopKCodec(0.01, torch.float32).shape(grad.numel())[2]
            print(f"  sorted-gap entropy: {gap_entropy(data, per_chunk):.2f} bits per index "
                  f"(16 sent)")
    largest = max(streams(grad), key=lambda s: s[1].size)
    print(f"byte-wise Huffman decode in Python: {decode_rate(largest[1]):.3f} MB/s "
          f"(a sequential walk: one symbol's length is known only after decoding it)")
    totals = {}
    for r in rows:
        alg = r["stream"].split()[0]
        sent, coded = totals.get(alg, (0, 0))
        totals[alg] = (sent + r["bytes"], coded + min(r["bytes"], r["huffman_bytes"]))
    for alg, (sent, coded) in totals.items():
        print(f"{alg}: {sent:,} bytes sent, {coded:,} with Huffman where it helps "
              f"({100 * (1 - coded / sent):.1f}% saved)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
