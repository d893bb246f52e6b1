"""The offloaded plain engine's build without a full fp32 model on the device
(`lean_build`): the same masters and bf16 parameters as today's build, bit for bit, while
at most one sub-module's parameters are live where the model is built.

Tolerance: none (exact equality). Both builds compute every element by the same fp32
counter-based init and cast it by the same round-to-nearest; a master taken from the wrong
flat range, a dropped padding zero or a cast before the masters are taken differs by whole
values, and the 5-block model below shows whether the build is per unit or whole.
"""
import pytest
import torch
from torch.nn.modules import module as nn_module

from megazoo.models import build_model
from megazoo.parallel import ParallelConfig, ParallelState
from megazoo.training.backends import lean_build
from megazoo.training.backends.plain import PlainEngine

from helpers import ddp_checks as checks

BF16 = dict(ddp_bucket_size=3000, bf16=True, optimizer_cpu_offload=True,
            optimizer_offload_fraction=0.5)


class _Recorder:
    """A sink that clones each unit's parameters (as the move to the host does: new storage,
    same values) and tracks the parameter bytes created and not yet sunk."""

    def __init__(self):
        self.live, self.peak, self.sunk = {}, 0, set()

    def created(self, module, name, param):
        if param is not None and id(param) not in self.sunk:
            self.live[id(param)] = param.numel() * param.element_size()
            self.peak = max(self.peak, sum(self.live.values()))

    def __call__(self, module):
        with torch.no_grad():
            for p in module.parameters():
                if id(p) not in self.sunk:
                    p.data = p.data.clone()
                    self.sunk.add(id(p))
                    self.live.pop(id(p), None)


def _engine(args, model):
    return PlainEngine(model, ParallelState.single(), args)


def _today(args, monkeypatch):
    """Today's path: the fp32 model, its flat buffer cast after the masters are taken."""
    with monkeypatch.context() as m:
        m.setattr("megazoo.training.backends.plain.initial_values", lambda *a: None)
        model = build_model(args.model, None, device="cpu", seed=args.training.seed)
        return _engine(args, model)


@pytest.mark.parametrize("extra", [{}, {"optimizer_offload_fraction": 1.0},
                                   {"optimizer_cpu_offload": False,
                                    "optimizer_offload_fraction": 1.0,
                                    "accumulate_grads_in_bf16": True}])
def test_lean_build_equals_todays_build_bit_for_bit(monkeypatch, extra):
    args = checks.make_args(ParallelConfig(), **{**BF16, **extra})
    assert lean_build.lean_build_applies(args)
    ref = _today(args, monkeypatch)
    rec = _Recorder()
    handle = nn_module.register_module_parameter_registration_hook(rec.created)
    try:
        with lean_build.units_to_host(rec):
            model = build_model(args.model, None, device="cpu", seed=args.training.seed)
    finally:
        handle.remove()
    rec(model)
    total = sum(p.numel() * 4 for p in model.parameters())
    block = sum(p.numel() * 4 for p in model.layers["0"].parameters())
    embed = sum(p.numel() * 4 for p in model.embedding.parameters())
    assert rec.peak <= max(block, embed) < total / 2, (rec.peak, block, embed, total)
    # the host check counts the fp32 model as freed while the masters fill
    held = lean_build.initial_values(model, args)
    assert lean_build.held_bytes(held) == total
    new = _engine(args, model)
    assert new.buffers.param_data.dtype == torch.bfloat16
    assert torch.equal(new.buffers.param_data, ref.buffers.param_data)
    want, got = ref.optimizer.full_state(), new.optimizer.full_state()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    # and they train alike from there (same numbers: the same state)
    assert checks.train(new, ParallelState.single(), range(2)) == \
        checks.train(ref, ParallelState.single(), range(2))


def test_lean_build_applies_only_to_the_offloaded_low_precision_plain_engine():
    par = ParallelConfig()
    assert not lean_build.lean_build_applies(checks.make_args(par, **{**BF16, "bf16": False}))
    assert not lean_build.lean_build_applies(
        checks.make_args(par, **{**BF16, "optimizer_cpu_offload": False,
                                 "optimizer_offload_fraction": 1.0}))


def test_host_state_comes_after_the_gpu_shares_initial_values_are_gone(monkeypatch):
    """The host's peak while the engine starts: when a host bucket's pinned state is
    allocated, the fp32 initial values still held are host buckets' own (the GPU share's have
    gone up and been dropped), so the host never holds the GPU share's fp32 values and the
    host state at once (at 5.2B that was 10-17 GB over the plan)."""
    from megazoo.training.backends import cpu_offload

    args = checks.make_args(ParallelConfig(), **BF16)
    held, seen = {}, []
    real_values, real_acquire = lean_build.initial_values, cpu_offload.ResidentStore.acquire

    def values(*a):
        held["values"] = real_values(*a)
        return held["values"]

    def acquire(store, i):
        if store.tensors[i] is None:
            seen.append((store, set(held["values"])))
        return real_acquire(store, i)

    monkeypatch.setattr("megazoo.training.backends.plain.initial_values", values)
    monkeypatch.setattr(cpu_offload.ResidentStore, "acquire", acquire)
    with lean_build.units_to_host():
        model = build_model(args.model, None, device="cpu", seed=args.training.seed)
    engine = _engine(args, model)
    opt = engine.optimizer
    host_params = {id(p) for s in opt.slots if s.host for p in s.bucket.params}
    gpu_params = {id(p) for s in opt.slots if not s.host for p in s.bucket.params}
    on_host = [left for store, left in seen if store is opt.stores.host.memory]
    assert gpu_params and len(on_host) == sum(s.host for s in opt.slots) > 1
    assert all(left <= host_params for left in on_host), "GPU share's values still held"
    assert not held["values"]  # every value dropped once the masters hold it
