"""Pipeline schedules as pure data: for every pipeline rank, the ordered list of actions.

A schedule is ``list[list[Action]]``: one list per pipeline rank, executed top to bottom.
Compute actions are ``F`` / ``B`` (forward / backward of one model chunk on one
micro-batch); communication actions move the activation of a (chunk, micro-batch) to the
next virtual stage (``SEND_F`` / ``RECV_F``) and its input gradient to the previous one
(``SEND_B`` / ``RECV_B``).

Virtual stages. With ``pp`` ranks and ``vpp`` model chunks per rank, chunk ``c`` of rank
``r`` is the global virtual stage ``s = c * pp + r`` (Narayanan et al. 2021). Activations
flow from stage ``s`` to ``s + 1`` and gradients from ``s + 1`` to ``s``; the loss is
computed locally on the last stage, so the last stage sends no activation and the first
stage sends no gradient.

Communication semantics (what the simulator checks and the executor relies on):

* ``SEND_*`` is non-blocking (``isend``): issuing it never waits.
* ``RECV_*`` is blocking (``irecv`` + ``wait``): it completes once the matching send has
  been issued (plus the link latency in the simulator).
* Each ordered pair ``(src, dst)`` is one FIFO channel shared by activations and
  gradients: the receives that ``dst`` posts from ``src`` name exactly the tensors that
  ``src`` sent, in the same order. (NCCL matches untagged point-to-point messages this way.)

Sends are placed right after the compute that produced the tensor. A receive is placed
right before the compute that needs it; if the sender sent other tensors on the same
channel first, those are received just before it, in channel order. Receiving an earlier
message never waits longer than receiving the needed one (it was sent first), so a
schedule built this way deadlocks only if its compute order does, which
:func:`megazoo.pipeline.simulate.simulate` rules out.

Worked example, ``one_f_one_b_schedule(pp=2, m=3)`` (``str(action)`` shown)::

    rank 0: F c0 m0 | SEND_F c0 m0 ->1 | F c0 m1 | SEND_F c0 m1 ->1 | RECV_B c0 m0 <-1 |
            B c0 m0 | F c0 m2 | SEND_F c0 m2 ->1 | RECV_B c0 m1 <-1 | B c0 m1 |
            RECV_B c0 m2 <-1 | B c0 m2
    rank 1: RECV_F c0 m0 <-0 | F c0 m0 | B c0 m0 | SEND_B c0 m0 ->0 | RECV_F c0 m1 <-0 |
            F c0 m1 | B c0 m1 | SEND_B c0 m1 ->0 | RECV_F c0 m2 <-0 | F c0 m2 |
            B c0 m2 | SEND_B c0 m2 ->0

Rank 0 warms up with ``pp - 0 - 1 = 1`` forward, then alternates one forward and one
backward, then cools down with the remaining backward; rank 1 (last stage) has no warmup.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ActionKind(enum.StrEnum):
    """What an action does; the string value is the short name used in tables."""

    F = "F"
    """Forward of one chunk on one micro-batch."""
    B = "B"
    """Backward of one chunk on one micro-batch (needs its own forward done first)."""
    SEND_F = "SEND_F"
    """Send the output activation of (chunk, micro-batch) to the next virtual stage."""
    RECV_F = "RECV_F"
    """Receive the input activation of (chunk, micro-batch) from the previous stage."""
    SEND_B = "SEND_B"
    """Send the input gradient of (chunk, micro-batch) to the previous virtual stage."""
    RECV_B = "RECV_B"
    """Receive the output gradient of (chunk, micro-batch) from the next virtual stage."""


@dataclass(frozen=True, slots=True)
class Action:
    """One step of a rank's program.

    ``chunk`` is always the acting rank's *local* model chunk (0 <= chunk < vpp): for a
    send, the chunk that produced the tensor; for a receive, the chunk that will consume
    it. On the wrap-around link (last rank -> rank 0) rank ``pp-1`` sends chunk ``c`` and
    rank 0 receives it as chunk ``c + 1``.
    """

    kind: ActionKind
    """What to do."""
    chunk: int
    """Local model chunk on the acting rank."""
    microbatch: int
    """Micro-batch index, 0 <= microbatch < m."""
    peer: int | None = None
    """Peer rank for SEND_*/RECV_* (destination / source); None for F and B."""

    def __str__(self) -> str:
        text = f"{self.kind.value} c{self.chunk} m{self.microbatch}"
        if self.kind in (ActionKind.SEND_F, ActionKind.SEND_B):
            return f"{text} ->{self.peer}"
        if self.kind in (ActionKind.RECV_F, ActionKind.RECV_B):
            return f"{text} <-{self.peer}"
        return text


def virtual_stage(rank: int, chunk: int, pp: int) -> int:
    """Global virtual stage of local ``chunk`` on ``rank``: ``chunk * pp + rank``."""
    return chunk * pp + rank


def _check_positive(name: str, value: int, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}; {hint}")


def _check_sizes(pp: int, vpp: int, m: int) -> None:
    _check_positive("pp (pipeline-parallel size)", pp, "use pp=1 for no pipeline")
    _check_positive("vpp (model chunks per rank)", vpp, "use vpp=1 for plain 1F1B")
    _check_positive("the number of micro-batches", m, "use at least pp micro-batches")


def _check_interleavable(pp: int, vpp: int, m: int) -> None:
    """The interleaved schedule walks micro-batches in groups of pp."""
    if m % pp == 0:
        return
    lower, upper = (m // pp) * pp, (m // pp + 1) * pp
    use = f"{lower} or {upper}" if lower else f"{upper}"
    raise ValueError(
        f"interleaved schedule needs the number of micro-batches ({m}) to be a multiple "
        f"of pp ({pp}); use {use} (or vpp=1 for plain 1F1B; vpp is {vpp})"
    )


Compute = tuple[ActionKind, int, int]
"""(F or B, local chunk, micro-batch): one entry of a rank's compute order."""


def _warmup_then_1f1b(
    fwd: list[tuple[int, int]], bwd: list[tuple[int, int]], warmup: int
) -> list[Compute]:
    """``warmup`` forwards, then one forward + one backward at a time, then backwards."""
    warmup = min(warmup, len(fwd))
    order: list[Compute] = [(ActionKind.F, c, mb) for c, mb in fwd[:warmup]]
    for k in range(len(fwd) - warmup):
        order.append((ActionKind.F, *fwd[warmup + k]))
        order.append((ActionKind.B, *bwd[k]))
    order += [(ActionKind.B, c, mb) for c, mb in bwd[len(fwd) - warmup :]]
    return order


Channels = dict[tuple[int, int], list[tuple[ActionKind, int, int]]]
"""(src, dst) -> keys (F or B, producing virtual stage, micro-batch) in send order."""


def _place_sends(
    orders: list[list[Compute]], vpp: int
) -> tuple[list[list[Action | None]], Channels]:
    """The send that follows each compute (None if the tensor stays local), per rank."""
    pp, last = len(orders), len(orders) * vpp - 1
    channels: Channels = {}
    sends: list[list[Action | None]] = []
    for rank, order in enumerate(orders):
        rank_sends: list[Action | None] = []
        for kind, chunk, mb in order:
            stage = chunk * pp + rank
            target = stage + 1 if kind is ActionKind.F else stage - 1
            dst = target % pp
            if 0 <= target <= last and dst != rank:
                send = ActionKind.SEND_F if kind is ActionKind.F else ActionKind.SEND_B
                rank_sends.append(Action(send, chunk, mb, dst))
                channels.setdefault((rank, dst), []).append((kind, stage, mb))
            else:
                rank_sends.append(None)
        sends.append(rank_sends)
    return sends, channels


def _with_communication(orders: list[list[Compute]], vpp: int) -> list[list[Action]]:
    """Insert sends after producers and FIFO-ordered receives before consumers.

    Before a compute that needs tensor X from rank ``src``, receive every tensor that
    ``src`` sent on this channel up to and including X and not yet received.
    """
    pp, last = len(orders), len(orders) * vpp - 1
    sends, channels = _place_sends(orders, vpp)
    received = dict.fromkeys(channels, 0)
    shared: dict[Compute, Action] = {}  # F/B actions are identical on every rank
    programs: list[list[Action]] = []
    for rank, order in enumerate(orders):
        program: list[Action] = []
        early: set[tuple[ActionKind, int, int]] = set()  # received before they are needed
        for compute, send in zip(order, sends[rank]):
            kind, chunk, mb = compute
            source = chunk * pp + rank + (-1 if kind is ActionKind.F else 1)
            src = source % pp
            needed = (kind, source, mb)
            if not 0 <= source <= last or src == rank:
                pass  # first/last virtual stage, or the neighbour chunk is local
            elif needed in early:
                early.remove(needed)
            else:
                keys, done = channels[(src, rank)], received[(src, rank)]
                upto = received[(src, rank)] = keys.index(needed, done) + 1
                for key_kind, key_stage, key_mb in keys[done:upto]:
                    forward = key_kind is ActionKind.F
                    user = key_stage + 1 if forward else key_stage - 1
                    recv = ActionKind.RECV_F if forward else ActionKind.RECV_B
                    program.append(Action(recv, user // pp, key_mb, src))
                early.update(keys[done : upto - 1])
            action = shared.get(compute)
            if action is None:
                action = shared[compute] = Action(kind, chunk, mb)
            program.append(action)
            if send is not None:
                program.append(send)
        programs.append(program)
    return programs


def no_pipeline_schedule(m: int) -> list[list[Action]]:
    """pp = 1 gradient accumulation: ``F0 B0 F1 B1 ...`` on a single rank."""
    _check_sizes(1, 1, m)
    order = [(kind, 0, mb) for mb in range(m) for kind in (ActionKind.F, ActionKind.B)]
    return [[Action(kind, chunk, mb) for kind, chunk, mb in order]]


def one_f_one_b_schedule(pp: int, m: int) -> list[list[Action]]:
    """PipeDream-flush / Megatron 1F1B with one model chunk per rank.

    Rank ``r`` runs ``min(pp - r - 1, m)`` warmup forwards, then alternates one forward
    and one backward, then runs the remaining backwards. Micro-batches go in order.
    Rank ``r`` holds at most ``min(pp - r, m)`` micro-batches of activations.
    """
    _check_sizes(pp, 1, m)
    mbs = [(0, mb) for mb in range(m)]
    orders = [_warmup_then_1f1b(mbs, mbs, pp - rank - 1) for rank in range(pp)]
    return _with_communication(orders, 1)


def _interleaved_order(pp: int, vpp: int, k: int, forward: bool) -> tuple[int, int]:
    """(chunk, micro-batch) of a rank's k-th forward (or backward) in the interleaved order.

    Micro-batches go in groups of pp: a group runs through chunk 0, then chunk 1, ...
    (backward: chunk vpp-1 first) before the next group starts.
    """
    group, within = divmod(k, pp * vpp)
    chunk = within // pp
    if not forward:
        chunk = vpp - 1 - chunk
    return chunk, group * pp + within % pp


def interleaved_schedule(pp: int, vpp: int, m: int) -> list[list[Action]]:
    """Interleaved 1F1B (Narayanan et al. 2021) with ``vpp`` model chunks per rank.

    Each rank runs ``m * vpp`` forwards and backwards. Rank ``r`` warms up with
    ``min((pp - r - 1) * 2 + (vpp - 1) * pp, m * vpp)`` forwards (Megatron's count), then
    alternates one forward and one backward, then drains the remaining backwards. Rank
    ``r`` therefore holds at most ``min(warmup + 1, m * vpp)`` (chunk, micro-batch)
    activations, each 1/vpp of the rank's layers. Requires ``m % pp == 0``; with
    ``p2p_time = 0`` the bubble is ``(pp - 1) / (vpp * m)`` of the ideal time.
    """
    _check_sizes(pp, vpp, m)
    _check_interleavable(pp, vpp, m)
    total = m * vpp
    fwd = [_interleaved_order(pp, vpp, k, True) for k in range(total)]
    bwd = [_interleaved_order(pp, vpp, k, False) for k in range(total)]
    orders = [
        _warmup_then_1f1b(fwd, bwd, (pp - rank - 1) * 2 + (vpp - 1) * pp)
        for rank in range(pp)
    ]
    return _with_communication(orders, vpp)


def build_schedule(pp: int, vpp: int, m: int) -> list[list[Action]]:
    """Schedule for ``pp`` ranks, ``vpp`` chunks per rank and ``m`` micro-batches.

    ``pp = vpp = 1``: :func:`no_pipeline_schedule`; ``vpp = 1``:
    :func:`one_f_one_b_schedule`; ``vpp > 1``: :func:`interleaved_schedule` (needs
    ``m % pp == 0``). Raises ValueError saying what to change for invalid sizes.
    """
    _check_sizes(pp, vpp, m)
    if vpp > 1:
        return interleaved_schedule(pp, vpp, m)
    if pp == 1:
        return no_pipeline_schedule(m)
    return one_f_one_b_schedule(pp, m)
