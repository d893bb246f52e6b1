"""Choosing the next token from logits: greedy, or a draw after temperature, top-k and top-p.

Every operation stays on the logits' device and reads no value back to the host, so a
decode loop on a GPU only synchronises when it returns the tokens. The draw uses a
`torch.Generator` seeded by the caller: the same seed gives the same tokens, and every tp
rank (which holds the same gathered logits) draws the same token without a broadcast; under
pipeline parallelism the last stage draws and `choose` broadcasts to its pipeline group.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen; validated on construction (ValueError naming the flag)."""

    greedy: bool = False
    """The most likely token (temperature, top_k and top_p are then ignored)."""
    temperature: float = 1.0
    """Logits are divided by it before the draw (> 0; below 1 sharpens)."""
    top_k: int = 0
    """Draw among the k most likely tokens only (0: no limit)."""
    top_p: float = 1.0
    """Draw among the smallest set of most likely tokens whose probability reaches p (1: all)."""

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"--temperature must be > 0, got {self.temperature} (use --greedy "
                             f"for the most likely token)")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0 (0: no limit), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")


def filter_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """float32 logits [b, V] / temperature with the tokens outside top-k / top-p at -inf.

    The row's maximum is subtracted first (softmax does not change): a tiny temperature then
    sends the others to -inf and keeps the most likely at 0, its greedy limit, instead of
    inf - inf = nan."""
    logits = logits.float()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[:, -1:]  # [b, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # probability of the more likely tokens
        drop = before >= sampling.top_p  # the most likely token always stays (before = 0)
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def sample(logits: torch.Tensor, sampling: Sampling,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [b, V] -> token ids [b] (int64, on the logits' device)."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits, sampling).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def choose(logits: torch.Tensor | None, sampling: Sampling, generator, state, batch: int,
           device) -> torch.Tensor:
    """The next tokens [b] on every rank: drawn on the last stage, broadcast over pp."""
    tokens = None if logits is None else sample(logits, sampling, generator)
    if state.pp.size == 1:
        return tokens
    if tokens is None:
        tokens = torch.empty(batch, dtype=torch.int64, device=device)
    dist.broadcast(tokens, src=state.pp.ranks[-1], group=state.pp.group)
    return tokens
