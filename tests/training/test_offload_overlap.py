"""--overlap-cpu-optimizer-d2h-h2d computes what the offload without it computes, bit for bit.

With the overlap a worker thread steps the host buckets while the next forward runs, and
every read of a parameter must wait for its bucket's new values. The runs (`overlap_checks`)
train with the model's id check off, as pretrain_gpt.py does, and compare the losses, fp32
masters, moments and parameters with torch.equal (fp32 on CPU: the same AdamW over the same
pieces in the same order, so nothing but an ordering fault can move a bit). Each case runs
once with a slowed worker, where a read that does not wait sees the old values every time,
then REPEATS times as it comes: at one and two ranks (distributed optimizer), in memory and
split with the disk tier, and the delayed update against its own runs (it has no
un-overlapped twin).
"""
import pytest

from megazoo.testing import run_distributed

from helpers import overlap_checks as checks
from helpers.ddp_checks import one_thread

TIMEOUT = 600


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_overlap_equals_the_step_without_it(fraction):
    assert one_thread(checks.repeated, {}, fraction=fraction) == []


def test_overlap_with_the_disk_tier_equals_the_step_without_it(tmp_path):
    budget = checks.split_budget()
    assert one_thread(checks.repeated, {}, nvme=str(tmp_path),
                       optimizer_offload_host_memory=budget) == []


def test_delayed_update_gives_the_same_numbers_every_run(tmp_path):
    delayed = {"offload_delayed_update": True}
    assert one_thread(checks.repeated, None, **delayed) == []
    budget = checks.split_budget(**delayed)
    assert one_thread(checks.repeated, None, nvme=str(tmp_path),
                       optimizer_offload_host_memory=budget, **delayed) == []


def _two_ranks(nvme: str) -> list[str]:
    dist = {"use_distributed_optimizer": True, "overlap_grad_reduce": True,
            "overlap_param_gather": True}
    budget = checks.split_budget(**dist)  # (of this rank's shards; each rank's store has a
    return (checks.repeated({}, **dist)  # folder of its own under --nvme-path)
            + checks.repeated({}, nvme=nvme, optimizer_offload_host_memory=budget, **dist))


def test_two_ranks_overlap_equals_the_step_without_it(tmp_path):
    results = run_distributed(_two_ranks, 2, str(tmp_path), timeout=TIMEOUT)
    assert results == [[], []]


@pytest.mark.parametrize("family", ["gpt", "bloom", "llama"])
def test_every_parameter_is_waited_for_before_the_forward_reads_it(family):
    """The forward pre-hooks (`hook_bucket_waits`, one bucket per parameter here) against
    every torch call of a forward with the id check off: no call may receive a parameter
    whose bucket was not waited for (the embedding's check-free lookup and LLaMA's untied
    head read theirs past their own modules' calls)."""
    import torch
    from torch.overrides import TorchFunctionMode
    from types import SimpleNamespace

    from megazoo.models import ModelConfig, build_model
    from megazoo.training.backends.master_optimizer import hook_bucket_waits

    cfg = ModelConfig(family=family, num_layers=2, hidden_size=32, num_attention_heads=4,
                      vocab_size=64, max_position_embeddings=16)
    model = build_model(cfg, state=None, device="cpu", seed=0)
    model.check_inputs = False
    params = list(model.parameters())
    buffers = SimpleNamespace(buckets=[SimpleNamespace(index=i, params=[p])
                                       for i, p in enumerate(params)])
    waited, early = set(), []
    hook_bucket_waits(model, buffers, waited.update)
    index = {id(p): i for i, p in enumerate(params)}

    class Reads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            for a in list(args) + list((kwargs or {}).values()):
                if id(a) in index and index[id(a)] not in waited:
                    early.append(func)
            return func(*args, **(kwargs or {}))

    with Reads():
        model(torch.randint(0, cfg.vocab_size, (2, 8)))
    assert early == []
    assert waited == set(range(len(params)))
