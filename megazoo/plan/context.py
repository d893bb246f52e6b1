"""The context-parallel ring's exposed transfer time, for one block and one micro-batch.

At cp ranks, each rank's key/value block (2 bf16 tensors of its s b / cp tokens, its kv heads
after the tp and Ulysses head split) goes around the ring in cp - 1 steps, each transfer
overlapped with the attention of the block held (1 / cp of the rank's attention time, the
chunk pairing makes every step the same work). Backward sends the block again with its float32
gradient accumulator (3 times the bytes) against 1 / cp of the attention backward, and one
last accumulator transfer home that nothing hides. The ring spans t u cp ranks: NVLink when
they share a node (`Cluster.link_bytes_s`).
"""
from __future__ import annotations

from ..config.model import ModelConfig
from .clusters import Cluster
from .layout import Resolved

KV_BYTES = 2.0  # bf16 keys and values
GRAD_BYTES = 4.0  # the float32 gradient accumulators


def ring_exposed(config: ModelConfig, layout: Resolved, cluster: Cluster, a_fwd: float,
                 a_bwd: float) -> tuple[float, float]:
    """(forward, backward) seconds of ring transfer not hidden behind attention; a_fwd /
    a_bwd: this rank's attention seconds of the block (already its 1 / cp share)."""
    cp = layout.cp
    if cp == 1:
        return 0.0, 0.0
    heads = max(config.num_key_value_heads / (layout.tp * layout.sp), 1.0)  # replicated: >= 1
    elements = 2.0 * layout.seq_length * layout.micro_batch_size / cp * heads * config.head_dim
    link = cluster.link_bytes_s(layout.tp * layout.sp * cp)
    send_f = elements * KV_BYTES / link
    send_b = elements * (KV_BYTES + GRAD_BYTES) / link
    fwd = (cp - 1) * max(0.0, send_f - a_fwd / cp)
    bwd = (cp - 1) * max(0.0, send_b - a_bwd / cp) + elements * GRAD_BYTES / link
    return fwd, bwd
