"""How many copies of each chunk's CUDA graphs a pipeline stage keeps (`graph_slots`), and
that micro-batch j replaying copy j mod n never takes a copy whose micro-batch is still in
flight, for every schedule the runs use. (The capture itself needs a GPU:
tests/training/test_layouts_gpu.py.)"""
import pytest

from megazoo.pipeline.schedules import Action, ActionKind, build_schedule
from megazoo.training.block_graphs import graph_slots

F, B = ActionKind.F, ActionKind.B


@pytest.mark.parametrize("pp, vpp, m", [(1, 1, 4), (2, 1, 8), (4, 1, 3), (4, 1, 16),
                                        (2, 2, 4), (2, 2, 8), (4, 2, 8), (4, 3, 12)])
def test_no_copy_is_taken_while_its_micro_batch_is_in_flight(pp, vpp, m):
    for rank, program in enumerate(build_schedule(pp, vpp, m)):
        slots = graph_slots(program)
        assert len(slots) == vpp
        holder: dict = {}  # (chunk, copy) -> the micro-batch using it
        for a in program:
            key = (a.chunk, a.microbatch % slots[a.chunk])
            if a.kind == F:
                assert key not in holder, (pp, vpp, m, rank, a, holder)
                holder[key] = a.microbatch
            elif a.kind == B:
                assert holder.pop(key) == a.microbatch
        assert not holder


def test_one_f_one_b_keeps_pp_minus_rank_in_flight():
    assert [graph_slots(p) for p in build_schedule(1, 1, 8)] == [[1]]
    assert [graph_slots(p) for p in build_schedule(4, 1, 16)] == [[4], [3], [2], [1]]
    assert [graph_slots(p) for p in build_schedule(4, 1, 2)] == [[2], [2], [2], [1]]


def test_a_program_out_of_micro_batch_order_is_refused():
    program = [Action(F, 0, 0), Action(F, 0, 1), Action(B, 0, 1), Action(B, 0, 0)]
    with pytest.raises(ValueError, match="out of micro-batch order"):
        graph_slots(program)
