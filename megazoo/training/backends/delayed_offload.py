"""ZeRO-Offload's one-step delayed parameter update (Ren et al. 2021, "DPU") for the plain
engine's offloaded optimizer (--offload-delayed-update, with --optimizer-cpu-offload and
--overlap-cpu-optimizer-d2h-h2d).

Without it the host share's step needs the global gradient norm, so it starts after the last
backward and the next forward waits for it: the host step is exposed. With it the host step
of step t's gradient runs on the worker thread while step t+1 computes, and its parameters
go up at step t+1's optimizer step (after that step's backward has read the old ones),
before step t+2's forward. The GPU share steps at once, as always.

The semantics, precisely. Write M_t for the host share's fp32 masters after t optimizer
steps (M_0 the initial values), P_t for the host share's parameters the forward of step t+1
computes with, and g_t for step t's reduced gradient. Then M_t = AdamW(M_{t-1}, g_t) as
without the delay, P_0 = cast(M_0) and P_t = cast(M_{t-1}) for t >= 1: the gradient
of step t is taken at the host-share parameters of one update earlier. The GPU share's
parameters after t steps are its masters after t steps. With
--offload-delayed-update-start N the first N steps update at once (P_t = cast(M_t) for
t <= N; ZeRO-Offload's warm-up) and the delay starts with step N+1 (convergence beside the
undelayed update: docs/offload.md).

Checkpoints. A save (and a load) first flushes the delay: the in-flight update is sent up, so
the run that saved continues from P_t = cast(M_t), exactly where a run resumed from the
checkpoint starts; the delay goes on from the next step. A save therefore moves that run's
host share one update ahead once, and resuming is exact.
"""
from __future__ import annotations

import torch

from .cpu_offload import DelayedUpdate
from .offload_optimizer import OffloadAdamW


class DelayedOffloadAdamW(OffloadAdamW):
    """`OffloadAdamW` whose host share lands one step late; see the module docstring. Each
    host slot carries its `DelayedUpdate` (an update waiting to go up, and its upload job)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for slot in self.host_order:
            slot.delayed = DelayedUpdate()

    @torch.no_grad()
    def step(self, lr: float, grad_divisor: float = 1.0) -> None:
        if self.step_count < self.plan.delay_start:  # the warm-up: at once
            return super().step(lr, grad_divisor)
        self._send_unsent()  # (each waits for that slot's last host step)
        self._wait_host_steps()
        after = self._begin_step(grad_divisor)
        for slot in self.host_order:  # the last update goes up first (jobs run in order)
            self._send_up(slot, after)
        for slot, nxt in self._host_jobs():
            slot.sent, slot.delayed.stale = False, True
            slot.future = self._worker.submit(self._host_step, slot, nxt, lr, None, False)
        self._device_steps(lr)

    def _send_up(self, slot, after) -> None:
        """Queue the upload of the slot's last update (if one waits)."""
        if slot.delayed.stale:
            slot.delayed.stale, slot.pending = False, True
            slot.delayed.upload = self._worker.submit(self._upload, slot, after)

    def _wait_slot(self, slot, host_step: bool = True) -> None:
        """The slot's upload job first, then as `OffloadAdamW._wait_slot`."""
        if slot.delayed is not None and slot.delayed.upload is not None:
            slot.delayed.upload.result()
            slot.delayed.upload = None
        super()._wait_slot(slot, host_step)

    def _upload(self, slot, after) -> None:
        """The slot's masters through the next ring buffer up to the device after `after`."""
        store = self.stores.host
        ring = self._ring(slot)
        ring[1].copy_(store.acquire(slot.index)["master"])
        self._send_ring(slot, ring, after)
        store.release(slot.index, write=False)

    def _wait_host_steps(self) -> None:
        for slot in self.slots:
            if slot.future is not None:
                slot.future.result()
                slot.future = None

    def wait_params(self, indices=None) -> None:
        """The parameters the next forward uses (the update of one step earlier): the
        uploads only, never the host step in flight (all of it during the warm-up)."""
        slots = self.order if indices is None else [self.slots[i] for i in indices]
        for slot in slots:
            self._wait_slot(slot, host_step=self.step_count <= self.plan.delay_start)

    def flush(self) -> None:
        """Finish the host step in flight and send its parameters up now."""
        self._wait_host_steps()
        after = self.copies.mark()
        for slot in self.host_order:
            self._send_up(slot, after)
        for slot in self.order:
            self._wait_slot(slot)

    def full_state(self) -> dict[str, torch.Tensor]:
        self.flush()
        return super().full_state()

    @torch.no_grad()
    def load_full_state(self, full: dict[str, torch.Tensor], step: int) -> None:
        self.flush()
        super().load_full_state(full, step)
