"""`VocabParallelEmbedding`: the embedding table split by contiguous vocabulary ranges over tp."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .groups import Group, group_rank, group_size
from .init import init_shard_
from .mappings import reduce_from_tensor_parallel_region
from .sharding import set_tp_layout


def padded_vocab_size(vocab_size: int, tp: int, make_vocab_size_divisible_by: int = 128) -> int:
    """Vocabulary rounded up to a multiple of make_vocab_size_divisible_by * tp (Megatron).

    The padded rows are never looked up and their logits are masked out of the loss.
    """
    if vocab_size < 1 or make_vocab_size_divisible_by < 1:
        raise ValueError(f"vocab_size ({vocab_size}) and make_vocab_size_divisible_by "
                         f"({make_vocab_size_divisible_by}) must be positive")
    multiple = make_vocab_size_divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def check_token_ids(ids: torch.Tensor, vocab_size: int, what: str = "token id") -> None:
    """Raise a ValueError if any id is outside [0, vocab_size) (one device sync)."""
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"{what}s must be an integer tensor, got {ids.dtype}")
    if ids.numel() == 0:
        return
    low, high = torch.stack(torch.aminmax(ids)).tolist()
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"{what} {bad} is outside the vocabulary [0, {vocab_size}): check the "
                         f"tokenizer matches the model's vocab_size")


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows `[padded_vocab/tp, dim]` are this rank's contiguous vocabulary range.

    ids [...] (the same on every tp rank) -> e_full [..., dim]: each rank looks up the ids in
    its range (zeros elsewhere) and the partial embeddings are all-reduced (g operator).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group: Group,
                 init_method=None, make_vocab_size_divisible_by: int = 128,
                 device=None, dtype=None):
        super().__init__()
        tp = group_size(group)
        self.num_embeddings, self.embedding_dim, self.group = num_embeddings, embedding_dim, group
        self.padded_num_embeddings = padded_vocab_size(num_embeddings, tp,
                                                       make_vocab_size_divisible_by)
        self.rows_per_rank = self.padded_num_embeddings // tp
        self.vocab_start = group_rank(group) * self.rows_per_rank
        self.vocab_end = self.vocab_start + self.rows_per_rank
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, embedding_dim,
                                               device=device, dtype=dtype))
        set_tp_layout(self.weight, 0, unpadded=num_embeddings)
        init_shard_(self.weight, init_method, self.vocab_start, 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        check_token_ids(ids, self.num_embeddings)
        return self.lookup(ids)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """`forward` without the range check, which reads the ids back to the host: for callers
        whose ids are known to be in range (a generation step replayed as a CUDA graph)."""
        partial = self.lookup_partial(ids)
        return partial if group_size(self.group) == 1 else reduce_from_tensor_parallel_region(partial, self.group)

    def lookup_partial(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> e_partial [..., dim]: this rank's rows, zeros for ids outside its range;
        the sum over tp is the embedding. Megatron SP reduce-scatters it along the sequence
        instead of all-reducing it (half the bytes, no split after). No range check."""
        if group_size(self.group) == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill_(outside, 0)
        return F.embedding(local, self.weight).masked_fill_(outside.unsqueeze(-1), 0.0)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} (padded {self.padded_num_embeddings}, "
                f"{self.rows_per_rank}/rank), {self.embedding_dim}")
