"""Cross entropy over logits split by vocabulary across tensor-parallel ranks.

Never gathers the full logits: two all-reduces over tp, the max, then the target logit and the
sum of exponentials (and the sum of logits for label smoothing) stacked into one. Computed in fp32
whatever the logits' dtype, after subtracting the global max, so fp16/bf16 logits neither
overflow nor lose the loss.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .embedding import check_token_ids
from .groups import Group, group_rank, group_size, process_group


def _sum(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group_size(group) > 1:
        dist.all_reduce(x, group=process_group(group))
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """logits_shard [..., V/tp], target [...] -> loss [...] (fp32, 0 where ignored)."""

    @staticmethod
    def forward(ctx, logits_shard, target, group, vocab_size, ignore_index, smoothing):
        shard = logits_shard.shape[-1]
        start = group_rank(group) * shard
        x = logits_shard.to(torch.float32, copy=True)  # one new tensor, worked on in place
        padded = torch.arange(start, start + shard, device=x.device) >= vocab_size
        if start + shard > vocab_size:  # this rank holds padded columns (no device sync)
            x.masked_fill_(padded, float("-inf"))
        logits_max = x.max(dim=-1, keepdim=True).values
        if group_size(group) > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=process_group(group))
        x.sub_(logits_max)

        ignored = target == ignore_index
        in_shard = (target >= start) & (target < start + shard) & ~ignored
        local = (target - start).masked_fill(~in_shard, 0)
        target_logit = x.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~in_shard, 0.0)
        exp = x.exp()
        sums = [target_logit, exp.sum(dim=-1)]
        if smoothing > 0:
            sums.append(x.masked_fill(padded, 0.0).sum(dim=-1))
        sums = _sum(torch.stack(sums), group)  # [2 or 3, ...]: one all-reduce for all of them
        target_logit, log_z = sums[0], sums[1].log()
        loss = log_z - target_logit
        if smoothing > 0:
            mean_logit = sums[2] / vocab_size
            loss = (1.0 - smoothing) * loss + smoothing * (log_z - mean_logit)
        loss.masked_fill_(ignored, 0.0)

        softmax = exp.div_(log_z.exp().unsqueeze(-1))
        ctx.save_for_backward(softmax, local, in_shard, ignored, padded)
        ctx.smoothing, ctx.vocab_size, ctx.dtype = smoothing, vocab_size, logits_shard.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, in_shard, ignored, padded = ctx.saved_tensors
        s = ctx.smoothing
        # d loss / d x_j = p_j - (1 - s) [j == target] - s / V   (0 for padded columns)
        grad = softmax
        one_hot_rows = grad.view(-1, grad.shape[-1])
        flat = torch.arange(one_hot_rows.shape[0], device=grad.device)
        one_hot_rows[flat, local.view(-1)] -= (1.0 - s) * in_shard.view(-1).to(grad.dtype)
        if s > 0:
            grad.sub_((s / ctx.vocab_size) * (~padded).to(grad.dtype))
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor, group: Group,
                                 *, vocab_size: int | None = None, ignore_index: int = -100,
                                 label_smoothing: float = 0.0,
                                 check_targets: bool = True) -> torch.Tensor:
    """Per-token loss `[...]` (fp32) of logits split by vocabulary `[..., V_padded/tp]`.

    `vocab_size` is the real vocabulary; logit columns past it (Megatron's padding) are
    excluded. Tokens equal to `ignore_index` get loss 0 and no gradient. Matches
    `F.cross_entropy(full_logits, target, reduction="none", ...)`. `check_targets=False`
    skips the range check of the targets, which reads them back to the host (a device sync):
    for callers whose targets were checked already.
    """
    tp = group_size(group)
    full = logits_shard.shape[-1] * tp
    vocab_size = full if vocab_size is None else vocab_size
    if not 0 < vocab_size <= full:
        raise ValueError(f"vocab_size {vocab_size} must be in (0, {full}] for logits of "
                         f"{logits_shard.shape[-1]} columns per rank over tp={tp}")
    if logits_shard.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits_shard.shape)} and target {tuple(target.shape)} "
                         f"disagree: logits must be target's shape plus a vocabulary dimension")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if check_targets:
        check_token_ids(target.masked_fill(target == ignore_index, 0), vocab_size, "target")
    return _VocabParallelCrossEntropy.apply(logits_shard, target, group, vocab_size,
                                            ignore_index, label_smoothing)
