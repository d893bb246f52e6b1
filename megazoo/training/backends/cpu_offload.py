"""The host side of the plain engine's optimizer offload: which buckets go to the host, the
AdamW kernel on a bucket's shard, the copies between the GPU and pinned host buffers, and
the in-memory state store (the disk one is `state_store.NvmeStateStore`, same interface).

    slots = bucket_slots(buffers, fraction)      # one per bucket: shard range, pieces, place
    copies = Transfers(device)                   # CUDA: side streams + events; CPU: copies
    adamw_(state, grad, slot, lr, cfg, divisor)  # torch's AdamW kernel over the slot's pieces

Transfers. On CUDA gradient shards go down and parameters up on two side streams, each copy
marked by an event the other side waits for only when it needs the data. On CPU (the tests,
the CPU run) every copy is a plain copy; only the CUDA branch touches torch.cuda.

The kernel is torch's functional AdamW (`torch.optim.adamw.adamw`), the function the
un-offloaded engine's optimizer calls, over the same per-parameter pieces, so an offloaded
step computes the same numbers: fused (`torch._fused_adamw_`, on CPU and GPU) where the
device has it, else the foreach implementation. bench/offload_bench.py measures it beside
DeepSpeed's CPUAdam on the GPU host.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch
from torch.optim.adamw import adamw
from torch.optim.optimizer import _get_fused_kernels_supported_devices

from ...offload.buckets import host_share as share_of

NAMES = ("master", "exp_avg", "exp_avg_sq")
HOST, GPU = "host", "gpu"  # the two places a slot's state lives
T = TypeVar("T")


@dataclass
class Sides(Generic[T]):
    """One value for each side, by name: `sides[slot.side]`, `sides.host`, `sides.gpu`."""

    host: T
    gpu: T

    def __getitem__(self, side: str) -> T:
        if side not in (HOST, GPU):
            raise KeyError(f"a side is {HOST!r} or {GPU!r}, got {side!r}")
        return self.host if side == HOST else self.gpu

    def both(self) -> tuple[T, T]:
        return self.host, self.gpu


@dataclass
class DelayedUpdate:
    """A host slot's state under the delayed update (`delayed_offload.py`)."""

    stale: bool = False
    """The host has (or is computing) an update not sent up yet."""
    upload: object = None
    """The worker's job sending the last update's parameters up (a Future), or None."""


@dataclass
class Slot:
    """One bucket's shard of the optimizer: flat range [lo, hi), its parameters' pieces
    (start, end, decayed) in shard coordinates, and where its state lives (HOST or GPU)."""

    bucket: object
    lo: int
    hi: int
    pieces: list
    side: str
    index: int = -1
    """Position in the state store of its place (host or GPU)."""
    steps: dict = field(default_factory=dict)
    """{decayed: [step counter per piece]} (the kernel advances each)."""
    grad: torch.Tensor | None = None
    """Host slots: the pinned buffer the reduced gradient shard is copied down into."""
    d2h: object = None
    h2d: object = None
    sent: bool = False
    future: object = None
    gather: object = None
    pending: bool = False
    delayed: DelayedUpdate | None = None
    """The delayed update's state (host slots of `DelayedOffloadAdamW` only)."""

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    @property
    def host(self) -> bool:
        """Whether the state lives on the host."""
        return self.side == HOST


def host_share(buckets, fraction: float) -> set[int]:
    """Indices of the buckets whose state goes to the host (`offload.buckets.host_share`, the
    rule the planner applies)."""
    return {buckets[i].index for i in share_of([b.numel for b in buckets], fraction)}


def bucket_slots(buffers, fraction: float) -> list[Slot]:
    """One Slot per bucket of `buffers`, its shard range this rank's (`shard_ranges`)."""
    host = host_share(buffers.buckets, fraction)
    slots, counts = [], {HOST: 0, GPU: 0}
    for bucket, (lo, hi) in zip(buffers.buckets, buffers.shard_ranges()):
        pieces = [(a - lo, b - lo, p.ndim >= 2) for p, a, b in buffers.pieces(bucket, lo, hi)]
        on_host = bucket.index in host
        # a step counter per piece (as torch's optimizer keeps them), where the state lives
        device = torch.device("cpu") if on_host else buffers.param_data.device
        steps = {decay: [torch.zeros((), dtype=torch.float32, device=device)
                         for *_, d in pieces if d is decay] for decay in (True, False)}
        side = HOST if on_host else GPU
        slots.append(Slot(bucket, lo, hi, pieces, side, index=counts[side], steps=steps))
        counts[side] += 1
    return slots


@torch.no_grad()
def adamw_(state: dict, grad: torch.Tensor, slot: Slot, lr: float, cfg,
           divisor: torch.Tensor | None) -> None:
    """One AdamW step of `slot` on `state` ({master, exp_avg, exp_avg_sq}, fp32, the slot's
    numel) with the fp32 gradient `grad`, divided by `divisor` (None: 1) inside the kernel;
    decayed and undecayed pieces as two calls (Megatron's weight-decay grouping)."""
    fused = state["master"].device.type in _get_fused_kernels_supported_devices()
    for decay in (True, False):
        sel = [(a, b) for a, b, d in slot.pieces if d is decay]
        if not sel:
            continue
        steps = slot.steps[decay]
        views = [[t[a:b] for a, b in sel] for t in (state["master"], grad, state["exp_avg"],
                                                     state["exp_avg_sq"])]
        adamw(*views, [], steps, foreach=None if fused else True, fused=fused or None,
              grad_scale=divisor, amsgrad=False, beta1=cfg.adam_beta1, beta2=cfg.adam_beta2,
              lr=lr, weight_decay=cfg.weight_decay if decay else 0.0, eps=cfg.adam_eps,
              maximize=False)


def adamw_piece(start: int, end: int, lr: float, weight_decay: float, step: int, beta1: float,
                beta2: float) -> tuple:
    """A one-pass kernel's piece: (start, end, lr x weight decay, step size, sqrt of the
    second bias correction) at AdamW step `step` (torch's fused AdamW's scalars)."""
    return (start, end, lr * weight_decay, lr / (1 - beta1 ** step),
            (1 - beta2 ** step) ** 0.5)


def fused_adamw_(kernel, state: dict, grad: torch.Tensor, slot: Slot, lr: float, cfg,
                 divisor: torch.Tensor, out: torch.Tensor | None, step: int | None = None) -> None:
    """`adamw_` through a one-pass kernel (`one_pass_kernel`): the slot's pieces in memory
    order, `grad` bf16 or fp32 as accumulated, the new parameters into `out` if given. Each
    piece's step counter advances as torch's would; the kernel takes `step` (device slots:
    no host sync) or, for None, the counters' own values (host slots: CPU tensors)."""
    pieces = []
    for decay in (True, False):
        sel = [(a, b) for a, b, d in slot.pieces if d is decay]
        if step is not None and slot.steps[decay]:
            torch._foreach_add_(slot.steps[decay], 1)
        for (a, b), counter in zip(sel, slot.steps[decay]):
            if step is None:
                counter += 1
            pieces.append(adamw_piece(a, b, lr, cfg.weight_decay if decay else 0.0,
                                      int(counter) if step is None else step, cfg.adam_beta1,
                                      cfg.adam_beta2))
    kernel(state, grad, sorted(pieces), out=out, divisor=divisor, beta1=cfg.adam_beta1,
           beta2=cfg.adam_beta2, eps=cfg.adam_eps)


def one_pass_kernel(device: torch.device):
    """The one-pass AdamW for state on `device`, or None (torch's `adamw_` then): the C
    kernel of `kernels.host_adamw` on the host, `kernels.triton_adamw` on a CUDA GPU."""
    if device.type == "cpu":
        from ...kernels.host_adamw import host_adamw

        return host_adamw()
    from ...kernels._dispatch import triton_module, triton_status

    return triton_module("adamw").adamw_ if device.type == "cuda" and triton_status()[0] else None


class SlotAdamW:
    """AdamW over the slots of one place (host or GPU): the one-pass kernel where there is
    one (`kernel`: True to look it up), else torch's AdamW over an fp32 upcast of the
    gradient (a scratch of `size` elements) and a separate cast into the parameters."""

    def __init__(self, device: torch.device, size: int, kernel: bool):
        self.device, self.size = device, size
        self.kernel = one_pass_kernel(device) if kernel else None
        self.scratch = None

    def one_pass(self, grad_dtype: torch.dtype) -> bool:
        """Whether gradients of `grad_dtype` step through the one-pass kernel."""
        return self.kernel is not None and grad_dtype in (torch.float32, torch.bfloat16)

    def scratch_bytes(self, grad_dtype: torch.dtype) -> int:
        """Bytes of the fp32 scratch a step with `grad_dtype` gradients allocates: none for
        fp32 ones or where the one-pass kernel reads them (the host split counts the rest)."""
        upcast = grad_dtype != torch.float32 and not self.one_pass(grad_dtype)
        return 4 * self.size if upcast else 0

    def __call__(self, state: dict, grad: torch.Tensor, slot: Slot, lr: float, cfg,
                 divisor: torch.Tensor, out: torch.Tensor | None, step: int | None = None):
        """Step `state` with `grad`; `out` (if given) gets the new parameters; `step`: as in
        `fused_adamw_`."""
        direct = None
        if self.one_pass(grad.dtype):
            direct = out if out is not None and out.dtype == torch.bfloat16 else None
            fused_adamw_(self.kernel, state, grad, slot, lr, cfg, divisor, direct, step)
        else:
            if grad.dtype != torch.float32:
                if self.scratch is None:
                    self.scratch = torch.empty(self.size, dtype=torch.float32, device=self.device)
                grad = self.scratch[:grad.numel()].copy_(grad)
            adamw_(state, grad, slot, lr, cfg, divisor)
        if out is not None and direct is None:
            out.copy_(state["master"])


class ResidentStore:
    """State kept in memory (pinned host memory, or the GPU): `NvmeStateStore`'s interface
    with nothing to read or write. A shard is allocated (zeros) when first acquired, so the
    GPU share's moments need no memory while the model is still fp32 at start-up."""

    def __init__(self, numels: list[int], device, pin: bool):
        self.numels, self.device, self.pin = numels, device, pin
        self.tensors: list[dict | None] = [None] * len(numels)

    def prefetch(self, i: int) -> None:
        pass

    def acquire(self, i: int) -> dict:
        if self.tensors[i] is None:
            self.tensors[i] = {k: torch.zeros(self.numels[i], dtype=torch.float32,
                                              device=self.device, pin_memory=self.pin)
                               for k in NAMES}
        return self.tensors[i]

    def release(self, i: int, write: bool = True) -> None:
        pass

    def flush(self) -> None:
        pass


class Transfers:
    """Copies between the device and host buffers; see the module docstring."""

    def __init__(self, device: torch.device, pin: bool = True):
        self.device, self.cuda = device, device.type == "cuda"
        self.pin = pin and self.cuda
        if self.cuda:
            self.down = torch.cuda.Stream(device)
            self.up = torch.cuda.Stream(device)

    def host_empty(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(n, dtype=dtype, pin_memory=self.pin)

    def mark(self):
        """An event at the compute stream's current position (None on CPU)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, after=None):
        """dst (host) <- src (device) after the compute stream's work so far (or once the
        event `after` has passed: from a worker thread); its event."""
        if not self.cuda:
            dst.copy_(src)
            return None
        if after is None:
            self.down.wait_stream(torch.cuda.current_stream(self.device))
        else:
            self.down.wait_event(after)
        with torch.cuda.device(self.device), torch.cuda.stream(self.down):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.down)
        return event

    def to_device(self, dst: torch.Tensor, src: torch.Tensor, after=None):
        """dst (device) <- src (host) once `after` (an event) has passed; its event. Safe to
        call from a worker thread."""
        if not self.cuda:
            dst.copy_(src)
            return None
        with torch.cuda.device(self.device), torch.cuda.stream(self.up):
            if after is not None:
                self.up.wait_event(after)
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.up)
        return event

    def device_waits(self, event) -> None:
        """The compute stream waits for `event` (a no-op for None)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    @staticmethod
    def host_waits(event) -> None:
        """The calling thread waits for `event` (a no-op for None)."""
        if event is not None:
            event.synchronize()
