"""Tensor-parallel linear layers (Megatron-LM). Activations are `[s, b, h]`.

Weights are the local shard of the full `nn.Linear` weight `[out, in]`:
ColumnParallelLinear holds rows `[out/tp, in]` and bias `[out/tp]`; RowParallelLinear holds
columns `[out, in/tp]` and the full bias, added once after the reduction.

`fp8=FP8Recipe(...)` runs the local GEMM in FP8 (`fp8.py`); the collectives around it stay
in the run's dtype. Scales are computed from what the rank holds, so a scale taken over a
sharded dimension is the shard's, not the one-process model's: tensorwise, the weight shard
(both layers), the output gradient shard (column) and the input shard (row) get per-shard
scales; rowwise, scales are per row, taken over each GEMM's reduction dimension, so they
are per-shard only where tp shards that dimension: the column layer's input gradient (N
sharded) and the row layer's forward (K sharded); every other GEMM of both layers
scales exactly as one process does. The result equals the one-process computation with
the same per-shard scales (tests/test_fp8.py); a shard's amax is at most the tensor's, so
its values are cast with at least the one-process resolution.
"""
from __future__ import annotations

import torch
from torch import nn

from ..config.precision import FP8Recipe
from .fp8 import check_fp8_device, fp8_linear
from .groups import Group, divide, group_rank, group_size
from .init import init_shard_
from .mappings import (all_reduce, copy_to_tensor_parallel_region,
                       gather_from_sequence_parallel_region, gather_from_tensor_parallel_region, reduce_from_tensor_parallel_region,
                       reduce_scatter_to_sequence_parallel_region,
                       scatter_to_tensor_parallel_region)
from .sharding import set_tp_layout
from .tp_overlap import gather_linear, linear_reduce_scatter


def _check_last_dim(x: torch.Tensor, expected: int, layer: str) -> None:
    if x.dim() < 1 or x.shape[-1] != expected:
        raise ValueError(f"{layer} expects input [..., {expected}] (activations [s, b, h]), "
                         f"got shape {tuple(x.shape)}")


def mark_sequence_parallel(param: nn.Parameter) -> nn.Parameter:
    """Tag a parameter replicated over tp whose gradient is a partial sum under Megatron SP.

    Each tensor-parallel rank sees only its sequence shard, so the gradient of such a
    parameter (a row-parallel bias, a norm weight) must be all-reduced over tp before the
    optimizer step: `allreduce_sequence_parallel_grads` does that.
    """
    param.sequence_parallel = True
    return param


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split by rows (output features) over the tensor-parallel group.

    x_full [s, b, in] -> y_shard [s, b, out/tp] (or y_full [s, b, out] with gather_output).
    With sequence_parallel, x is x_shard [s/tp, b, in], all-gathered along s first, in
    `tp_comm_chunks` chunks overlapping the GEMM (`tp_overlap.py`; 1: one all-gather).
    """

    def __init__(self, in_features: int, out_features: int, *, group: Group, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 init_method=None, device=None, dtype=None, fp8: FP8Recipe | None = None):
        super().__init__()
        tp = group_size(group)
        if sequence_parallel and gather_output:
            raise ValueError("ColumnParallelLinear: gather_output=True cannot be combined with "
                             "sequence_parallel=True; keep the output sharded")
        self.in_features, self.out_features = in_features, out_features
        self.out_per_rank = divide(out_features, tp, "ColumnParallelLinear out_features "
                                   f"divided over tp={tp}")
        self.group, self.gather_output, self.sequence_parallel = group, gather_output, sequence_parallel
        self.fp8 = fp8
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features, **factory))
        self.bias = nn.Parameter(torch.zeros(self.out_per_rank, **factory)) if bias else None
        set_tp_layout(self.weight, 0)
        if self.bias is not None:
            set_tp_layout(self.bias, 0)
        init_shard_(self.weight, init_method, group_rank(group) * self.out_per_rank, 0)
        self.tp_comm_chunks = 1  # `set_tp_comm_overlap`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if overlapped(self, x):
            _check_last_dim(x, self.in_features, "ColumnParallelLinear")
            return gather_linear(x, self.weight, self.bias, self.group, self.tp_comm_chunks)
        y = fp8_linear(self.gather_input(x), self.weight, self.bias, self.fp8)
        return gather_from_tensor_parallel_region(y, self.group) if self.gather_output else y

    def gather_input(self, x: torch.Tensor) -> torch.Tensor:
        """The input of the local GEMM: x (identity forward, all-reduce backward), or the
        sequence shards all-gathered with sequence_parallel."""
        _check_last_dim(x, self.in_features, "ColumnParallelLinear")
        check_fp8_device(self.fp8, x.device)
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(x, self.group)
        return copy_to_tensor_parallel_region(x, self.group)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} ({self.out_per_rank}/rank), "
                f"bias={self.bias is not None}, gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}"
                + (f", fp8={self.fp8.format}/{self.fp8.recipe}" if self.fp8 else ""))


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split by columns (input features) over the tensor-parallel group.

    x_shard [s, b, in/tp] -> y_full [s, b, out] (all-reduce), or y_shard [s/tp, b, out]
    (reduce-scatter along s, in `tp_comm_chunks` chunks overlapping the GEMM: `tp_overlap.py`)
    with sequence_parallel. With input_is_parallel=False the full x is split along its last
    dimension first.
    """

    def __init__(self, in_features: int, out_features: int, *, group: Group, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 init_method=None, device=None, dtype=None, fp8: FP8Recipe | None = None):
        super().__init__()
        tp = group_size(group)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True needs "
                             "input_is_parallel=True")
        self.in_features, self.out_features = in_features, out_features
        self.in_per_rank = divide(in_features, tp, f"RowParallelLinear in_features divided over tp={tp}")
        self.group, self.input_is_parallel, self.sequence_parallel = group, input_is_parallel, sequence_parallel
        self.fp8 = fp8
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank, **factory))
        self.bias = nn.Parameter(torch.zeros(out_features, **factory)) if bias else None
        set_tp_layout(self.weight, 1)
        if self.bias is not None and sequence_parallel:
            mark_sequence_parallel(self.bias)
        init_shard_(self.weight, init_method, 0, group_rank(group) * self.in_per_rank)
        self.tp_comm_chunks = 1  # `set_tp_comm_overlap`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        expected = self.in_per_rank if self.input_is_parallel else self.in_features
        _check_last_dim(x, expected, "RowParallelLinear")
        if overlapped(self, x):
            y = linear_reduce_scatter(x, self.weight, self.group, self.tp_comm_chunks)
            return y if self.bias is None else y + self.bias
        check_fp8_device(self.fp8, x.device)
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.group)
        return self.reduce(fp8_linear(x, self.weight, self.local_bias(), self.fp8))

    def local_bias(self) -> torch.Tensor | None:
        """The bias the local GEMM adds: all of it at tp = 1 (nothing to reduce), else None
        (`reduce` adds it once, after the reduction)."""
        return self.bias if group_size(self.group) == 1 else None

    def reduce(self, y_partial: torch.Tensor) -> torch.Tensor:
        """The local GEMM's output (with `local_bias`) -> the layer's output: summed over tp
        (all-reduce, or reduce-scatter along s with sequence_parallel), then the bias."""
        if group_size(self.group) == 1:
            return y_partial
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y_partial, self.group)
        else:
            y = reduce_from_tensor_parallel_region(y_partial, self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in={self.in_features} ({self.in_per_rank}/rank), out={self.out_features}, "
                f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}"
                + (f", fp8={self.fp8.format}/{self.fp8.recipe}" if self.fp8 else ""))


def overlapped(layer, x: torch.Tensor) -> bool:
    """Whether a parallel linear runs through `tp_overlap` (the Megatron-SP path at tp > 1 in
    the run's dtype: FP8 GEMMs and autocast keep the separate collectives and GEMM)."""
    return (layer.sequence_parallel and group_size(layer.group) > 1 and layer.fp8 is None
            and not torch.is_autocast_enabled(x.device.type))


def set_tp_comm_overlap(model: nn.Module, chunks: int) -> int:
    """Set every parallel linear's `tp_comm_chunks` (`tp_overlap.py`; 1: one all-gather or
    reduce-scatter per GEMM, the default); returns how many linears were set."""
    if chunks < 1:
        raise ValueError(f"--tp-comm-overlap chunks must be at least 1, got {chunks}")
    layers = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    for layer in layers:
        layer.tp_comm_chunks = chunks
    return len(layers)


def allreduce_sequence_parallel_grads(module: nn.Module, group: Group) -> None:
    """Sum over tp the gradients of parameters tagged by `mark_sequence_parallel`."""
    if group_size(group) == 1:
        return
    for p in module.parameters():
        if getattr(p, "sequence_parallel", False) and p.grad is not None:
            p.grad.copy_(all_reduce(p.grad, group))


def fusable_weights(model: nn.Module) -> list[nn.Parameter]:
    """Weights of the parallel linears whose gradient can be fused into a main gradient
    (`wgrad`): trainable, registered once in the model (not tied), and with no tensor hook
    on their gradient (a hook, such as the GQA kv-row sum, must see the whole gradient)."""
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    out = []  # registered once, a weight is met once here
    for module in model.modules():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        w = module.weight
        if (w.requires_grad and uses.get(id(w)) == 1 and not w._backward_hooks
                and not getattr(w, "sequence_parallel", False)):
            out.append(w)
    return out
