"""Where the plain engine keeps its optimizer state: the offload flags and a DeepSpeed JSON's
`zero_optimization.offload_optimizer` / `offload_param`, resolved once.

    plan = plain_offload(args)      # None: masters and moments on the GPU, as always

The plain engine offloads with `--optimizer-cpu-offload`, or when `--offload-optimizer` /
`--offload-param` or the JSON's sections (`device`: cpu | nvme, `nvme_path`, `pin_memory`) ask
for it without a ZeRO engine. Its fp32 masters are optimizer state, so `offload_param` puts
them (with the moments) where it says; the bf16 parameters stay on the GPU. The disk tier is
on when the device is nvme, or when `--nvme-path` comes with `--optimizer-cpu-offload`: the
host share then keeps in memory what fits there and puts the rest on disk.
"""
from __future__ import annotations

from dataclasses import dataclass

from .ds_config import merge_nvme_path, read_ds_config

PLAIN_ONLY = (("optimizer_cpu_offload", "--optimizer-cpu-offload"),
              ("overlap_cpu_optimizer_d2h_h2d", "--overlap-cpu-optimizer-d2h-h2d"),
              ("accumulate_grads_in_bf16", "--accumulate-grads-in-bf16"),
              ("offload_delayed_update", "--offload-delayed-update"),
              ("optimizer_offload_host_memory", "--optimizer-offload-host-memory"))


def check_offload_fraction(fraction: float) -> None:
    """ValueError unless 0 <= --optimizer-offload-fraction <= 1 (the run's and the planner's
    one check)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"--optimizer-offload-fraction must be in [0, 1], got {fraction}")


def fraction_note(fraction: float, host: list[int], buckets: list[int]) -> str | None:
    """A line when the whole buckets on the host (`host`, their element counts, of all
    `buckets`) hold a share far from --optimizer-offload-fraction (0.25 or more off):
    the state is split by gradient bucket, so few buckets cannot split it finely."""
    share = sum(host) / max(sum(buckets), 1)
    if abs(share - fraction) <= 0.25:
        return None
    return (f"--optimizer-offload-fraction {fraction:g} offloads {share:.0%} here: the state "
            f"is split by whole gradient buckets and this run has {len(buckets)}; a smaller "
            f"--ddp-bucket-size splits it finer")


@dataclass(frozen=True)
class OffloadPlan:
    """The plain engine's optimizer offload."""

    fraction: float
    """Share of the optimizer state (whole buckets) on the host / disk."""
    overlap: bool
    """Transfers and the host step overlapped with backward and the next forward."""
    nvme_path: str | None = None
    """The disk tier: what of the host share does not fit host memory lives in files under
    this folder (None: all of it in pinned host memory)."""
    pin_memory: bool = True
    """Page-locked host buffers (the DMA engines copy them without a bounce through pageable
    memory); False only when a JSON says so."""
    delayed: bool = False
    """The host share's update lands one step late (`DelayedOffloadAdamW`)."""
    delay_start: int = 0
    """Optimizer steps updated at once before the delay starts."""
    host_memory: float | None = None
    """With nvme_path: host bytes the host share may take (--optimizer-offload-host-memory);
    None: the host's available memory at start (`offload.split_budget`)."""
    saves: bool = False
    """The run writes checkpoints (gathering full fp32 state on the host: the split leaves
    room for it)."""


def check_plain_only(args) -> None:
    """The plain engine's offload flags with another engine: one line naming the flag."""
    t, zero = args.training, args.zero
    if zero.zero_impl == "none":
        return
    given = [flag for name, flag in PLAIN_ONLY if getattr(t, name)]
    if t.optimizer_offload_fraction != 1.0:
        given.append("--optimizer-offload-fraction")
    if given:
        raise ValueError(f"{given[0]} is for the plain engine (--zero-impl none); "
                         f"--zero-impl {zero.zero_impl} offloads with --offload-optimizer: drop it")


def plain_offload(args) -> OffloadPlan | None:
    """The plain engine's offload plan of `args` (None: no offload); a ValueError naming the
    flag to change when the flags contradict each other."""
    t, zero = args.training, args.zero
    ds, source = read_ds_config(zero.deepspeed_config if zero.zero_impl == "none" else None)
    merge_nvme_path(ds, zero.nvme_path, source)  # a JSON nvme_path must agree with the flag
    zo = ds.get("zero_optimization") or {}  # objects or null: `read_ds_config` checked
    opt, par = zo.get("offload_optimizer") or {}, zo.get("offload_param") or {}
    devices = {zero.offload_optimizer or opt.get("device"), zero.offload_param or par.get("device")}
    devices -= {None, "none"}
    if t.optimizer_cpu_offload:
        devices.add("cpu")
    if not devices:
        if zero.nvme_path and zero.zero_impl == "none":
            raise ValueError("--nvme-path needs --optimizer-cpu-offload (or --offload-optimizer "
                             "nvme): the disk tier holds the offloaded optimizer state")
        if t.optimizer_offload_fraction != 1.0 or t.overlap_cpu_optimizer_d2h_h2d:
            flag = ("--optimizer-offload-fraction" if t.optimizer_offload_fraction != 1.0
                    else "--overlap-cpu-optimizer-d2h-h2d")
            raise ValueError(f"{flag} needs --optimizer-cpu-offload")
        if t.offload_delayed_update or t.optimizer_offload_host_memory is not None:
            flag = ("--offload-delayed-update" if t.offload_delayed_update
                    else "--optimizer-offload-host-memory")
            raise ValueError(f"{flag} needs --optimizer-cpu-offload")
        return None
    if t.offload_delayed_update and not t.overlap_cpu_optimizer_d2h_h2d:
        raise ValueError("--offload-delayed-update needs --overlap-cpu-optimizer-d2h-h2d (the "
                         "host step runs beside the next step)")
    nvme = zero.nvme_path or opt.get("nvme_path") or par.get("nvme_path")
    on_disk = "nvme" in devices or (t.optimizer_cpu_offload and zero.nvme_path)
    if "nvme" in devices and not nvme:
        raise ValueError("offload to nvme needs a folder: pass --nvme-path DIR")
    host_gb = t.optimizer_offload_host_memory
    if host_gb is not None and not on_disk:
        raise ValueError("--optimizer-offload-host-memory splits the host share between memory "
                         "and disk: add --nvme-path DIR (or drop it)")
    pin = bool(opt.get("pin_memory", True)) and bool(par.get("pin_memory", True))
    return OffloadPlan(fraction=t.optimizer_offload_fraction,
                       overlap=t.overlap_cpu_optimizer_d2h_h2d,
                       nvme_path=nvme if on_disk else None, pin_memory=pin,
                       delayed=t.offload_delayed_update,
                       delay_start=t.offload_delayed_update_start,
                       host_memory=None if host_gb is None else host_gb * 1e9,
                       saves=bool(args.checkpoint.save))
