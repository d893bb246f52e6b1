"""`ParallelMLP`: the transformer feed-forward block, tensor-parallel (Megatron).

gelu:   x -> Column(h, ffn) -> GeLU -> Row(ffn, h)                 (GPT, BLOOM)
swiglu: x -> FusedColumn(h, [gate ffn; up ffn]) -> silu(gate) * up -> Row(ffn, h)   (LLaMA)

x [s, b, h] -> y [s, b, h]; with sequence_parallel both are the rank's sequence shard
[s/tp, b, h]. The intermediate activation is split over tp along ffn, so no communication
happens between the two matmuls. With `bias_gelu_fusion` (the default) the gelu MLP's local
part runs as `gelu_mlp.gelu_mlp` on CUDA in bf16 / fp16 (fc1's bias and GELU, and GELU's
derivative, inside the GEMMs); the collectives around it are the linears' own. With the
linears' communication chunked (`tp_comm_chunks` > 1, `tp_overlap.py`) the MLP runs through
the linears instead, whose GEMMs then overlap the transfers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.fusion import swiglu
from .fused_linear import FusedColumnParallelLinear
from .gelu_mlp import fusable, gelu_mlp
from .groups import Group, group_size
from .linear import ColumnParallelLinear, RowParallelLinear

ACTIVATIONS = ("gelu", "gelu_exact", "swiglu")


class ParallelMLP(nn.Module):
    """Feed-forward block. `activation`: "gelu" (tanh approximation, as GPT-2 and BLOOM),
    "gelu_exact" (erf) or "swiglu" (gate and up fused in one column-parallel matmul).
    `fp8`: an FP8Recipe for both linears' GEMMs (megazoo/config/precision.py), None: model dtype.
    `bias_gelu_fusion`: the fused local part for "gelu" where it can run (module docstring)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, *, group: Group,
                 activation: str = "gelu", bias: bool = True, sequence_parallel: bool = False,
                 init_method=None, output_init_method=None, device=None, dtype=None, fp8=None,
                 bias_gelu_fusion: bool = True):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.activation, self.bias_gelu_fusion = activation, bias_gelu_fusion
        common = dict(group=group, bias=bias, sequence_parallel=sequence_parallel,
                      device=device, dtype=dtype, fp8=fp8)
        if activation == "swiglu":
            self.fc1 = FusedColumnParallelLinear(hidden_size, (ffn_hidden_size, ffn_hidden_size),
                                                 init_method=init_method, **common)
        else:
            self.fc1 = ColumnParallelLinear(hidden_size, ffn_hidden_size,
                                            init_method=init_method, **common)
        self.fc2 = RowParallelLinear(ffn_hidden_size, hidden_size, init_method=output_init_method,
                                     **common)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gathered = group_size(self.fc1.group) if self.fc1.sequence_parallel else 1
        if (self.bias_gelu_fusion and self.activation == "gelu" and self.fc1.fp8 is None
                and self.fc1.tp_comm_chunks == 1 and fusable(x, self.fc1.weight, gathered)):
            y_partial = gelu_mlp(self.fc1.gather_input(x), self.fc1.weight, self.fc1.bias,
                                 self.fc2.weight, self.fc2.local_bias())
            return self.fc2.reduce(y_partial)
        h_shard = self.fc1(x)  # [s, b, ffn/tp] (x2 for swiglu)
        if self.activation == "swiglu":  # [gate ffn/tp; up ffn/tp]
            h_shard = swiglu(h_shard)
        else:
            approximate = "tanh" if self.activation == "gelu" else "none"
            h_shard = F.gelu(h_shard, approximate=approximate)
        return self.fc2(h_shard)
