"""The plain engine's optimizer offload (`OffloadAdamW`) against the plain engine without it.

Tolerance. fp32, rtol 1e-5 on the loss of every step and on every parameter after 3 steps
(atol 1e-5 for near-zero elements, as in test_data_parallel): the offloaded step is the same
AdamW function over the same pieces, so any fraction of buckets on the host gives the same
float32 numbers (on CPU they agree bit for bit); a bucket stepped twice or not at all, a
wrong clipping divisor or a gradient copied before its last micro-batch is off by a whole
AdamW step (about lr = 1e-2), a thousand times the tolerance.
"""
import pytest
import torch

from megazoo.parallel import ParallelConfig
from megazoo.testing import run_distributed
from megazoo.config.flags import parse_args
from megazoo.training.backends.cpu_offload import host_share

from helpers import ddp_checks as checks

TIMEOUT = 120
SMALL = {"ddp_bucket_size": 3000}  # several buckets in the tiny model


def offload(fraction: float, overlap: bool = True, **extra) -> dict:
    return {**SMALL, "optimizer_cpu_offload": True, "optimizer_offload_fraction": fraction,
            "overlap_cpu_optimizer_d2h_h2d": overlap, **extra}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path, threads = str(tmp_path_factory.mktemp("ref") / "ck"), torch.get_num_threads()
    torch.set_num_threads(1)  # as the spawned ranks run (see test_data_parallel)
    try:
        return checks.run_and_save(ParallelConfig(), path, **SMALL)
    finally:
        torch.set_num_threads(threads)


def _compare(out: dict, ref: dict, name: str) -> None:
    assert out["losses"] == pytest.approx(ref["losses"], rel=1e-5), name
    for key, want in ref["params"].items():
        torch.testing.assert_close(out["params"][key], want, rtol=1e-5, atol=1e-5,
                                   msg=lambda m, k=key: f"{name}: {k}: {m}")


_one_process = checks.one_thread


@pytest.mark.parametrize("fraction,overlap", [(0.0, True), (0.5, True), (1.0, True),
                                              (0.5, False)])
def test_offloaded_fraction_matches_plain_engine(reference, tmp_path, fraction, overlap):
    out = _one_process(checks.run_and_save, ParallelConfig(), str(tmp_path / "ck"),
                       **offload(fraction, overlap))
    _compare(out, reference, f"fraction {fraction}")


def test_host_share_takes_the_last_buckets_of_the_forward():
    engine, _ = checks.engine_for(ParallelConfig(), **offload(0.5))
    slots = engine.optimizer.slots
    assert len(slots) > 3
    host = [s.bucket.index for s in slots if s.host]
    assert host == list(range(len(host)))  # lowest indices: the output end of the model
    share = engine.optimizer.host_numel / engine.buffers.numel
    largest = max(s.numel for s in slots) / engine.buffers.numel
    assert abs(share - 0.5) <= largest / 2
    buckets = engine.buffers.buckets
    assert host_share(buckets, 0.0) == set() and host_share(buckets, 1.0) == set(range(len(buckets)))


def _run_on_disk(path: str, nvme: str, host_gb: float | None = None,
                 overlap: bool = True) -> dict:
    """3 steps with the disk tier under `nvme` (`host_gb`: --optimizer-offload-host-memory),
    then a checkpoint at `path`; the losses, the parameters, the engine's split."""
    from megazoo.config.zero import ZeroConfig

    engine, state = checks.engine_for(ParallelConfig(), zero=ZeroConfig(nvme_path=nvme),
                                      **offload(0.5, overlap,
                                                optimizer_offload_host_memory=host_gb))
    assert engine.offload.nvme_path == nvme
    losses = checks.train(engine, state, range(3))
    engine.save(path, {"iteration": 3})
    opt = engine.optimizer
    return {"losses": losses, "params": checks.full_params(path), "split": opt.split,
            "host": len(opt.host_order), "jobs": opt._host_jobs(), "store": opt.stores.host}


def split_budgets() -> dict:
    """--optimizer-offload-host-memory (GB) that puts every host bucket on disk, about half,
    none: the smallest budgets `host_split` (the engine's rule) gives each count for."""
    from megazoo.offload import host_split

    engine, _ = checks.engine_for(ParallelConfig(), **offload(0.5))
    sizes = [s.numel for s in engine.optimizer.host_order]
    counts = {}
    for step in range(1, 4000):
        budget = step * 256
        split = host_split(sizes, budget, grad_bytes=4, param_bytes=4)
        if split.host <= budget:
            counts.setdefault(split.memory, budget / 1e9)
    half = min((k for k in counts if k >= len(sizes) / 2), default=None)
    return {"disk": counts[0], "split": counts[half], "memory": None}, len(sizes), half


@pytest.mark.parametrize("where, overlap", [("disk", True), ("split", True), ("split", False),
                                            ("memory", True)])
def test_disk_tier_matches_plain_engine(reference, tmp_path, where, overlap):
    """All host buckets on disk, the first of the forward in memory and the rest on disk
    (stepped on the worker thread or in `step`), all in memory (the tiny model fits any
    host): the same numbers as without offload."""
    budgets, host, half = split_budgets()
    out = _one_process(_run_on_disk, str(tmp_path / "ck"), str(tmp_path / "nvme"),
                       budgets[where], overlap)
    _compare(out, reference, f"nvme, {where}")
    memory = {"disk": 0, "split": half, "memory": host}[where]
    assert out["host"] == host and out["split"].memory == memory and 0 < half < host
    files = list((tmp_path / "nvme").rglob("shard*.bin"))
    assert len(files) == host - memory  # one file per disk bucket, none for memory ones
    store = out["store"]  # the disk buckets are the last of the forward
    on_disk = [store.on_disk(slot.index) for slot, _ in out["jobs"]]
    assert on_disk == [False] * memory + [True] * (host - memory)
    disk = [slot for slot, _ in out["jobs"]][memory:]
    for k, (slot, ahead) in enumerate(out["jobs"]):  # reads start with the host step
        assert ahead == (disk[:2] if k < memory else disk[k - memory + 1:k - memory + 2])


def test_split_resumes_bit_exactly_across_placements(tmp_path):
    """Saved from the split, resumed into the split, all on disk, all in memory and the
    plain engine: the same next steps, bit for bit (the checkpoint format is one)."""
    from megazoo.config.zero import ZeroConfig

    budgets, _, _ = split_budgets()
    path = str(tmp_path / "ck")

    def flags(where):
        zero = ZeroConfig(nvme_path=str(tmp_path / f"nvme-{where}"))
        return {**offload(0.5, optimizer_offload_host_memory=budgets[where]), "zero": zero}

    first = _one_process(checks.save_then_continue, path, flags("split"))
    for where in ("split", "disk", "memory"):
        again = _one_process(checks.resume, path, flags(where))
        assert again["after"] == first["after"], where
    assert _one_process(checks.resume, path, SMALL)["after"] == first["after"]


@pytest.mark.parametrize("free, host_gb, words", [
    (1000, None, ["under --nvme-path", "GB is free"]),
    (None, 1e-7, ["GB of host memory", "GB is available", "smaller model"]),
])
def test_a_disk_or_host_too_small_for_the_split_is_one_line(tmp_path, monkeypatch, free,
                                                             host_gb, words):
    """A disk without room for the overflow, a host without room even for the disk tier's
    buffers: one line naming both numbers, before any state is allocated."""
    from megazoo.config.zero import ZeroConfig
    from megazoo.training.backends import split_store

    budgets, _, _ = split_budgets()
    if free is not None:
        monkeypatch.setattr(split_store, "check_nvme_path", lambda path: free)
    with pytest.raises(ValueError) as err:
        checks.engine_for(ParallelConfig(), zero=ZeroConfig(nvme_path=str(tmp_path / "nv")),
                          **offload(0.5, optimizer_offload_host_memory=host_gb or budgets["disk"]))
    message = str(err.value)
    assert "\n" not in message and all(w in message for w in words), message
    assert not list((tmp_path / "nv").rglob("shard*.bin"))


def test_dp2_distributed_optimizer_offloads_its_own_shard(reference, tmp_path):
    """dp = 2: in memory, and split with disk (each rank its shard, its own folder)."""
    from megazoo.config.zero import ZeroConfig

    dp2 = offload(0.5, use_distributed_optimizer=True, overlap_grad_reduce=True,
                  overlap_param_gather=True)
    budget = split_budgets()[0]["disk"] * 0.6  # the shards are half the size
    split = {**dp2, "optimizer_offload_host_memory": budget,
             "zero": ZeroConfig(nvme_path=str(tmp_path / "nv"))}
    jobs = [(ParallelConfig(), str(tmp_path / "dp2"), dp2),
            (ParallelConfig(), str(tmp_path / "dp2-split"), split)]
    results = run_distributed(checks.layouts, 2, jobs, timeout=TIMEOUT)
    _compare(results[0][0], reference, "dp2 distributed optimizer")
    _compare(results[0][1], reference, "dp2 distributed optimizer, split with disk")
    for rank in (0, 1):
        assert list((tmp_path / "nv" / f"rank{rank:05d}").glob("shard*.bin")), rank


def test_resume_is_bit_exact_and_loads_into_the_plain_engine(tmp_path):
    path = str(tmp_path / "ck")
    flags = offload(0.5)
    first = _one_process(checks.save_then_continue, path, flags)
    again = _one_process(checks.resume, path, flags)
    assert again["after"] == first["after"] and again["steps"] == 4
    plain = _one_process(checks.resume, path, SMALL)  # same file format
    assert plain["after"] == first["after"]


@pytest.mark.parametrize("flags", [offload(0.5, accumulate_grads_in_bf16=True),
                                   {**SMALL, "accumulate_grads_in_bf16": True}],
                         ids=["offloaded", "on_gpu"])
def test_bf16_gradient_accumulation_runs_close_to_fp32(reference, tmp_path, flags):
    """bf16 main gradients round each micro-batch's sum to 8 bits of mantissa: the losses
    stay within 1% of fp32 accumulation over 3 steps (a lost micro-batch or a gradient
    never upcast moves them by whole percents); docs/offload.md has the longer measurement."""
    engine, _ = checks.engine_for(ParallelConfig(), **flags)
    assert engine.buffers.main_grad.dtype == torch.bfloat16
    out = _one_process(checks.run_and_save, ParallelConfig(), str(tmp_path / "ck"), **flags)
    assert out["losses"] == pytest.approx(reference["losses"], rel=1e-2)
    assert out["losses"] != reference["losses"]  # the rounding is really there


@pytest.mark.parametrize("argv,words", [
    (["--optimizer-cpu-offload", "--optimizer-offload-fraction", "1.5"], ["[0, 1]", "1.5"]),
    (["--optimizer-offload-fraction", "0.5"], ["--optimizer-cpu-offload"]),
    (["--optimizer-cpu-offload", "--deepspeed", "--zero-stage", "3"],
     ["--optimizer-cpu-offload", "plain engine"]),
    (["--offload-optimizer", "nvme"], ["--nvme-path"]),
    (["--optimizer-cpu-offload", "--optimizer-offload-host-memory", "10"],
     ["--optimizer-offload-host-memory", "--nvme-path"]),
    (["--optimizer-offload-host-memory", "10"], ["--optimizer-cpu-offload"]),
    (["--optimizer-cpu-offload", "--nvme-path", "d", "--optimizer-offload-host-memory", "-1"],
     [">= 0", "-1"]),
])
def test_bad_offload_flags_are_one_line(argv, words):
    with pytest.raises(ValueError) as err:
        parse_args(argv)
    message = str(err.value)
    assert "\n" not in message and all(w in message for w in words), message


def test_offload_flags_without_a_zero_engine_select_the_plain_offload():
    from megazoo.config.offload import plain_offload

    plan = plain_offload(parse_args(["--offload-optimizer", "cpu"]))
    assert plan is not None and plan.fraction == 1.0 and plan.nvme_path is None
    assert plain_offload(parse_args([])) is None


def test_a_ds_config_offload_section_selects_the_plain_offload(tmp_path):
    """The seeds' ds_config keys, without --deepspeed: this engine's offload, on disk."""
    import json

    from megazoo.config.offload import plain_offload

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_optimizer": {
        "device": "nvme", "nvme_path": str(tmp_path / "nv"), "pin_memory": False}}}))
    plan = plain_offload(parse_args(["--deepspeed_config", str(ds)]))
    assert plan.nvme_path == str(tmp_path / "nv") and not plan.pin_memory
    deepspeed = parse_args(["--deepspeed_config", str(ds), "--deepspeed"])
    assert deepspeed.zero.zero_impl == "deepspeed"  # DeepSpeed's own offload then



@pytest.mark.parametrize("overlap", [True, False])
def test_overlap_sends_gradients_down_while_backward_runs(overlap):
    """With the overlap each host bucket's gradient leaves from the backward hook, before
    `finish` (all but a deferred tied-embedding bucket); without it, none does."""
    engine, state = checks.engine_for(ParallelConfig(), **offload(1.0, overlap))
    buffers, events = engine.buffers, []
    send, finish = buffers.on_final, buffers.finish
    buffers.on_final = lambda b: events.append("send") or send(b)
    buffers.finish = lambda *a, **k: events.append("finish") or finish(*a, **k)
    checks.train(engine, state, range(1))
    early = events[:events.index("finish")].count("send")
    deferred = sum(b.deferred for b in buffers.buckets)
    assert early == (len(buffers.buckets) - deferred if overlap else 0)
    assert events.count("send") == len(buffers.buckets)


def test_a_rerun_counts_its_own_files_on_disk_as_free(tmp_path, monkeypatch):
    """The files a run left under --nvme-path are allocated anew by the next: with no other
    free byte on the disk, the same run starts again."""
    from megazoo.config.zero import ZeroConfig
    from megazoo.training.backends import split_store

    budgets, _, _ = split_budgets()
    flags = {**offload(0.5, optimizer_offload_host_memory=budgets["disk"]),
             "zero": ZeroConfig(nvme_path=str(tmp_path / "nv"))}
    checks.engine_for(ParallelConfig(), **flags)
    assert list((tmp_path / "nv").rglob("shard*.bin"))
    monkeypatch.setattr(split_store, "check_nvme_path", lambda path: 0.0)
    checks.engine_for(ParallelConfig(), **flags)
    with pytest.raises(ValueError, match="GB is free"):  # another folder has no such files
        checks.engine_for(ParallelConfig(), **{**flags, "zero": ZeroConfig(
            nvme_path=str(tmp_path / "other"))})
