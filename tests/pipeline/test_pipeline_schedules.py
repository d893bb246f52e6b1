"""Pipeline schedules: completeness, deadlock freedom, bubble size, memory, errors, plot.

Everything here is pure data plus the discrete-event simulator: no processes. Times are
small integers, so simulated times are exact in floating point and the bubble checks use
a tolerance only to absorb the final division.
"""

from __future__ import annotations

from collections import Counter
from functools import cache

import pytest

from megazoo.pipeline import (
    Action,
    ActionKind,
    PipelineDeadlockError,
    build_schedule,
    interleaved_schedule,
    no_pipeline_schedule,
    one_f_one_b_schedule,
    simulate,
)
from megazoo.models import layer_ranges
from megazoo.pipeline.schedules import _with_communication

F, B = ActionKind.F, ActionKind.B


def _grid() -> list[tuple[int, int, int]]:
    """(pp, vpp, m) configurations, small ones dense and large ones sampled."""
    configs = []
    for pp in (1, 2, 3, 4, 8, 16, 64):
        for vpp in (1, 2, 4, 8):
            mults = (1, 2, 3, 5) if pp <= 8 else (1, 2)
            ms = [pp * k for k in mults if pp * k * vpp * pp <= 2**15]
            if vpp == 1:  # 1F1B also takes m below or not a multiple of pp
                ms += [m for m in (1, pp - 1, pp + 1, 2 * pp + 3) if m >= 1]
            configs += [(pp, vpp, m) for m in sorted(set(ms))]
    return configs


GRID = _grid()


@cache
def _simulated(pp: int, vpp: int, m: int, tf: float, tb: float):
    """Schedule and its simulation, shared by the tests that look at the same config."""
    schedule = build_schedule(pp, vpp, m)
    return schedule, simulate(schedule, tf, tb)


def _assert_complete(schedule: list[list[Action]], pp: int, vpp: int, m: int) -> None:
    """Every rank runs F and B of every (chunk, micro-batch) exactly once."""
    assert len(schedule) == pp
    expected = Counter((kind, c, mb) for kind in (F, B) for c in range(vpp) for mb in range(m))
    for rank, program in enumerate(schedule):
        computes = Counter((a.kind, a.chunk, a.microbatch) for a in program
                           if a.kind in (F, B))
        assert computes == expected, f"rank {rank}"


@pytest.mark.parametrize("pp,vpp,m", GRID, ids=lambda x: str(x))
def test_complete_and_deadlock_free(pp: int, vpp: int, m: int) -> None:
    schedule, result = _simulated(pp, vpp, m, 1.0, 2.0)  # raises on deadlock or FIFO mismatch
    _assert_complete(schedule, pp, vpp, m)
    assert all(len(t) == 2 * vpp * m for t in result.timelines)


def test_largest_configuration() -> None:
    pp, vpp, m = 64, 8, 512
    schedule = build_schedule(pp, vpp, m)
    _assert_complete(schedule, pp, vpp, m)
    result = simulate(schedule)
    assert result.bubble_ratio == pytest.approx((pp - 1) / (vpp * m), abs=1e-12)


@pytest.mark.parametrize("tf,tb", [(1.0, 2.0), (1.0, 1.0), (2.0, 3.0)])
def test_bubble_is_exactly_p_minus_1_over_v_m(tf: float, tb: float) -> None:
    # 1F1B idles (p-1)*(tf+tb) per rank; interleaving cuts the bubble by v.
    for pp, vpp, m in GRID:
        if pp * vpp * m > 4096:
            continue
        result = _simulated(pp, vpp, m, tf, tb)[1]
        ideal = m * vpp * (tf + tb)
        assert result.ideal_time == ideal
        assert result.makespan - ideal == (pp - 1) * (tf + tb), (pp, vpp, m)
        assert result.bubble_ratio == pytest.approx((pp - 1) / (vpp * m), abs=1e-12)
        assert result.bubble_fraction == pytest.approx(1 - ideal / result.makespan)


def test_one_f_one_b_memory_bound() -> None:
    # Rank r holds its warmup (pp - r - 1) forwards plus one: rank 0 at most pp.
    for pp, vpp, m in GRID:
        if vpp == 1:
            peak = _simulated(pp, 1, m, 1.0, 2.0)[1].peak_inflight
            assert peak == [min(pp - r, m) for r in range(pp)], (pp, m)
            assert peak[0] <= pp


def test_interleaved_memory_bound() -> None:
    # Megatron bound, in (chunk, micro-batch) units: warmup + 1 on rank r, i.e.
    # min(2*(pp - r - 1) + (vpp - 1)*pp + 1, m*vpp); each unit is 1/vpp of the rank's layers.
    for pp, vpp, m in GRID:
        if vpp > 1:
            peak = _simulated(pp, vpp, m, 1.0, 2.0)[1].peak_inflight
            bound = [min(2 * (pp - r - 1) + (vpp - 1) * pp + 1, m * vpp) for r in range(pp)]
            assert peak == bound, (pp, vpp, m)


def test_p2p_latency_slows_but_does_not_deadlock() -> None:
    for pp, vpp, m in [(4, 1, 8), (4, 2, 8), (2, 4, 6), (3, 3, 9)]:
        schedule = build_schedule(pp, vpp, m)
        fast, slow = simulate(schedule), simulate(schedule, p2p_time=0.5)
        assert slow.makespan > fast.makespan


def test_worked_example_and_no_pipeline() -> None:
    ranks = [" | ".join(map(str, program)) for program in one_f_one_b_schedule(2, 3)]
    assert ranks[0].startswith("F c0 m0 | SEND_F c0 m0 ->1 | F c0 m1 | SEND_F c0 m1 ->1 | "
                               "RECV_B c0 m0 <-1 | B c0 m0")
    assert ranks[1].startswith("RECV_F c0 m0 <-0 | F c0 m0 | B c0 m0 | SEND_B c0 m0 ->0")
    assert [str(a) for a in no_pipeline_schedule(2)[0]] == [
        "F c0 m0", "B c0 m0", "F c0 m1", "B c0 m1"]
    # Wrap-around link: the last rank's chunk 0 feeds rank 0's chunk 1.
    last = interleaved_schedule(2, 2, 2)[1]
    assert Action(ActionKind.SEND_F, 0, 0, 0) in last
    assert Action(ActionKind.RECV_F, 1, 0, 1) in interleaved_schedule(2, 2, 2)[0]


def test_receives_follow_the_senders_order() -> None:
    # Rank 1 needs micro-batch 1 before 0; rank 0 sent 0 first, so rank 1 takes both.
    orders = [[(F, 0, 0), (F, 0, 1), (B, 0, 0), (B, 0, 1)],
              [(F, 0, 1), (F, 0, 0), (B, 0, 0), (B, 0, 1)]]
    schedule = _with_communication(orders, 1)
    assert [str(a) for a in schedule[1][:4]] == [
        "RECV_F c0 m0 <-0", "RECV_F c0 m1 <-0", "F c0 m1", "F c0 m0"]
    assert simulate(schedule).makespan == 10.0  # rank 1 waits for both activations


def test_deadlock_names_the_stuck_ranks() -> None:
    recv_b = Action(ActionKind.RECV_B, 0, 0, 1)
    recv_f = Action(ActionKind.RECV_F, 0, 0, 0)
    schedule = [[recv_b, Action(F, 0, 0), Action(ActionKind.SEND_F, 0, 0, 1), Action(B, 0, 0)],
                [recv_f, Action(F, 0, 0), Action(B, 0, 0), Action(ActionKind.SEND_B, 0, 0, 0)]]
    with pytest.raises(PipelineDeadlockError, match=r"rank 0 waits at action 0 \(RECV_B"):
        simulate(schedule)


def test_malformed_schedules_are_reported() -> None:
    send = Action(ActionKind.SEND_F, 0, 0, 1)
    recv = Action(ActionKind.RECV_F, 0, 0, 0)
    cases = [
        ([[Action(B, 0, 0)]], r"B c0 m0\): runs before it has the activation of virtual "
                              r"stage 0 micro-batch 0"),
        ([[Action(F, 0, 0), Action(F, 0, 0)]], r"action 1 \(F c0 m0\): runs twice"),
        ([[send], [recv]], r"SEND_F c0 m0 ->1\): sends a tensor before computing it"),
        ([[Action(F, 0, 0), send, Action(B, 0, 0)], [recv, Action(F, 0, 0), Action(B, 0, 0)]],
         r"rank 0 action 2 \(B c0 m0\): runs before it has the input gradient of virtual "
         r"stage 1"),
        ([[Action(F, 0, 0), send], [Action(F, 0, 0)]],  # rank 1 forgot its receive
         r"rank 1 action 0 \(F c0 m0\): runs before it has the activation of virtual stage 0"),
    ]
    for schedule, message in cases:
        with pytest.raises(ValueError, match=message):
            simulate(schedule)
    with pytest.raises(ValueError, match="sends never received"):
        simulate([[Action(F, 0, 0), send], []])
    with pytest.raises(ValueError, match="forward_time must be > 0"):
        simulate(build_schedule(2, 1, 2), forward_time=0.0)
    with pytest.raises(ValueError, match=r"backward_time has 3 values but the schedule has 4"):
        simulate(build_schedule(2, 2, 2), backward_time=[1.0, 2.0, 3.0])


def test_per_stage_times() -> None:
    """A slow last stage (the head): 1F1B's makespan is (m - 1) * (its tf + tb) plus one
    pass of every stage, the bottleneck stage setting the steady-state pace."""
    tf, tb = [1.0, 1.0, 1.0, 2.0], [2.0, 2.0, 2.0, 4.0]
    for m in (4, 8, 16):
        result = simulate(build_schedule(4, 1, m), tf, tb)
        assert result.makespan == pytest.approx(sum(tf) + sum(tb) + (m - 1) * (2.0 + 4.0))
        uniform = simulate(build_schedule(4, 1, m), [1.0] * 4, [2.0] * 4)
        assert uniform.makespan == simulate(build_schedule(4, 1, m), 1.0, 2.0).makespan


def test_out_of_order_receive_is_reported() -> None:
    good = one_f_one_b_schedule(2, 2)
    rank1 = list(good[1])
    i, j = rank1.index(Action(ActionKind.RECV_F, 0, 0, 0)), rank1.index(
        Action(ActionKind.RECV_F, 0, 1, 0))
    rank1[i], rank1[j] = rank1[j], rank1[i]
    with pytest.raises(ValueError, match="receive in the sender's order"):
        simulate([good[0], rank1])


@pytest.mark.parametrize("args,message", [
    ((4, 2, 6), r"number of micro-batches \(6\) to be a multiple of pp \(4\); use 4 or 8"),
    ((4, 2, 3), r"use 4 \("),
    ((0, 1, 4), r"pp \(pipeline-parallel size\) must be a positive integer, got 0; use pp=1"),
    ((2, 0, 4), r"vpp \(model chunks per rank\) must be a positive integer, got 0"),
    ((2, 1, -3), r"number of micro-batches must be a positive integer, got -3"),
])
def test_bad_schedule_sizes(args: tuple[int, int, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_schedule(*args)


def test_layer_ranges() -> None:
    """The one split of layers over stages (megazoo.models.layer_ranges): chunk c of rank r
    holds block c * pp + r of the model cut into pp * vpp equal blocks."""
    assert [layer_ranges(8, 2, 2, r) for r in (0, 1)] == [[range(0, 2), range(4, 6)],
                                                          [range(2, 4), range(6, 8)]]
    assert [layer_ranges(24, 4, 1, r)[0] for r in range(4)] == [range(i, i + 6) for i in (0, 6, 12, 18)]
    with pytest.raises(ValueError, match=r"num_layers 24 must divide by pp\*vpp = 5"):
        layer_ranges(24, 5, 1, 0)


def test_show_writes_png(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from megazoo.pipeline.show import main

    out = tmp_path / "sched.png"
    assert main(["--pp", "4", "--vpp", "2", "--microbatches", "8", "--out", str(out)]) == out
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit):
        main(["--pp", "4", "--vpp", "2", "--schedule", "1f1b", "--out", str(out)])


def test_show_time_axis_is_per_rank_so_schedules_compare() -> None:
    """--forward-time / --backward-time are a rank's whole share: each of vpp chunks takes
    1/vpp, so every rank is busy m (tf + tb) whatever vpp, and interleaving shortens the
    makespan of the same model (pp 4, m 8: 1F1B (m + p - 1)(tf + tb) = 33, interleaved vpp 2
    (m v + p - 1)(tf + tb) / v = 28.5)."""
    from megazoo.pipeline.show import _parse, simulate_flags

    one = simulate_flags(_parse(["--pp", "4", "--microbatches", "8"]))
    two = simulate_flags(_parse(["--pp", "4", "--vpp", "2", "--microbatches", "8"]))
    assert one.ideal_time == two.ideal_time == 8 * (1.0 + 2.0)
    assert (one.makespan, two.makespan) == (33.0, 28.5)


def test_show_without_matplotlib_is_one_line(tmp_path, monkeypatch, capsys) -> None:
    import sys

    from megazoo.pipeline.show import main

    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(SystemExit) as exit_:
        main(["--out", str(tmp_path / "s.png")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert err.startswith("error: drawing a pipeline schedule needs matplotlib: pip install")
