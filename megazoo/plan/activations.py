"""Activation memory of megazoo's own training step, for the planner (`megazoo.plan`).

Korthikanti et al. 2022 count s b h (34 + 5 a s / h) bytes per GPT block: their 5 a s / h term
is the s x s softmax, its dropout mask and output, and 2 of the 34 are dropout masks. Our
block stores neither: attention runs in a fused kernel (flash / SDPA / FlexAttention on GPUs,
`attention_backend="auto"`) that keeps q, k, v, the output and a [b, a, s] fp32 log-sum-exp,
and dropout is 0 by default (F.dropout with p = 0 returns its input, no mask). So the paper's
formula overestimates our "none" layouts several times over (gpt-1.3b, micro-batch 4, s=2048:
46 GB against the ~13 GB the code keeps). This module counts, per tensor, what the code saves
for the backward; unit: bytes per s b h / sp (bf16, 2 B per element), t = tp:

| saved by | tensor | bytes | under Megatron SP |
|---|---|---|---|
| both norms | their inputs (LayerNorm, compiled RMSNorm: x) | 2 + 2 | / t |
| qkv and fc1 matmuls | their inputs (norm outputs; gathered over tp under SP) | 2 + 2 | full |
| attention kernel | fused q, k, v (views of the qkv output) | 2 (h + 2 kv) / (h t) | |
| attention kernel, RoPE | rotated q, k (new tensors; v stays a view of qkv) | 2 (h + kv) / (h t) | |
| dense matmul | its input, the attention output | 2 / t | |
| extra copy of it | sp > 1 (the all-to-all's output) or ALiBi (FlexAttention) | 2 / t | |
| MLP, gelu | fc1 output (saved by GeLU) and GeLU output (by fc2) | 2 f/h / t + 2 f/h / t | |
| MLP, swiglu | gate and up (saved by the fused SwiGLU), its output | 4 f/h / t + 2 f/h / t | |

(f: ffn width.) GPT at tp = 1: 4 + 4 + 6 + 2 + 16 = 32, what saved-tensor hooks count on CPU
(tests/test_plan.py). Selective recompute (block.py wraps RoPE, the all-to-alls and the core attention)
keeps the region's input (the qkv output) and output (the dense input): the RoPE term and the
extra copy go. Full recompute keeps the block input (2, / t under SP), and while one block is
recomputed its full set exists once more (`working`).

Outside the blocks: the last stage keeps the final norm's input (2, / t under SP) and the
head's input (2, gathered under SP), plus BLOOM's embedding LayerNorm input on the first
stage (2, / t under SP). The loss, per element of s b V / (t sp): the bf16 logits (2), the fp32
copy the vocab-parallel cross entropy makes (4) and its fp32 exp (4) exist together in its
forward (cross_entropy.py): 10 B, the step's peak on the last stage; afterwards only the fp32
softmax (4) stays for the backward.

Precision: the table is bf16 / fp16; an fp32 run (--fp32, or no precision flag) keeps every
tensor in 4 B (twice the table), and its loss keeps the fp32 logits and their exp (8 B, no
copy).

Not modelled: backends that materialise s x s scores (`math`; `sdpa` with ALiBi, which CPU
and `attention_backend="sdpa"` use) and eager (uncompiled) RMSNorm / SwiGLU, which save fp32
or intermediate copies: the planner describes the GPU path.
"""
from __future__ import annotations

from ..config.model import ModelConfig
from .layout import Resolved


def block_coefficients(config: ModelConfig, tp: int, sp: int, megatron_sp: bool,
                       recompute: str) -> dict[str, float]:
    """Bytes per s b h / sp kept by one block, by part (see the table above)."""
    h, f, kv = config.hidden_size, config.ffn_hidden_size, config.num_key_value_heads * config.head_dim
    t = tp
    seq_par = megatron_sp and tp > 1
    parts = {
        "norm_inputs": 4 / (t if seq_par else 1),
        "matmul_inputs": 4.0,
        "qkv": 2 * (h + 2 * kv) / (h * t),
        "rope": 2 * (h + kv) / (h * t) if config.position_embedding == "rope" else 0.0,
        "dense_input": 2 / t,
        "dense_copy": 2 / t if (sp > 1 or config.position_embedding == "alibi") else 0.0,
        "mlp": (6 if config.activation == "swiglu" else 4) * f / (h * t),
    }
    if recompute == "selective":
        parts["rope"] = parts["dense_copy"] = 0.0
    return parts


def stage_activations(config: ModelConfig, layout: Resolved) -> dict[str, float]:
    """Activation bytes of one block and one micro-batch, and of the most loaded stage.

    Returns block (as kept under the layout's recompute),
    full_block (no recompute), first / last (stage totals), logits (the loss's peak), post
    (outside the blocks: head_side on the last stage + embed_side on the first), working
    (full recompute's one recomputed block) and total (the rank the planner reports: the
    first stage holds min(pp, m) micro-batches, x (1 + (pp - 1) / (pp vpp)) interleaved).
    """
    s, b, h = layout.seq_length, layout.micro_batch_size, config.hidden_size
    t, sp = layout.tp, layout.sp
    seq_par = layout.megatron_sp_on
    sbh = s * b * h / layout.seq_ranks * layout.param_bytes / 2  # the table counts bf16; fp32 runs keep 2x
    full_block = sbh * sum(block_coefficients(config, t, sp, layout.megatron_sp, "none").values())
    kept = sbh * sum(block_coefficients(config, t, sp, layout.megatron_sp, "selective").values())
    block = {"none": full_block, "selective": kept,
             "full": 2 * sbh / (t if seq_par else 1)}[layout.recompute]
    p, v = layout.pp, layout.vpp
    in_flight = min(p, layout.num_micro_batches)
    factor = 1 + (p - 1) / (p * v) if v > 1 else 1.0
    per_stage = config.num_layers // p
    working = full_block if layout.recompute == "full" else 0.0
    logits = s * b * config.padded_vocab(t) / (t * layout.seq_ranks) * (10 if layout.low_precision else 8)
    head_side = sbh * (2 / (t if seq_par else 1) + 2)  # final norm input + head input
    embed_side = sbh * 2 / (t if seq_par else 1) if config.embedding_layernorm else 0.0
    first = (per_stage * block + embed_side) * in_flight * factor + working
    last = per_stage * block + working + head_side + logits
    total = first + head_side + logits if p == 1 else max(first, last)  # one stage: both ends
    return dict(block=block, full_block=full_block, first=first, last=last, logits=logits,
                post=head_side + embed_side, head_side=head_side, embed_side=embed_side,
                working=working, total=total)
