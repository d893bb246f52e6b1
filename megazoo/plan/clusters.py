"""Clusters as data: `--cluster NAME` (a preset of `clusters.json`) or `--cluster FILE.json`.

A cluster is what the step-time model needs of the machines, all from published specs: the
GPU kind (which calibration fixture its kernel rates are scaled from), its dense bf16 peak,
HBM capacity and bandwidth, GPUs per node, the NVLink bandwidth per GPU and direction, the
inter-node bandwidth per node (`inter_node_gb_s_per_node`) or per GPU
(`inter_node_gb_s_per_gpu`), PCIe per GPU, and the share of each link's bandwidth NCCL's
collectives reach (`*_efficiency`, with the measurement or publication it comes from in
`source`), or, where it was measured, the collectives' bus bandwidth itself
(`collective_bus_gb_s`). A FILE.json holds one such object; missing optional fields take the defaults
below. Every bad value is one line naming the field.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

PRESETS_FILE = Path(__file__).with_name("clusters.json")


@dataclass(frozen=True)
class Cluster:
    """One cluster's published specs (bandwidths in GB/s = 1e9 bytes/s)."""

    name: str
    gpu: str
    """GPU kind, in words."""
    peak_bf16_tflops: float
    """Dense bf16 tensor-core peak of one GPU (datasheet)."""
    hbm_gb: float
    hbm_gb_s: float
    gpus_per_node: int
    intra_node_gb_s: float
    """NVLink bandwidth of one GPU, per direction."""
    inter_node_gb_s_per_node: float | None = None
    """Network bandwidth of one node, per direction (all its NICs)."""
    inter_node_gb_s_per_gpu: float | None = None
    """Or: network bandwidth per GPU (given instead of per node)."""
    pcie_gb_s: float = 32.0
    """Host <-> GPU bandwidth per GPU (offload traffic)."""
    calibration: str = "h100-sxm"
    """Fixture whose measured kernel curves are scaled to this GPU (calibration.py)."""
    intra_node_efficiency: float = 0.77
    """Share of `intra_node_gb_s` a large NCCL collective reaches (bus bandwidth)."""
    inter_node_efficiency: float = 0.85
    """The same for the network."""
    collective_bus_gb_s: float | None = None
    """Measured bus bandwidth of a large NCCL collective inside a node (nccl-tests' busbw:
    a ring all-reduce of B bytes over t ranks takes 2 (t - 1) / t x B / busbw, an all-gather
    or reduce-scatter (t - 1) / t x B / busbw). When given, every collective inside a node
    (tp, SP, Ulysses, dp, ZeRO-3) and the pipeline's sends run at it, in place of
    `intra_node_gb_s` x `intra_node_efficiency`."""
    collective_latency_us: float = 0.0
    """Time, in µs, one NCCL collective call inside a node takes beyond its bytes at
    `collective_bus_gb_s` (its launch and the ring's steps): what makes a 16-32 MB
    all-gather run near half the bus bandwidth of a 1 GiB all-reduce. Added per tp, SP and
    Ulysses collective call, chunked calls counted one by one."""
    overlap_hidden: float = 1.0
    """Share of an overlapped NCCL collective's time that the compute beside it hides (the
    data-parallel buckets behind the backward, ZeRO-3's prefetches): 1 when NCCL's kernels
    and the GEMMs share the GPU without slowing each other, less where the GEMMs hold every
    SM and the collective waits for them."""
    host_adam_params_per_s: float = 1e9
    """CPU optimizer step rate per GPU's share of the host (offload; an assumption, not
    a measurement)."""
    host_block_ms: float | None = None
    """Host time, in ms, to issue one transformer block's forward and backward for one
    micro-batch (Python, autograd, the launches), collectives not counted: a property of
    the host's CPU and of megazoo's code, measured on the cluster's machines. When given,
    a pass whose GPU work is shorter than its host time runs at the host's pace (the step
    time's `host` part); None: the host is assumed to keep ahead of the GPU."""
    host_collective_ms: float = 0.0
    """Host time, in ms, of one tp / sp collective call (torch.distributed and NCCL's
    enqueue), added to `host_block_ms` per call the block issues."""
    host_fsdp2_unit_ms: float = 0.0
    """Host time, in ms, that FSDP2's hooks add to one unit's forward and backward for one
    micro-batch under `--zero-impl fsdp2` (unshard, reshard, their copies' launches; a unit
    is a block, or --fsdp-blocks-per-unit blocks), shared by the unit's blocks and added to
    their `host_block_ms`; `bench/host_pace.py`'s FSDP2 row measures it."""
    host_deepspeed_block_ms: float = 0.0
    """Host time, in ms, that DeepSpeed ZeRO-3's hooks add to a block's forward and backward
    for one micro-batch (its parameter coordinator's fetch and release per submodule, the
    gradient partitioning after each micro-batch), added to `host_block_ms`;
    `bench/host_pace.py`'s DeepSpeed row measures it."""
    source: str = ""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):  # JSON true is not 1 here, "8" not 8
            value, numeric = getattr(self, field.name), "float" in field.type or "int" in field.type
            if numeric and value is not None and (isinstance(value, bool) or not isinstance(
                    value, (int, float)) or ("int" in field.type and not isinstance(value, int))):
                kind = "an integer" if "int" in field.type else "a number"
                raise ValueError(f"cluster {self.name}: {field.name} must be {kind}, got "
                                 f"{json.dumps(value)}")
        for name in ("peak_bf16_tflops", "hbm_gb", "hbm_gb_s", "intra_node_gb_s", "pcie_gb_s",
                     "host_adam_params_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"cluster {self.name}: {name} must be > 0, "
                                 f"got {getattr(self, name)}")
        if self.gpus_per_node < 1:
            raise ValueError(f"cluster {self.name}: gpus_per_node must be >= 1")
        if (self.inter_node_gb_s_per_node is None) == (self.inter_node_gb_s_per_gpu is None):
            raise ValueError(f"cluster {self.name}: give exactly one of inter_node_gb_s_per_node "
                             "and inter_node_gb_s_per_gpu")
        if self.collective_bus_gb_s is not None and not self.collective_bus_gb_s > 0:
            raise ValueError(f"cluster {self.name}: collective_bus_gb_s must be > 0")
        if self.host_block_ms is not None and not self.host_block_ms > 0:
            raise ValueError(f"cluster {self.name}: host_block_ms must be > 0 (or left out)")
        if not self.collective_latency_us >= 0:
            raise ValueError(f"cluster {self.name}: collective_latency_us must be >= 0")
        for name in ("host_collective_ms", "host_fsdp2_unit_ms", "host_deepspeed_block_ms"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"cluster {self.name}: {name} must be >= 0")
        for name in ("intra_node_efficiency", "inter_node_efficiency", "overlap_hidden"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"cluster {self.name}: {name} must be in (0, 1]")

    def link_bytes_s(self, group_span: int) -> float:
        """Bytes/s one GPU reaches in a collective over a group spanning `group_span`
        consecutive ranks: NVLink if they share a node, else the network (its per-GPU share)."""
        if group_span <= self.gpus_per_node:
            if self.collective_bus_gb_s is not None:
                return self.collective_bus_gb_s * 1e9
            return self.intra_node_gb_s * self.intra_node_efficiency * 1e9
        per_gpu = self.inter_node_gb_s_per_gpu
        if per_gpu is None:  # the node's share when every GPU of it sends at once
            per_gpu = self.inter_node_gb_s_per_node / self.gpus_per_node
        return min(self.intra_node_gb_s, per_gpu) * self.inter_node_efficiency * 1e9


def load_cluster(spec: str) -> Cluster:
    """A preset name or a path to a JSON object (ValueError: one line naming the fix)."""
    known = json.loads(PRESETS_FILE.read_text())
    if spec in known:
        fields, name = known[spec], spec
    elif spec.endswith(".json"):
        try:
            fields = json.loads(Path(spec).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"--cluster {spec}: cannot read it as JSON ({exc})") from None
        if not isinstance(fields, dict):
            raise ValueError(f"--cluster {spec} holds a JSON {type(fields).__name__}, not an "
                             f"object: give one object of the cluster's fields")
        name = fields.pop("name", Path(spec).stem)
    else:
        raise ValueError(f"unknown --cluster {spec!r}: give one of {', '.join(known)} or a "
                         "FILE.json")
    allowed = {f.name for f in dataclasses.fields(Cluster)} - {"name"}
    unknown = set(fields) - allowed
    if unknown:
        raise ValueError(f"--cluster {spec}: unknown field(s) {', '.join(sorted(unknown))}; "
                         f"fields: {', '.join(sorted(allowed))}")
    try:
        return Cluster(name=name, **fields)
    except TypeError as exc:  # a required field missing
        raise ValueError(f"--cluster {spec}: {exc}") from None
