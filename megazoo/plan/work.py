"""Seconds of one micro-batch's work on one GPU: a transformer block, the embedding and head.

For one block at tensor-parallel size t, Ulysses size u, micro-batch b, sequence s (tokens
per GPU T = s b / u; h width, f MLP width, kv = key/value heads x head dim):

- GEMMs (`KernelRates.gemm`; FP8 ones / its FP8 speedup, plus their casts: amax and cast of
  the input and weight forward, of the output gradient backward, and the transposed FP8
  copies the weight gradient needs, `FP8_CAST_BYTES`): q/k/v [T, h] x [h, (h + 2 kv) / t],
  attention output [T, h / t] x [h / t, h], MLP in [T, h] x [h, f / t] (2 f / t for SwiGLU),
  MLP out [T, f / t] x [f / t, h]; each backward is its input-gradient and weight-gradient
  product (the weight gradient's inner dimension is T).
- attention: causal SDPA over the GPU's heads a / (t u) and the full sequence (ALiBi runs
  in FlexAttention: `ALIBI_FACTOR` times cuDNN's time, from the attention bench); with
  context parallelism 1 / cp of it (the ring's balanced share; T = s b / (u cp)), plus the
  ring's exposed transfers (context.py).
- elementwise passes at the copy bandwidth, in 2-byte elements per token: forward 10 r (two
  norms, two residual adds; r = h, or h / t under Megatron SP) + the RoPE rotation
  2 (h + kv) / t + the MLP's activation (GELU's epilogue writes its input, f / t; SwiGLU
  reads 2 f / t and writes f / t); backward 12 r (norm and residual gradients) + the bias
  gradients (reads of dy: (h + 2 kv) / t + f / t + 2 h, GPT and BLOOM) + the q/k/v
  gradient's copy 2 (h + 2 kv) / t + the MLP's (GELU 2 f / t, SwiGLU 5 f / t).
- recompute: full reruns the forward (GEMMs, attention, elementwise, its tp collectives)
  inside the backward; selective reruns the attention's forward.
- tp / sp collectives, each of the full T h bf16 activation B = 2 T h bytes, at the group's
  bus bandwidth (`Cluster.link_bytes_s`: the measured `collective_bus_gb_s` where given):
  tp without SP, 2 all-reduces forward and 2 backward (2 (t - 1) / t x B each); Megatron
  SP's minimum, forward an all-gather before each column-parallel GEMM (q/k/v, MLP in) and a
  reduce-scatter after each row-parallel one ((t - 1) / t x B each: 4), backward the mirror
  (2 reduce-scatters, 2 all-gathers: the layers keep the gathered input for the weight
  gradient, so nothing is re-gathered); Ulysses: the q/k/v and output all-to-alls forward
  and backward, (u - 1) / u x bytes. The counts are `plan.collectives.layer_collectives`,
  which tests check against what the layers issue. Overlapped (`overlap`, --tp-comm-overlap,
  which on GPUs runs torch's fused symmetric-memory ops, `layers.symm_tp`: each collective cut
  into one piece per rank, moved beside the GEMM it feeds or drains), a direction exposes
  what its GEMMs cannot hide, and at least one piece of t; each piece is a call.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config.model import ModelConfig
from .calibration import KernelRates
from .clusters import Cluster
from .collectives import layer_collectives
from .context import ring_exposed
from .layout import Resolved

ALIBI_FACTOR = 1.56  # FlexAttention ALiBi 1.28 ms vs cuDNN causal 0.82 ms, 4 x 16 x 2048 x 128
FP8_CAST_BYTES = 5.0  # amax read (2 B) + bf16 read (2 B) and e4m3 write (1 B) per element
LOSS_BYTES = 20.0  # per logit element: bf16 logits, fp32 copy, exp, softmax saved, its gradient
HOST_FORWARD_SHARE = 0.46
"""The share of a micro-batch's host time spent issuing its forward: 0.46 pooled, 0.36-0.55
per row, over the plain engine, FSDP2 and DeepSpeed ZeRO-3 at widths 1024-4096
(bench/host_pace.py; bench/results/deepspeed_sync_h200_2026-11-29.md)."""


@dataclass(frozen=True)
class Work:
    """Seconds of one micro-batch on one GPU; comm is the exposed tp / sp collectives."""

    fwd: float = 0.0
    bwd: float = 0.0
    """Backward, including what recompute reruns."""
    fwd_comm: float = 0.0
    bwd_comm: float = 0.0

    def __add__(self, other: Work) -> Work:
        return Work(self.fwd + other.fwd, self.bwd + other.bwd, self.fwd_comm + other.fwd_comm,
                    self.bwd_comm + other.bwd_comm)

    def __mul__(self, k: float) -> Work:
        return Work(self.fwd * k, self.bwd * k, self.fwd_comm * k, self.bwd_comm * k)

    @property
    def total(self) -> float:
        """Forward and backward, with their exposed collectives."""
        return self.fwd + self.bwd + self.fwd_comm + self.bwd_comm


def _linear(rates: KernelRates, tokens: int, n_in: float, n_out: float,
            fp8: bool) -> tuple[float, float]:
    """(forward, backward) seconds of [tokens, n_in] x [n_in, n_out]; FP8 adds its casts."""
    fwd = rates.gemm.time(tokens, n_out, n_in)
    bwd = rates.gemm.time(tokens, n_in, n_out) + rates.gemm.time(n_out, n_in, tokens)
    if not fp8:
        return fwd, bwd
    weights = n_in * n_out
    cast_fwd = FP8_CAST_BYTES * (tokens * n_in + weights)
    cast_bwd = FP8_CAST_BYTES * tokens * n_out + (tokens * (n_in + n_out) + weights) * 2
    return (fwd / rates.fp8_speedup + cast_fwd / rates.copy_bytes_s,
            bwd / rates.fp8_speedup + cast_bwd / rates.copy_bytes_s)


def _kv_width(config: ModelConfig) -> int:
    """Width of the keys (and of the values): kv heads x head dim."""
    return config.num_key_value_heads * config.head_dim


def block_work(config: ModelConfig, layout: Resolved, rates: KernelRates, cluster: Cluster,
               overlap: bool = False) -> Work:
    """One transformer block, one micro-batch (module docstring); `overlap`: tp
    communication chunked beside the GEMMs."""
    t, u, b, s = layout.tp, layout.sp, layout.micro_batch_size, layout.seq_length
    h, f, kv = config.hidden_size, config.ffn_hidden_size, _kv_width(config)
    tokens = s * b // layout.seq_ranks
    swiglu = config.activation == "swiglu"
    fp8_all = config.fp8_format is not None and config.fp8_layers == "all"
    fp8_mlp = config.fp8_format is not None
    gemms = [_linear(rates, tokens, h, (h + 2 * kv) / t, fp8_all),
             _linear(rates, tokens, h / t, h, fp8_all),
             _linear(rates, tokens, h, (2 if swiglu else 1) * f / t, fp8_mlp),
             _linear(rates, tokens, f / t, h, fp8_mlp)]
    g_fwd, g_bwd = sum(g[0] for g in gemms), sum(g[1] for g in gemms)
    a_fwd, a_bwd = rates.attention(b, config.num_attention_heads / (t * u), s, config.head_dim)
    a_fwd, a_bwd = a_fwd / layout.cp, a_bwd / layout.cp  # the ring's balanced causal share
    if config.position_embedding == "alibi":
        a_fwd, a_bwd = a_fwd * ALIBI_FACTOR, a_bwd * ALIBI_FACTOR
    e_fwd, e_bwd = (2.0 * tokens * n / rates.copy_bytes_s for n in _elementwise(config, layout))
    fwd = g_fwd + a_fwd + e_fwd
    ring_f, ring_b = ring_exposed(config, layout, cluster, a_fwd, a_bwd)
    c_fwd, c_bwd = _tp_comm(config, layout, cluster, overlap)
    if overlap and layout.tp > 1:
        c_fwd, c_bwd = (max(c - g, c / layout.tp) for c, g in ((c_fwd, g_fwd), (c_bwd, g_bwd)))
    recompute = {"full": fwd, "selective": a_fwd}.get(layout.recompute, 0.0)
    again = c_fwd + ring_f if layout.recompute == "full" else 0.0  # (the ring runs again)
    return Work(fwd, g_bwd + a_bwd + e_bwd + recompute, c_fwd + ring_f, c_bwd + ring_b + again)


def block_host(config: ModelConfig, layout: Resolved, cluster: Cluster,
               overlap: bool = False) -> float:
    """Seconds the host takes to issue one block's forward and backward for one micro-batch
    (`Cluster.host_block_ms` plus `host_collective_ms` per tp / sp collective call, chunked
    calls counted one by one, plus under FSDP2 `host_fsdp2_unit_ms` per unit, a block's share
    of it with --fsdp-blocks-per-unit, and under DeepSpeed ZeRO-3 `host_deepspeed_block_ms`);
    0 where the cluster gives no host time."""
    if cluster.host_block_ms is None:
        return 0.0
    calls = sum(c.calls for c in _block_collectives(config, layout, overlap))
    hooks = 0.0
    if layout.zero_impl == "fsdp2":
        blocks, units = layout.fsdp2_units(config.num_layers)
        hooks = cluster.host_fsdp2_unit_ms * units / blocks
    elif layout.deepspeed_zero3:
        hooks = cluster.host_deepspeed_block_ms
    return (cluster.host_block_ms + calls * cluster.host_collective_ms + hooks) / 1e3


def _block_collectives(config: ModelConfig, layout: Resolved, overlap: bool = False):
    """`layer_collectives` of one block in this layout (a cp rank's share of the sequence);
    `overlap`: --tp-comm-overlap's pieces under tp (the fused ops cut each collective into
    one per rank), each a call."""
    chunks = layout.tp if overlap and layout.tp > 1 else 1
    return layer_collectives(config, tp=layout.tp, sp=layout.sp,
                             megatron_sp=layout.megatron_sp_on,
                             micro_batch=layout.micro_batch_size,
                             seq_length=layout.seq_length // layout.cp, chunks=chunks)


def zero3_copies(params: float, layout: Resolved, rates: KernelRates) -> Work:
    """Seconds per micro-batch of the memory passes a ZeRO-3 engine adds on the GPU for
    `params` parameters (b: compute bytes, z: the dp x sp shards, r: the reduction bytes):

    - FSDP2, each gather (forward, and backward unless --no-fsdp-reshard-after-forward): the
      fp32 shard cast into the gather's input ((4 + b) / z per parameter) and the gathered
      bytes copied out into the parameters (2 b); backward: each micro-batch's gradient cast
      and summed into the unsharded accumulation in the reduction dtype (b + 2 r), or, reducing
      every micro-batch, cast into the reduce-scatter's input (b + r);
    - DeepSpeed: backward, the gradients copied into its contiguous bucket (2 b) and each
      partition summed into its accumulation (b + 8 in fp32, 3 b otherwise, over z); its
      gathers land in place.

    Not modeled with offloaded parameters or optimizer (their traffic crosses PCIe)."""
    if (layout.zero_stage != 3 or layout.optimizer_offload.on
            or layout.offload_param not in (None, "none")):
        return Work()
    b, z, r = layout.param_bytes, layout.dp * layout.seq_ranks, layout.reduce_bytes
    if layout.zero_impl == "fsdp2":
        gather = (4 + b) / z + 2 * b
        again = gather if layout.fsdp_reshard_after_forward else 0.0
        per_microbatch = layout.pp > 1 and layout.fsdp_reduce_every_microbatch
        grads = b + r if per_microbatch or layout.num_micro_batches == 1 else b + 2 * r
        return Work(gather * params / rates.copy_bytes_s,
                    (again + grads) * params / rates.copy_bytes_s)
    accumulate = (b + 8) if layout.ds_fp32_grads else 3 * b
    return Work(0.0, (2 * b + accumulate / z) * params / rates.copy_bytes_s)


def host_paced(work: Work, host_s: float, synced: bool = False) -> Work:
    """`work` as the GPU runs it when the host needs `host_s` to issue it: unchanged when the
    GPU is the slower, else every part stretched in proportion (the GPU idles between
    launches, in each pass alike). The host runs ahead across micro-batches, so a backward
    the GPU lags in lets the host issue the next forward early.

    `synced`: the engine makes the host wait for the GPU at the end of each micro-batch
    (DeepSpeed ZeRO-3's gradient epilogue synchronizes its reduction stream), so each
    forward is issued behind an empty queue. Where the host issues it (`HOST_FORWARD_SHARE`
    of its time) slower than the GPU runs it, the backward's GPU work starts only after
    it: the micro-batch takes max(host, the forward's host + the backward's GPU, GPU)."""
    gpu = work.total
    took = host_s
    if synced:
        took = max(took, HOST_FORWARD_SHARE * host_s + work.bwd + work.bwd_comm)
    if took <= gpu or gpu <= 0.0:
        return work
    return work * (took / gpu)


def _elementwise(config: ModelConfig, layout: Resolved) -> tuple[float, float]:
    """(forward, backward) 2-byte elements per token of the passes over memory."""
    t = layout.tp
    h, f, kv = config.hidden_size, config.ffn_hidden_size, _kv_width(config)
    r = h / t if layout.megatron_sp_on else h
    qkv = (h + 2 * kv) / t
    rope = 2 * (h + kv) / t if config.position_embedding == "rope" else 0.0
    swiglu = config.activation == "swiglu"
    bias = 0.0 if config.family == "llama" else qkv + f / t + 2 * h
    fwd = 10 * r + rope + (3 if swiglu else 1) * f / t
    bwd = 12 * r + bias + 2 * qkv + rope + (5 if swiglu else 2) * f / t
    return fwd, bwd


def _tp_comm(config: ModelConfig, layout: Resolved, cluster: Cluster,
             overlap: bool = False) -> tuple[float, float]:
    """Seconds of the (forward, backward) tp / sp collectives of one block, none overlapped:
    what the layers issue (`plan.collectives.layer_collectives`; under Megatron SP two
    all-gathers and two reduce-scatters each way, the gathered input kept for backward),
    each at the link of its group, plus `Cluster.collective_latency_us` per call (under
    `overlap`, each chunk a call)."""
    t, u = layout.tp, layout.sp
    seconds = {"forward": 0.0, "backward": 0.0}
    for c in _block_collectives(config, layout, overlap):
        seconds[c.direction] += c.calls * cluster.collective_latency_us / 1e6
        if c.kind == "all_reduce":
            seconds[c.direction] += c.calls * _all_reduce(cluster, t, c.bytes_each, latency=False)
        elif c.group == "tp":  # all-gather / reduce-scatter: (t - 1) / t of the full side
            seconds[c.direction] += (t - 1) / t * c.bytes / cluster.link_bytes_s(t)
        else:  # Ulysses' all-to-alls over t x u ranks' links
            seconds[c.direction] += (u - 1) / u * c.bytes / cluster.link_bytes_s(t * u)
    return seconds["forward"], seconds["backward"]


def head_work(config: ModelConfig, layout: Resolved, rates: KernelRates, cluster: Cluster) -> Work:
    """The final norm, the vocabulary-parallel head and the loss, one micro-batch."""
    t = layout.tp
    tokens = layout.seq_length * layout.micro_batch_size // layout.seq_ranks
    vocab = config.padded_vocab(t) / t
    fwd, bwd = _linear(rates, tokens, config.hidden_size, vocab, False)
    loss = LOSS_BYTES * tokens * vocab / rates.copy_bytes_s
    # the head's input all-reduce (backward) and the loss's max / sum all-reduces
    comm = _all_reduce(cluster, t, 2.0 * tokens * config.hidden_size)
    return Work(fwd + loss / 2, bwd + loss / 2, 0.0, comm)


def embedding_work(config: ModelConfig, layout: Resolved, rates: KernelRates,
                   cluster: Cluster) -> Work:
    """The embedding lookup (a gather and, backward, a scatter-add of T h elements) and its
    tp all-reduce."""
    t = layout.tp
    tokens = layout.seq_length * layout.micro_batch_size // layout.seq_ranks
    moved = 2.0 * 2 * tokens * config.hidden_size / rates.copy_bytes_s
    comm = _all_reduce(cluster, t, 2.0 * tokens * config.hidden_size)
    return Work(moved, 2 * moved, comm, 0.0)


def _all_reduce(cluster: Cluster, t: int, nbytes: float, latency: bool = True) -> float:
    """Seconds of a ring all-reduce of `nbytes` over `t` ranks: 2 (t - 1) / t x nbytes, and
    the call's latency (`latency`) where there is a ring."""
    fixed = cluster.collective_latency_us / 1e6 if latency and t > 1 else 0.0
    return 2 * (t - 1) / t * nbytes / cluster.link_bytes_s(t) + fixed
