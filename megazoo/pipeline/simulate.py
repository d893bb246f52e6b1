"""Discrete-event simulation of a pipeline schedule (no processes, no torch.distributed).

Each rank runs its action list in order with its own clock:

* ``F`` / ``B`` take ``forward_time`` / ``backward_time`` (per chunk per micro-batch).
  ``F`` needs its input activation: none on virtual stage 0, the local forward when the
  previous stage is on the same rank, otherwise an earlier ``RECV_F`` of it. ``B`` needs
  its own ``F`` and its output gradient: none on the last stage (loss is local), the local
  backward when the next stage is on the same rank, otherwise an earlier ``RECV_B``.
* ``SEND_*`` is non-blocking and takes no time on the sender; the tensor reaches the
  receiver ``p2p_time`` after the send is issued. The sender must already hold it.
* ``RECV_*`` blocks until the matching send has arrived. Each ordered pair (src, dst) is
  one FIFO channel: the n-th receive on it must name the n-th tensor sent on it.

Ranks run as far as they can and sleep on an empty channel; a send wakes its receiver, so
the cost is O(total actions). If all ranks sleep before finishing, the schedule
deadlocks and :class:`PipelineDeadlockError` names each stuck rank and its next action.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from megazoo.pipeline.schedules import Action, ActionKind

_F, _B = ActionKind.F, ActionKind.B
_SEND_F, _SEND_B, _RECV_F = ActionKind.SEND_F, ActionKind.SEND_B, ActionKind.RECV_F


class PipelineDeadlockError(RuntimeError):
    """The schedule cannot finish: every unfinished rank waits on a receive."""


class TimelineEntry(NamedTuple):
    """One compute action as it ran on a rank (a named tuple: cheap to build by the
    million)."""

    start: float
    """Simulated start time."""
    end: float
    """Simulated end time."""
    action: Action
    """The F or B action."""


@dataclass(frozen=True)
class SimulationResult:
    """What :func:`simulate` measured.

    With forward time tf and backward time tb per chunk per micro-batch and no link
    latency, the ideal time is ``m * v * (tf + tb)``; 1F1B takes ``(m + p - 1)(tf + tb)``
    and interleaved 1F1B ``(m * v + p - 1)(tf + tb)``, so ``bubble_ratio`` is
    ``(p - 1) / m`` and ``(p - 1) / (v * m)`` respectively.
    """

    timelines: list[list[TimelineEntry]]
    """Per rank, the compute actions (F and B) in execution order with their times."""
    makespan: float
    """Time from 0 until the last compute action of any rank ends."""
    ideal_time: float
    """Busy time of the busiest rank: ``m * v * (tf + tb)`` for a complete schedule."""
    bubble_fraction: float
    """Mean over ranks of ``1 - busy_r / makespan`` (busy_r = the rank's compute time).
    Every rank of a complete schedule is busy ``m * v * (tf + tb)``, so this equals
    ``1 - ideal_time / makespan``."""
    peak_inflight: list[int]
    """Per rank, the most (chunk, micro-batch) activations held at once: forwards done
    whose backward has not run yet. Unit: one chunk of one micro-batch, i.e. 1/v of the
    rank's layers for one micro-batch (with v = 1, whole micro-batches)."""

    @property
    def bubble_ratio(self) -> float:
        """``(makespan - ideal_time) / ideal_time``: idle time relative to the ideal."""
        return (self.makespan - self.ideal_time) / self.ideal_time


def _sizes(schedule: list[list[Action]]) -> tuple[int, int]:
    """(number of virtual stages pp * vpp, number of micro-batches m) of a schedule."""
    chunks = max((a.chunk for program in schedule for a in program), default=0)
    mbs = max((a.microbatch for program in schedule for a in program), default=0)
    return len(schedule) * (chunks + 1), mbs + 1


def _per_stage(times, stages: int, name: str) -> list[float]:
    """A time per virtual stage from one float or a sequence of `stages` floats (all > 0)."""
    values = [float(times)] * stages if isinstance(times, (int, float)) else [float(t) for t in times]
    if len(values) != stages:
        raise ValueError(f"{name} has {len(values)} values but the schedule has {stages} "
                         f"virtual stages (pp * vpp): give one per stage or a single number")
    if min(values) <= 0:
        raise ValueError(f"{name} must be > 0, got {times}")
    return values


class _Run:
    """Mutable state of one simulation; lives only inside :func:`simulate`.

    Tensors are named by int keys ``(stage * m + microbatch) * 2 + is_gradient``: the
    activation (0) or input gradient (1) produced by virtual stage ``stage``.
    """

    def __init__(self, schedule: list[list[Action]], tf, tb, p2p: float):
        self.schedule, self.p2p = schedule, p2p
        self.pp = len(schedule)
        stages, self.m = _sizes(schedule)
        self.last_stage = stages - 1
        self.tf, self.tb = _per_stage(tf, stages, "forward_time"), _per_stage(tb, stages, "backward_time")
        self.pc = [0] * self.pp
        self.clock = [0.0] * self.pp
        self.have: list[set[int]] = [set() for _ in range(self.pp)]  # keys computed/received
        self.inflight = [0] * self.pp
        self.peak = [0] * self.pp
        self.timelines: list[list[TimelineEntry]] = [[] for _ in range(self.pp)]
        self.channels: dict[tuple[int, int], deque] = {}  # (src, dst) -> (key, arrival)
        self.sleeping: set[tuple[int, int]] = set()  # channels whose receiver is blocked

    def describe(self, key: int) -> str:
        """Human name of a tensor key."""
        stage_mb, gradient = divmod(key, 2)
        stage, mb = divmod(stage_mb, self.m)
        what = "input gradient" if gradient else "activation"
        return f"{what} of virtual stage {stage} micro-batch {mb}"

    def _fail(self, rank: int, pc: int, problem: str) -> None:
        """Raise a ValueError naming the rank and action at fault."""
        raise ValueError(f"rank {rank} action {pc} ({self.schedule[rank][pc]}): {problem}")

    def _bad_compute(self, rank: int, pc: int, key: int) -> None:
        """Raise a ValueError saying why compute ``key`` (its output) cannot run."""
        if key in self.have[rank]:
            self._fail(rank, pc, "runs twice; each F and B runs once per rank")
        stage_mb, gradient = divmod(key, 2)
        stage, m2 = stage_mb // self.m, 2 * self.m
        if gradient:  # B: its own forward's output and the next stage's input gradient
            needs = [key - 1] + ([key + m2] if stage < self.last_stage else [])
        else:  # F: the previous stage's output
            needs = [key - m2] if stage > 0 else []
        missing = [self.describe(k) for k in needs if k not in self.have[rank]]
        self._fail(rank, pc, f"runs before it has the {' and the '.join(missing)} "
                   "(its own forward, or a receive placed before it)")

    def advance(self, rank: int) -> list[int]:
        """Run ``rank`` until it finishes or blocks; return the ranks its sends woke."""
        program, pc, pp, m2 = self.schedule[rank], self.pc[rank], self.pp, 2 * self.m
        have, timeline, channels = self.have[rank], self.timelines[rank], self.channels
        clock, inflight, peak = self.clock[rank], self.inflight[rank], self.peak[rank]
        tf, tb, p2p, last_stage = self.tf, self.tb, self.p2p, self.last_stage
        woken: list[int] = []
        while pc < len(program):
            action = program[pc]
            kind = action.kind
            stage = action.chunk * pp + rank
            key = stage * m2 + 2 * action.microbatch
            if kind is _F or kind is _B:
                if kind is _F:
                    ready, duration, delta = not stage or key - m2 in have, tf[stage], 1
                else:
                    ready = key in have and (stage == last_stage or key + m2 + 1 in have)
                    key, duration, delta = key + 1, tb[stage], -1
                if not ready or key in have:
                    self._bad_compute(rank, pc, key)
                have.add(key)
                start, clock = clock, clock + duration
                timeline.append(TimelineEntry(start, clock, action))
                inflight += delta
                if inflight > peak:
                    peak = inflight
            elif kind is _SEND_F or kind is _SEND_B:
                key += kind is _SEND_B
                if key not in have:
                    self._fail(rank, pc, "sends a tensor before computing it")
                pair = (rank, action.peer)
                queue = channels.get(pair)
                if queue is None:
                    queue = channels[pair] = deque()
                queue.append((key, clock + p2p))
                if pair in self.sleeping:
                    self.sleeping.discard(pair)
                    woken.append(action.peer)
            else:
                key = key - m2 if kind is _RECV_F else key + m2 + 1
                pair = (action.peer, rank)
                queue = channels.get(pair)
                if not queue:
                    self.sleeping.add(pair)
                    break
                sent, arrival = queue.popleft()
                if sent != key:
                    self._fail(rank, pc, f"the next tensor on channel {pair[0]}->{rank} is "
                               f"the {self.describe(sent)}; receive in the sender's order")
                have.add(key)
                if arrival > clock:
                    clock = arrival
            pc += 1
        self.pc[rank], self.clock[rank] = pc, clock
        self.inflight[rank], self.peak[rank] = inflight, peak
        return woken

    def run(self) -> None:
        """Advance ranks until all are done; raise PipelineDeadlockError if stuck."""
        ready = deque(range(self.pp))
        while ready:
            ready.extend(self.advance(ready.popleft()))
        stuck = [r for r in range(self.pp) if self.pc[r] < len(self.schedule[r])]
        if stuck:
            detail = "; ".join(f"rank {r} waits at action {self.pc[r]} "
                               f"({self.schedule[r][self.pc[r]]})" for r in stuck[:8])
            raise PipelineDeadlockError(
                f"schedule deadlocks: {len(stuck)} rank(s) stuck: {detail}")
        leftover = {f"{src}->{dst}": len(q) for (src, dst), q in self.channels.items() if q}
        if leftover:
            raise ValueError(f"sends never received (channel: count): {leftover}")


def simulate(
    schedule: list[list[Action]],
    forward_time: float | Sequence[float] = 1.0,
    backward_time: float | Sequence[float] = 2.0,
    p2p_time: float = 0.0,
) -> SimulationResult:
    """Execute ``schedule`` (one action list per rank) in simulated time.

    ``forward_time`` (tf) and ``backward_time`` (tb) are per chunk per micro-batch: one
    number for every stage, or one per virtual stage (``pp * vpp`` of them, in virtual-stage
    order; e.g. a first stage slowed by the embedding, a last one by the head and loss).
    ``p2p_time`` is the latency of one send. Semantics are in the module docstring.
    Raises PipelineDeadlockError if the schedule cannot finish and ValueError if it is
    malformed (a compute before its inputs, an out-of-order receive, an unmatched send).
    """
    if p2p_time < 0:
        raise ValueError(f"p2p_time must be >= 0, got {p2p_time}")
    if not schedule:
        raise ValueError("schedule has no ranks; build one with build_schedule(pp, vpp, m)")
    sim = _Run(schedule, forward_time, backward_time, p2p_time)
    sim.run()
    ends = [t[-1].end for t in sim.timelines if t]
    makespan = max(ends, default=0.0)
    busy = [sum(e.end - e.start for e in t) for t in sim.timelines]
    bubble = sum(1.0 - b / makespan for b in busy) / len(busy) if makespan else 0.0
    return SimulationResult(sim.timelines, makespan, max(busy), bubble, sim.peak)
