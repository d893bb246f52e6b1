"""`ZeroConfig`: the ZeRO / DeepSpeed / FSDP2 flags of `pretrain_gpt.py` (`--deepspeed`,
`--deepspeed_config`, `--zero-stage`, `--offload-optimizer`, `--offload-param`, `--zero-impl`);
`ds_config.build_ds_config` turns them into a DeepSpeed config.
"""
from __future__ import annotations

from dataclasses import dataclass

ZERO_IMPLS = ("none", "deepspeed", "fsdp2")
OFFLOAD_DEVICES = ("none", "cpu", "nvme")


@dataclass
class ZeroConfig:
    """How optimizer state, gradients and parameters are sharded over data-parallel ranks."""

    deepspeed: bool = False
    """Train with DeepSpeed (Megatron-DeepSpeed's flag); implies zero_impl="deepspeed"."""
    deepspeed_config: str | None = None
    """Path of a DeepSpeed JSON config (ZeRO stage, offload, precision, clipping, batches);
    other engines read its batches, clipping, precision, sparse_attention,
    gradient_compression and communication_data_type."""
    zero_stage: int | None = None
    """ZeRO stage 0-3; None: the JSON's value, or 0 without one."""
    offload_optimizer: str | None = None
    """Optimizer state offload device: "none", "cpu" or "nvme"; None: the JSON's value."""
    offload_optimizer_ratio: float | None = None
    """ZeRO-3 partial offload: the fraction of optimizer state (fp32 master, Adam moments, fp32
    gradients) kept on the CPU, the rest on the GPU; None: the JSON's value, or all of it."""
    offload_param: str | None = None
    """Parameter offload device (ZeRO-3 only): "none", "cpu" or "nvme"; None: the JSON's."""
    nvme_path: str | None = None
    """Folder for nvme offload."""
    zero_impl: str = "none"
    """"none" (plain data parallel), "deepspeed", or "fsdp2" (ZeRO-3 with pipelines)."""
    fsdp_reshard_after_forward: bool = True
    """fsdp2: free gathered parameters after each forward (ZeRO-3 memory); with
    --no-fsdp-reshard-after-forward they stay until the backward (fewer all-gathers)."""
    fsdp_blocks_per_unit: int = 2
    """fsdp2: consecutive transformer blocks of a chunk sharded as one FSDP2 unit (one
    all-gather and one reduce-scatter for all of them). FSDP2's hooks cost host time per unit
    (2.1-2.8 ms on an H200 machine's host, `bench/host_pace.py`), which sets the pace where a
    block's GPU work is shorter; N blocks per unit cut that to about 1/N for N times the
    gathered parameters' memory (`megazoo.plan` shows both). 2 by default: on one H200,
    where the host sets gpt-1.3b's pace, it trains about 1.09x as fast as with 1, for 0.1 GB
    more memory; at LLaMA-8B's width, not host-bound, the two are within noise."""
    fsdp_reduce_every_microbatch: bool = True
    """fsdp2 with pp > 1: reduce-scatter gradients after every micro-batch (sharded gradients
    only); with --no-fsdp-reduce-every-microbatch once per chunk after its last micro-batch
    (unsharded gradients held meanwhile, m times fewer reduce-scatters)."""

    def __post_init__(self) -> None:
        if self.deepspeed and self.zero_impl == "none":
            self.zero_impl = "deepspeed"
        if self.zero_impl not in ZERO_IMPLS:
            raise ValueError(f"--zero-impl must be one of {ZERO_IMPLS}, got {self.zero_impl!r}")
        for name in ("offload_optimizer", "offload_param"):
            value = getattr(self, name)
            if value is not None and value not in OFFLOAD_DEVICES:
                raise ValueError(f"--{name.replace('_', '-')} must be one of {OFFLOAD_DEVICES}, "
                                 f"got {value!r}")
        ratio = self.offload_optimizer_ratio
        if ratio is not None and not 0.0 < ratio <= 1.0:
            raise ValueError(f"--offload-optimizer-ratio must be in (0, 1], got {ratio}")
        if isinstance(self.fsdp_blocks_per_unit, bool) or self.fsdp_blocks_per_unit < 1:
            raise ValueError(f"--fsdp-blocks-per-unit must be a positive integer, got "
                             f"{self.fsdp_blocks_per_unit!r}")
        if self.zero_stage is not None and self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"--zero-stage must be 0, 1, 2 or 3, got {self.zero_stage}")
