"""The `mpu` interface DeepSpeed expects, answered from a `ParallelState`.

DeepSpeed's meanings, which differ from ours in one place: its "model parallel" group is the
tensor-parallel group (pipeline stages are handled by its pipeline engine), and with Ulysses
its ZeRO partitions span the "sequence data parallel" group, our `dp_sp`. Its "sequence
parallel" group is every rank splitting one sequence, our `sp_cp` (Ulysses x context
parallel): DeepSpeed divides its gradient reduction by dp x sp x cp / that group's size.
"""
from __future__ import annotations

from .state import ParallelState


def _accessors(prefix: str, attr: str) -> dict:
    """get_<prefix>_group / _rank / _world_size reading ParallelState.<attr>."""
    return {
        f"get_{prefix}_group": lambda self: getattr(self.state, attr).group,
        f"get_{prefix}_rank": lambda self: getattr(self.state, attr).rank,
        f"get_{prefix}_world_size": lambda self: getattr(self.state, attr).size,
    }


class DeepSpeedMPU:
    """Pass `DeepSpeedMPU(state)` as `mpu=` to `deepspeed.initialize`."""

    def __init__(self, state: ParallelState):
        self.state = state

    def get_tensor_model_parallel_src_rank(self) -> int:
        """Global rank of the first rank of this tensor-parallel group."""
        return self.state.tp.ranks[0]


# DeepSpeed name -> ParallelState group it reads.
_NAMES = {"model_parallel": "tp", "tensor_model_parallel": "tp", "slice_parallel": "tp",
          "pipeline_model_parallel": "pp", "pipe_parallel": "pp", "data_parallel": "dp",
          "sequence_parallel": "sp_cp", "sequence_data_parallel": "dp_sp"}
for _prefix, _attr in _NAMES.items():
    for _name, _fn in _accessors(_prefix, _attr).items():
        setattr(DeepSpeedMPU, _name, _fn)
