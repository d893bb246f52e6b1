"""The offloaded optimizer's one-step delayed update (`delayed_offload`), on CPU in fp32.

The statement checked (the module's docstring): with M_t the host share's masters after t
steps, the host share's parameters the forward of step t+1 uses are cast(M_{t-1}) (t >= 1;
cast(M_0) before the first step), M_t = AdamW(M_{t-1}, g_t), and the GPU share's parameters
are its masters after t steps. Tolerance: none (exact). On CPU every copy is exact and the
step is the same AdamW call on the same numbers; a host bucket sent up a step early or late,
or a gradient taken at the wrong parameters, differs by a whole AdamW step.
"""
import pytest
import torch

from megazoo.parallel import ParallelConfig, ParallelState
from megazoo.config.flags import parse_args
from megazoo.training.backends.delayed_offload import DelayedOffloadAdamW

from helpers import ddp_checks as checks

ONE = ParallelState.single()


def delayed(fraction: float, on: bool = True, start: int = 0) -> dict:
    return dict(ddp_bucket_size=3000, optimizer_cpu_offload=True,
                optimizer_offload_fraction=fraction, overlap_cpu_optimizer_d2h_h2d=True,
                offload_delayed_update=on, offload_delayed_update_start=start)


def _host_masters(opt) -> dict:
    """{slot index: the host slot's fp32 masters now} (after the host step in flight)."""
    getattr(opt, "_wait_host_steps", opt.wait_params)()
    return {s.index: opt.stores.host.acquire(s.index)["master"].clone()
            for s in opt.slots if s.host}


@pytest.mark.parametrize("start", [0, 2])
def test_host_share_runs_one_update_behind_and_the_gpu_share_does_not(start):
    """P_t = cast(M_{t-1}) after the first `start` steps (cast(M_t) during them)."""
    engine, state = checks.engine_for(ParallelConfig(), **delayed(0.5, start=start))
    opt = engine.optimizer
    assert isinstance(opt, DelayedOffloadAdamW)
    assert {s.host for s in opt.slots} == {True, False}
    data = engine.buffers.param_data
    masters = [_host_masters(opt)]  # M_0
    for t in range(1, 5):
        checks.train(engine, state, [t - 1])
        masters.append(_host_masters(opt))
        engine.wait_params()  # what the next forward computes with
        late = t > start
        behind = masters[t - 1 if late else t]
        for s in opt.slots:
            have = data[s.lo:s.hi]
            if s.host:
                assert torch.equal(have, behind[s.index]), (t, s.index)
                assert not late or not torch.equal(have, masters[t][s.index])
            else:
                assert torch.equal(have, opt.stores.gpu.acquire(s.index)["master"]), t


def test_the_first_update_is_the_undelayed_one_and_the_next_gradient_is_taken_before_it():
    plain, state = checks.engine_for(ParallelConfig(), **delayed(1.0, on=False))
    late, _ = checks.engine_for(ParallelConfig(), **delayed(1.0))
    first = checks.train(plain, state, [0])
    assert checks.train(late, state, [0]) == first
    assert _host_masters(late.optimizer).keys() == _host_masters(plain.optimizer).keys()
    for i, m in _host_masters(late.optimizer).items():
        assert torch.equal(m, _host_masters(plain.optimizer)[i])  # M_1 alike
    # everything is on the host: step 2's forward still uses the initial model
    fresh, _ = checks.engine_for(ParallelConfig(), **delayed(1.0, on=False))
    assert checks.train(late, state, [1]) == checks.train(fresh, state, [1])


def test_resume_is_exact(tmp_path):
    path = str(tmp_path / "ck")
    engine, state = checks.engine_for(ParallelConfig(), **delayed(0.5))
    checks.train(engine, state, range(2))
    engine.save(path, {"iteration": 2})
    went_on = checks.train(engine, state, range(2, 5))
    resumed, _ = checks.engine_for(ParallelConfig(), **delayed(0.5))
    resumed.load(path)
    assert checks.train(resumed, state, range(2, 5)) == went_on
    resumed.wait_params(), engine.wait_params()  # (on CPU the worker writes them)
    assert torch.equal(resumed.buffers.param_data, engine.buffers.param_data)
    a, b = resumed.optimizer.full_state(), engine.optimizer.full_state()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("flags, wants", [
    (["--offload-delayed-update"], "needs --optimizer-cpu-offload"),
    (["--offload-delayed-update", "--optimizer-cpu-offload"], "needs --overlap-cpu-optimizer"),
])
def test_delayed_update_without_its_flags_is_one_line(flags, wants):
    from megazoo.config.offload import plain_offload

    with pytest.raises(ValueError, match=wants):
        plain_offload(parse_args(flags))
