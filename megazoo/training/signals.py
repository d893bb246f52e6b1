"""Ctrl-C (SIGINT) and SIGTERM during training: finish the step, save, stop with one line.

    with StopSignals() as stop:
        for it in ...:
            ...one step...
            signum = stop.agreed(state, device)   # collective when there are several ranks
            if signum: save, then raise TrainingInterrupted

The handler only notes the signal, so the step under way ends normally and the checkpoint
written after it is a complete one that resumes bit for bit, like any other (Megatron's
--exit-signal-handler, on by default here). A second signal while that save runs stops at
once (KeyboardInterrupt), as an impatient user expects. Under torchrun every rank must stop at
the same iteration: the ranks agree on it with one small all-reduce per step (the step's loss
is read back on the host anyway, so it adds no synchronisation).
"""
from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingInterrupted(Exception):
    """A signal stopped the run after a save; `code` is the exit status (128 + the signal)."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.code = 128 + signum


class StopSignals:
    """Notes SIGINT / SIGTERM while active (main thread only; elsewhere it notes nothing)."""

    def __init__(self):
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.received is not None:  # the second one: stop now
            raise KeyboardInterrupt
        self.received = signum

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def agreed(self, state, device) -> int | None:
        """The signal any rank received (None: none); collective when world_size > 1."""
        if state.world_size == 1:
            return self.received
        flag = torch.tensor([self.received or 0], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item()) or None


def interrupted_message(signum: int, iteration: int, saved: str | None, save_dir: str) -> str:
    """The one line an interrupted run ends with."""
    name = signal.Signals(signum).name
    if saved is None:
        return (f"{name} at iteration {iteration}: stopped; nothing saved (no --save), pass "
                f"--save DIR to keep a checkpoint when interrupted")
    return (f"{name} at iteration {iteration}: saved {saved}; resume with --load {save_dir} "
            f"(same flags)")
