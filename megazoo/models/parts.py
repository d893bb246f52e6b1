"""The model's ends: the input embedding, the output head, the loss, and sequence sharding.

Sequence sharding. Every rank of a tp x sp group receives the same full ids `[b, s]`. With
Ulysses (sp > 1) rank r keeps tokens [r s/sp, (r+1) s/sp); with Megatron sequence parallelism
that shard is split again over tp inside the model. So the activation a block sees is
`[s / (sp * tp_sp), b, h]` with tp_sp = tp under Megatron SP, else 1 (sp shard outermost).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import (ColumnParallelLinear, NormalInit, VocabParallelEmbedding,
                      copy_to_tensor_parallel_region,
                      gather_from_sequence_parallel_region, gather_from_tensor_parallel_region,
                      gather_sequence_replicated, mark_sequence_parallel,
                      reduce_from_tensor_parallel_region,
                      reduce_scatter_to_sequence_parallel_region, vocab_parallel_cross_entropy)
from ..layers.embedding import check_token_ids
from ..config.layout import check_sequence_split, sequence_pieces
from ..config.model import ModelConfig
from ..layers.norm import build_norm
from ..layers.ulysses import sequence_shard_range
from ..parallel.state import ParallelState

WORD_EMBEDDINGS = "embedding.word_embeddings.weight"


def sequence_shard(state: ParallelState) -> int:
    """How many pieces the sequence is cut into for one block (`sequence_pieces` of `state`)."""
    return sequence_pieces(state.tp.size, state.sp.size, state.config.megatron_sp)


def check_sequence_length(seq_len: int, state: ParallelState) -> None:
    """`check_sequence_split` for this rank's layout."""
    check_sequence_split(seq_len, state.tp.size, state.sp.size, state.config.megatron_sp)


def ulysses_window(seq_len: int, state: ParallelState) -> slice:
    """The tokens of this rank's Ulysses shard (`sequence_shard_range` over sp)."""
    rows = sequence_shard_range(seq_len, sp_group=state.sp)
    return slice(rows.start, rows.stop)


class Embedding(nn.Module):
    """ids [b, s_sp] (this rank's Ulysses shard) -> x [s_local, b, h].

    Word embedding (vocab-parallel) + learned positions (GPT) on the sp shard, then the
    Megatron-SP split over tp, then BLOOM's embedding LayerNorm and dropout.
    """

    def __init__(self, config: ModelConfig, state: ParallelState, *, seed: int, device=None,
                 dtype=None):
        super().__init__()
        self.state, self.dropout = state, config.hidden_dropout
        tp = state.tp.size
        std = config.init_std
        self.word_embeddings = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, group=state.tp,
            init_method=NormalInit(std, seed, WORD_EMBEDDINGS),
            make_vocab_size_divisible_by=config.padded_vocab(tp) // tp, device=device, dtype=dtype)
        self.position_embeddings = None
        if config.position_embedding == "learned":
            self.position_embeddings = nn.Parameter(torch.empty(
                config.max_position_embeddings, config.hidden_size, device=device, dtype=dtype))
            NormalInit(std, seed, "embedding.position_embeddings.weight").fill_(self.position_embeddings)
            if state.config.megatron_sp:
                mark_sequence_parallel(self.position_embeddings)
        self.max_positions = config.max_position_embeddings
        self.norm = None
        if config.embedding_layernorm:
            self.norm = build_norm(config.norm, config.hidden_size, config.norm_eps,
                                   sequence_parallel=state.config.megatron_sp,
                                   device=device, dtype=dtype)

    def forward(self, ids_sp: torch.Tensor, first_position: int,
                check: bool = True) -> torch.Tensor:
        """check=False: the ids are known to be in the vocabulary (no device sync).

        Under Megatron SP the vocab-parallel partial sums are reduce-scattered along the
        sequence (one reduce-scatter, not an all-reduce then a split) and each rank adds the
        positions of its own rows; the position table is then tagged sequence-parallel (its
        gradient is a partial sum over tp, completed once per step like a norm's)."""
        if self.position_embeddings is not None and first_position + ids_sp.shape[1] > self.max_positions:
            raise ValueError(f"sequence of {first_position + ids_sp.shape[1]} tokens exceeds "
                             f"max_position_embeddings {self.max_positions}")
        # Looked up with the ids transposed, so the activations start as a contiguous
        # [s_sp, b, h] (a transposed [b, s_sp, h] view would make every residual add a
        # strided kernel and every norm copy its input first).
        ids_sb = ids_sp.t()
        words = self.word_embeddings
        if check:
            check_token_ids(ids_sb, words.num_embeddings)
        if self.state.config.megatron_sp and self.state.tp.size > 1:
            x = reduce_scatter_to_sequence_parallel_region(words.lookup_partial(ids_sb),
                                                           self.state.tp)  # [s_sp/tp, b, h]
            first_position += self.state.tp.rank * x.shape[0]
        else:
            x = words.lookup(ids_sb)  # [s_sp, b, h]
        if self.position_embeddings is not None:
            stop = first_position + x.shape[0]
            x = x + self.position_embeddings[first_position:stop].unsqueeze(1)
        if self.norm is not None:
            x = self.norm(x)
        return F.dropout(x, self.dropout, self.training)


def lm_logits(x: torch.Tensor, weight: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """x [s_local, b, h] -> logits_shard [s_sp, b, V_pad/tp] with the vocab-sharded `weight`.

    The column-parallel matmul of the head: under Megatron SP the sequence is gathered over tp
    first (backward reduce-scatter), else x enters the tp region (backward all-reduce).
    """
    if state.config.megatron_sp:
        x = gather_from_sequence_parallel_region(x, state.tp)
    else:
        x = copy_to_tensor_parallel_region(x, state.tp)
    return F.linear(x, weight)


class OutputLayer(ColumnParallelLinear):
    """The untied output head (or the last pipeline stage's copy of a tied one), built with
    `sequence_parallel` = Megatron SP: x [s_local, b, h] -> logits_shard [s_sp, b, V_pad/tp],
    `lm_logits` with its own weight. A module of its own so that the model calls it, and the
    forward pre-hooks that wait for its weight's new values (overlapped parameter gather,
    optimizer offload) run before the weight is read."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.gather_input(x), self.weight)


def shifted_targets(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Hugging Face convention: position t predicts labels[t + 1]; the last predicts nothing.

    labels [b, s] -> targets [b, s] with targets[:, -1] = ignore_index.
    """
    pad = labels.new_full((labels.shape[0], 1), ignore_index)
    return torch.cat([labels[:, 1:], pad], dim=1)


def mean_token_loss(logits_shard: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                    state: ParallelState, check: bool = True) -> torch.Tensor:
    """Mean cross entropy over every non-ignored token of the full batch (all sp shards).

    logits_shard [s_sp, b, V_pad/tp], labels [b, s] full -> scalar, the same on every rank.
    Each rank's backward covers its own tokens; summing gradients over sp completes them.
    check=False: the labels are known to be in the vocabulary (no device sync).
    """
    targets = shifted_targets(labels)[:, ulysses_window(labels.shape[1], state)].t()  # [s_sp, b]
    per_token = vocab_parallel_cross_entropy(logits_shard, targets.contiguous(), state.tp,
                                             vocab_size=vocab_size, check_targets=check)
    total = reduce_from_tensor_parallel_region(per_token.sum().reshape(1), state.sp)
    count = (targets != -100).sum().reshape(1).to(per_token.dtype)
    if state.sp.size > 1:
        torch.distributed.all_reduce(count, group=state.sp.group)
    return total.squeeze(0) / count.clamp(min=1).squeeze(0)  # a new tensor, not a view (FSDP2)


def full_logits(logits_shard: torch.Tensor, vocab_size: int, state: ParallelState) -> torch.Tensor:
    """logits_shard [s_sp, b, V_pad/tp] -> logits [b, s, vocab], the same on every tp/sp rank."""
    logits = gather_from_tensor_parallel_region(logits_shard, state.tp)[..., :vocab_size]
    logits = gather_sequence_replicated(logits, state.sp)  # [s, b, vocab]
    return logits.transpose(0, 1)
