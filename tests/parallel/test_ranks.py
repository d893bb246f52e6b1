"""Rank enumeration and config validation: pure functions, no processes."""
import itertools
import re

import pytest

from megazoo.parallel import ParallelConfig, ParallelState, coordinates, embedding_groups, rank_groups

LAYOUTS = [dict(tp=t, sp=s, pp=p, dp=d) for t, s, p, d in
           itertools.product([1, 2, 4], [1, 2], [1, 2, 4], [1, 2, 3])]


def test_worked_example():
    sizes = dict(tp=2, sp=1, dp=2, pp=2)
    order = ("tp", "sp", "dp", "pp")
    assert rank_groups(sizes, order, ["tp"]) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert rank_groups(sizes, order, ["dp"]) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert rank_groups(sizes, order, ["pp"]) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert coordinates(5, sizes, order) == dict(tp=1, sp=0, dp=0, pp=1)


@pytest.mark.parametrize("sizes", LAYOUTS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
@pytest.mark.parametrize("order", [("tp", "sp", "dp", "pp"), ("tp", "dp", "sp", "pp"),
                                   ("pp", "dp", "sp", "tp")])
def test_groups_partition_the_world(sizes, order):
    world = sizes["tp"] * sizes["sp"] * sizes["pp"] * sizes["dp"]
    for dims in (["tp"], ["sp"], ["dp"], ["pp"], ["dp", "sp"], ["tp", "sp"]):
        groups = rank_groups(sizes, order, dims)
        expected = 1
        for d in dims:
            expected *= sizes[d]
        assert all(len(g) == expected for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(world))
        for g in groups:  # members differ only along `dims`
            cs = [coordinates(r, sizes, order) for r in g]
            for d in set(sizes) - set(dims):
                assert len({c[d] for c in cs}) == 1
            assert len({tuple(c[d] for d in dims) for c in cs}) == expected
    # the first dimension of `order` is adjacent
    inner = order[0]
    for g in rank_groups(sizes, order, [inner]):
        assert g == list(range(g[0], g[0] + sizes[inner]))


def test_coordinates_invert_rank():
    sizes = dict(tp=2, sp=2, dp=3, pp=2)
    order = ("tp", "sp", "dp", "pp")
    for r in range(24):
        c = coordinates(r, sizes, order)
        assert r == c["tp"] + 2 * (c["sp"] + 2 * (c["dp"] + 3 * c["pp"]))


def test_embedding_groups_are_first_and_last_stage():
    sizes = dict(tp=2, sp=1, dp=1, pp=4)
    order = ("tp", "sp", "dp", "pp")
    assert embedding_groups(sizes, order) == [[0, 6], [1, 7]]
    assert embedding_groups(dict(tp=2, sp=1, dp=1, pp=1), order) == [[0], [1]]


def test_config_resolves_dp_and_prints():
    cfg = ParallelConfig(tp=2, sp=2, pp=2).resolve(16)
    assert cfg.dp == 2 and str(cfg) == "TP2-SP2-PP2-DP2"
    assert ParallelConfig(order="pp-dp-sp-tp").order == ("pp", "dp", "sp", "tp")


@pytest.mark.parametrize("kwargs, world, message", [
    (dict(tp=4), 6, "world size 6 is not divisible by tp*sp*pp = 4"),
    (dict(tp=2, sp=2, dp=3), 8, "pass dp=2"),
    (dict(tp=0), 1, "tp must be a positive integer"),
    (dict(vpp=2), 1, "set pp > 1 or vpp = 1"),
    (dict(order=("tp", "sp", "dp")), 1, "order must be a permutation"),
])
def test_bad_config(kwargs, world, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ParallelConfig(**kwargs).resolve(world)


def test_single_process_state():
    state = ParallelState.single()
    assert state.tp.size == state.dp.size == state.pp.size == 1
    assert state.is_first_stage and state.is_last_stage
    assert str(state) == "TP1-SP1-PP1-DP1 rank 0"
    with pytest.raises(ValueError, match="not divisible"):
        ParallelState.single(ParallelConfig(tp=2))


def test_megatron_sp_is_named_apart_and_megatron_spelling_still_works():
    """Megatron SP is `megatron_sp`; `sequence_parallel=` (Megatron's name, the public keyword)
    builds the same config, and Ulysses stays `sp`."""
    from dataclasses import asdict, replace

    from megazoo.config.flags import parse_args

    new, old = ParallelConfig(tp=2, megatron_sp=True), ParallelConfig(tp=2, sequence_parallel=True)
    assert new == old and old.sequence_parallel and replace(old, dp=1).megatron_sp
    assert asdict(new)["megatron_sp"] and "sequence_parallel" not in asdict(new)
    with pytest.raises(ValueError, match="disagree"):
        ParallelConfig(megatron_sp=True, sequence_parallel=False)
    args = parse_args(["--tp", "2", "--sequence-parallel", "--sequence-parallel-size", "2"])
    assert args.parallel.megatron_sp and args.parallel.sp == 2


def test_context_parallel_worked_example():
    """tp=2, sp=1, cp=2, dp=2 (8 ranks), default order tp, sp, cp, dp, pp: the ring is the
    next dimension out from tp, and the gradient-reduction group dp x sp x cp holds it."""
    cfg = ParallelConfig(tp=2, cp=2).resolve(8)
    assert cfg.dp == 2 and str(cfg) == "TP2-SP1-CP2-PP1-DP2"
    sizes, order = cfg.sizes(), cfg.grid_order
    assert order == ("tp", "sp", "cp", "dp", "pp")
    assert rank_groups(sizes, order, ["cp"]) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert rank_groups(sizes, order, ["dp"]) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert rank_groups(sizes, order, ["dp", "sp", "cp"]) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert coordinates(6, sizes, order) == dict(tp=0, sp=0, cp=1, dp=1, pp=0)


def test_order_without_cp_places_it_after_sp():
    cfg = ParallelConfig(sp=2, cp=2, order="pp-dp-sp-tp")
    assert cfg.order == ("pp", "dp", "sp", "tp")
    assert cfg.grid_order == ("pp", "dp", "sp", "cp", "tp")
    assert ParallelConfig(order="tp-cp-sp-dp-pp").grid_order == ("tp", "cp", "sp", "dp", "pp")


@pytest.mark.parametrize("kwargs, world, message", [
    (dict(cp=2, tp=2), 6, "world size 6 is not divisible by tp*sp*cp*pp = 4"),
    (dict(cp=0), 1, "cp must be a positive integer"),
])
def test_bad_context_parallel_config(kwargs, world, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ParallelConfig(**kwargs).resolve(world)
