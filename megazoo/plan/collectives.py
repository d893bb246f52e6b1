"""The collectives one transformer block issues per micro-batch, by kind, direction and size:
what the step-time model's communication terms count (`layer_collectives`).

Derived from the layers' code and checked against what they issue on gloo
(`megazoo.parallel.comm_count.CommCounter`, tests/layers/test_comm_counts.py). Per block
at tensor-parallel size t, Ulysses size u, micro-batch b, sequence s, width h, key/value
width kv (heads x head dim), elements of `elem_bytes` bytes:

- t > 1 under Megatron SP: forward one all-gather before each column-parallel GEMM group
  (QKV, MLP in) and one reduce-scatter after each row-parallel GEMM (attention out, MLP out);
  backward the mirror (a reduce-scatter of each column group's input gradient, an
  all-gather of each row GEMM's output gradient; the gathered input is kept, nothing is
  re-gathered). Each moves the full side [s/u, b, h]; with --tp-comm-overlap each is `chunks`
  calls of 1/chunks of it.
- t > 1 without SP: one all-reduce of [s/u, b, h] per row GEMM forward and per column
  group backward.
- u > 1 (Ulysses): forward the q/k/v all-to-all ([s/u, b, (h + 2 kv) / t] sent) and the
  output's ([s/u, b, h / t]), backward the same two.

Outside the blocks (not here): the embedding's reduce-scatter (SP) or all-reduce, the head's
all-gather or its backward all-reduce, the loss's two fp32 all-reduces over tp ([s/u, b] and [2, s/u, b]), and
once per step the sequence-parallel parameters' gradient sum over tp (one all-reduce per
gradient bucket holding any).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config.model import ModelConfig


@dataclass(frozen=True)
class Collective:
    """`calls` collectives of one kind over one group in one direction of one micro-batch,
    each moving `bytes_each` on its full side (gathered output, scattered input, all-to-all
    send buffer)."""
    kind: str
    group: str
    direction: str
    calls: int
    bytes_each: float

    @property
    def bytes(self) -> float:
        return self.calls * self.bytes_each


def layer_collectives(config: ModelConfig, *, tp: int, sp: int, megatron_sp: bool,
                      micro_batch: int, seq_length: int, chunks: int = 1,
                      elem_bytes: int = 2) -> list[Collective]:
    """One block's collectives per micro-batch (module docstring); [] at tp = sp = 1."""
    h = config.hidden_size
    kv = config.num_key_value_heads * config.head_dim
    rows = seq_length // sp * micro_batch  # tokens of the Ulysses shard: [s/u, b]
    full = float(rows * h * elem_bytes)
    out: list[Collective] = []
    for direction in ("forward", "backward"):
        if tp > 1 and megatron_sp:
            k = chunks
            out += [Collective("all_gather", "tp", direction, 2 * k, full / k),
                    Collective("reduce_scatter", "tp", direction, 2 * k, full / k)]
        elif tp > 1:
            out.append(Collective("all_reduce", "tp", direction, 2, full))
        if sp > 1:
            out += [Collective("all_to_all", "sp", direction, 1, rows * (h + 2 * kv) / tp * elem_bytes),
                    Collective("all_to_all", "sp", direction, 1, rows * h / tp * elem_bytes)]
    return out
