"""The plain engine's optimizer offload in the planner (GPU, host, disk bytes), the checks a
run makes before training, and `--largest`."""
import dataclasses
import os
import re

import pytest

from megazoo.plan import GB, main
from megazoo.plan.engines import TORCH_HOST_RUNTIME_BYTES
from megazoo.plan.largest import family_shapes, search
from megazoo.plan.layout import PlanOptions, corpus_vocab
from megazoo.plan.memory import estimate_memory
from megazoo.models.build import build_model
from megazoo.offload import (HOST_RESERVE, bucket_elements_of, check_nvme_path,
                                  check_offload_plan, host_slots, host_split, offload_bytes,
                                  pinned, split_budget)
from megazoo.plan.tensors import model_tensors
from megazoo.config.flags import parse_args
from megazoo.config.run import TrainingConfig

SHAPE = ["--family", "llama", "--num-layers", "8", "--hidden-size", "1024",
         "--num-attention-heads", "8", "--num-key-value-heads", "8", "--ffn-hidden-size", "2816",
         "--max-position-embeddings", "1024", "--seq-length", "1024", "--micro-batch-size", "1",
         "--global-batch-size", "1", "--bf16", "--recompute", "full"]


def test_pinned_rounds_up_to_a_power_of_two():
    assert (pinned(0), pinned(1), pinned(2**26), pinned(2**26 + 1)) == (0, 1, 2**26, 2**27)


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_offload_moves_a_fraction_of_12_bytes(fraction):
    """Masters + moments (12 B) split by the fraction; the GPU's bf16 copies are whole buckets."""
    n, bucket = 1_000_000_000, 40_000_000
    plan = offload_bytes(n, fraction=fraction, bucket_elements=bucket, grad_bytes=4)
    assert plan.gpu_state == pytest.approx(12 * n * (1 - fraction))
    assert plan.gpu_buffers == 2 * bucket * 2  # bf16 copies of fp32 gradient buckets
    assert offload_bytes(n, fraction=fraction, bucket_elements=bucket, grad_bytes=2).gpu_buffers == 0


def test_host_split_keeps_the_first_of_the_forward_in_memory():
    """The rule, by hand: eight slots of 2^20 elements (bf16 gradients and parameters)."""
    m = 2 ** 20
    slots = [m] * 8
    ring = 4 * pinned(2 * m)  # the upload ring (the one-pass kernels: no fp32 scratch)
    whole = ring + 8 * (pinned(2 * m) + 3 * pinned(4 * m))  # landing buffer + pinned state
    for budget in (None, whole):
        split = host_split(slots, budget, grad_bytes=2, param_bytes=2)
        assert (split.memory, split.host, split.disk, split.late) == (8, whole, 0, False)
        assert not split.pageable
    # not all fits: pageable state (12 B), one shared landing buffer, 2 pageable staging slots
    fixed = ring + pinned(2 * m) + 2 * 12 * m
    split = host_split(slots, fixed + 2 * 12 * m + 1, grad_bytes=2, param_bytes=2)
    assert (split.memory, split.disk, split.late, split.pageable) == (2, 6 * 12 * m, True, True)
    assert split.host == fixed + 2 * 12 * m
    assert host_split(slots, fixed - 1, grad_bytes=2, param_bytes=2).host > fixed - 1
    # the delayed update keeps a landing buffer per slot
    late = host_split(slots, fixed + 2 * 12 * m + 1, grad_bytes=2, param_bytes=2,
                      late_grads=False)
    assert late.memory < 2 and not late.late
    # torch's AdamW fallback's fp32 scratch (the engine passes it): a slot less in memory
    upcast = host_split(slots, fixed + 2 * 12 * m + 1, grad_bytes=2, param_bytes=2,
                        scratch=4 * m)
    assert (upcast.memory, upcast.host) == (1, fixed + 4 * m + 12 * m)
    assert split_budget(100e9, 1e9) == 100e9 - HOST_RESERVE - 12e9


def engine_buckets(bucket=40_000_000):
    """The plain engine's bucket sizes for SHAPE, from its own layout function."""
    from megazoo.models.build import build_model
    from megazoo.training.backends.grad_buffer import _layout

    model = build_model(parse_args(SHAPE).model, device="meta")
    return [b.numel for b in _layout(list(model.parameters())[::-1], bucket, 1, set())[1]]


def test_planner_buckets_are_the_engines():
    """The planner's buckets (from its tensor list) and its host share, against the engine's
    `grad_buffer._layout` and `cpu_offload.host_share` on the same model."""
    from megazoo.training.backends.cpu_offload import host_share
    from megazoo.training.backends.grad_buffer import _layout

    config = parse_args(SHAPE).model
    tensors = [numel for numel, _ in model_tensors(config, 1)]
    for bucket in (40_000_000, 7_000_000):
        ours = bucket_elements_of(tensors, bucket, 1)
        assert ours == engine_buckets(bucket) and len(ours) > 1
        model = build_model(config, device="meta")
        layout = _layout(list(model.parameters())[::-1], bucket, 1, set())[1]
        for fraction in (0.0, 0.3, 0.5, 1.0):
            shared = sorted(host_share(layout, fraction))
            assert host_slots(ours, fraction, 1) == [ours[i] for i in shared]


def plain(*extra, **options):
    """The plan of a run that does not save (saving adds the gathered state: test_plan_measured)."""
    return estimate_memory(parse_args(SHAPE + ["--save", ""] + list(extra)),
                           PlanOptions(**options))


def test_plain_engine_plan_with_offload():
    base = plain()
    n = base.parameters_per_gpu
    assert (base.parameters, base.gradients, base.optimizer_states) == (2 * n, 4 * n, 12 * n)
    half = plain("--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5",
                 "--accumulate-grads-in-bf16")
    assert (half.gradients, half.optimizer_states) == (2 * n, 6 * n)
    # per host bucket its pinned fp32 master, m, v and bf16 gradient, each rounded up to a
    # power of two; 4 pinned bf16 uploads of the largest (no fp32 scratch: one-pass kernels)
    slots = host_slots(engine_buckets(), 0.5, 1)
    assert 0 < sum(slots) <= 0.5 * n + max(slots) / 2
    big = max(slots)
    assert half.host_per_gpu == pytest.approx(
        sum(3 * pinned(4 * s) + pinned(2 * s) for s in slots) + 4 * pinned(2 * big)
        + TORCH_HOST_RUNTIME_BYTES)
    # the disk tier: all in memory without a host size, else the engine's split of the budget
    nvme = ["--optimizer-cpu-offload", "--nvme-path", "/nonexistent/ok-for-the-planner"]
    assert plain(*nvme).disk_per_gpu == 0
    forward = host_slots(engine_buckets(), 1.0, 1)[::-1]
    budget = 2.4e9  # pinned buffers (~1.8 GB: 40M-element buckets) and about half the state
    want = host_split(forward, budget, grad_bytes=4, param_bytes=2)
    assert 0 < want.memory < len(forward) and want.host <= budget
    for given in (["--optimizer-offload-host-memory", str(budget / GB)], []):
        host_gb = (budget + HOST_RESERVE + TORCH_HOST_RUNTIME_BYTES) / GB
        split = plain(*nvme, *given, host_memory=host_gb)
        assert split.disk_per_gpu == pytest.approx(want.disk)
        assert split.host_per_gpu == pytest.approx(max(want.host, 4 * n)
                                                   + TORCH_HOST_RUNTIME_BYTES)
    # the verdict names the budget that fails
    small_host = plain("--optimizer-cpu-offload", host_memory=1.0)
    assert small_host.verdicts == {"gpu": True, "host": False} and not small_host.fits
    small_disk = plain(*nvme, "--optimizer-offload-host-memory", str(budget / GB),
                       disk_memory=want.disk / GB * 0.99)
    assert small_disk.verdicts["disk"] is False


@pytest.mark.parametrize("value", [-0.1, 1.5])
def test_fraction_outside_0_1_is_one_line_naming_it(value, capsys):
    with pytest.raises(ValueError, match=f"must be in \\[0, 1\\], got {value}"):
        TrainingConfig(optimizer_cpu_offload=True, optimizer_offload_fraction=value)
    assert main(SHAPE + ["--optimizer-cpu-offload", "--optimizer-offload-fraction",
                         str(value)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(value) in err


@pytest.mark.parametrize("flags, words", [
    (["--optimizer-offload-fraction", "0.5"], "needs --optimizer-cpu-offload"),
    (["--nvme-path", "d"], "--nvme-path needs --optimizer-cpu-offload"),
    (["--deepspeed", "--optimizer-cpu-offload"], "is for the plain engine"),
])
def test_offload_flags_against_the_engine(flags, words):
    with pytest.raises(ValueError, match=words):
        parse_args(SHAPE + flags)


def test_unwritable_nvme_path_is_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(ValueError) as exc:
        check_nvme_path(str(blocker / "sub"))
    assert str(blocker / "sub") in str(exc.value) and "\n" not in str(exc.value)
    assert check_nvme_path(str(tmp_path / "new")) > 0 and os.path.isdir(tmp_path / "new")


def test_host_or_disk_too_small_names_the_numbers():
    with pytest.raises(ValueError, match=r"needs 240\.0 GB of host memory \(2 ranks x 120\.0 "
                                         r"GB\) but 125\.0 GB is available"):
        check_offload_plan(120 * GB, 0, host_memory=125 * GB, disk_memory=None, ranks_per_host=2)
    with pytest.raises(ValueError, match=r"needs 600\.0 GB under --nvme-path D but 500\.0 GB"):
        check_offload_plan(1 * GB, 600 * GB, host_memory=None, disk_memory=500 * GB,
                           nvme_path="D")
    check_offload_plan(120 * GB, 400 * GB, host_memory=125 * GB, disk_memory=500 * GB)


def test_a_preset_plans_its_own_sequence_length(capsys):
    import json

    for name, seq in (("gpt3-175b", 2048), ("llama-7b", 4096)):
        assert main(["--model", name, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["layout"]["seq_length"] == seq
    assert main(["--model", "llama-7b", "--seq-length", "512", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layout"]["seq_length"] == 512


OFFLOAD_13B = ["--optimizer-cpu-offload", "--accumulate-grads-in-bf16"]


@pytest.mark.parametrize("family, flags, budgets", [
    ("llama", OFFLOAD_13B, dict(gpu_memory=80, host_memory=125, disk_memory=500)),
    ("gpt", ["--deepspeed", "--zero-stage", "3", "--offload-optimizer", "cpu"],
     dict(gpu_memory=80, host_memory=125)),
])
def test_largest_fits_and_the_next_larger_does_not(family, flags, budgets):
    argv = ["--largest", "--model-family", family] + flags
    from megazoo.plan.cli import _default_sequence, plan_parser

    ns = plan_parser().parse_args(argv)
    _default_sequence(ns)
    ns.training__global_batch_size = 1
    from megazoo.config.flags import args_from_namespace

    args = args_from_namespace(ns)
    pick = args.training.optimizer_cpu_offload
    options = PlanOptions(**budgets)
    (config, est, run_args), following = search(args, options, family, pick)
    assert est.fits and following is not None and not following[1].fits
    shapes = family_shapes(family, 2048)  # sorted: everything past the answer is larger
    assert [(s.num_layers, s.hidden_size) for s in shapes].index(
        (following[0].num_layers, following[0].hidden_size)) == [
        (s.num_layers, s.hidden_size) for s in shapes].index(
        (config.num_layers, config.hidden_size)) + 1
    assert est.num_parameters <= following[1].num_parameters


def test_largest_prints_a_command_the_run_accepts(capsys):
    budgets = ["--gpu-memory", "80", "--host-memory", "125", "--disk-memory", "500"]
    assert main(["--largest", "--model-family", "llama"] + budgets + OFFLOAD_13B) == 0
    out = capsys.readouterr().out
    command = out.split("command:\n", 1)[1].split()
    assert command[:2] == ["python", "pretrain_gpt.py"]
    args = parse_args(command[2:])  # the run accepts it ...
    assert args.training.optimizer_cpu_offload and args.data.seq_length == 2048
    args.model = run_model(args)
    est = estimate_memory(args, PlanOptions(gpu_memory=80, host_memory=125, disk_memory=500))
    assert est.fits  # ... and plans as the search said
    assert out.startswith(f"largest that trains here: llama {est.num_parameters / 1e9:.2f}B")
    # the lean build holds one sub-module in fp32 on the GPU: training, not the build, limits
    assert est.build_peak <= est.allocated and "training alone would fit" not in out


def test_lean_build_term_holds_one_unit_in_fp32_and_the_model_on_the_host():
    base = ["--family", "llama", "--num-layers", "8", "--hidden-size", "4096",
            "--num-attention-heads", "32", "--num-key-value-heads", "8", "--ffn-hidden-size",
            "14336", "--seq-length", "2048", "--micro-batch-size", "1", "--global-batch-size",
            "1", "--bf16"]
    lean = estimate_memory(parse_args(base + ["--optimizer-cpu-offload"]), PlanOptions())
    today = estimate_memory(parse_args(base), PlanOptions())  # no offload: the fp32 build
    n = lean.parameters_per_gpu
    # bf16 parameters + fp32 main gradients + no GPU masters (all offloaded): 6 B/param,
    # against today's build of the un-offloaded engine: fp32 model + grads + moments + cast
    assert lean.build_peak == pytest.approx(6 * n, rel=1e-6)
    assert today.build_peak == pytest.approx((4 + 4 + 8 + 2) * n, rel=1e-6)
    assert lean.host_per_gpu >= 4 * n  # the fp32 model waits on the host


def test_largest_without_a_fit_is_one_line(capsys):
    assert main(["--largest", "--gpu-memory", "1", "--model-family", "gpt"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no gpt shape fits") and err.count("\n") == 1


def run_model(args):
    """The model `pretrain_gpt.py` trains for `args`: its vocabulary the data's (`build_data`:
    the default corpus's tokenizer without --data-path)."""
    return dataclasses.replace(args.model, vocab_size=corpus_vocab(args))


def test_largest_on_the_lent_machine_splits_the_host_share(capsys):
    """80 GB GPU, 125 GB host, 40 GB of disk for the state (bench/offload_largest.py's cap):
    a model of at least 13B whose host share is split, memory first, the rest on disk; the
    printed command pins the planned split (--optimizer-offload-host-memory), and the model
    it trains (the default corpus's vocabulary: the search planned it too, the head's bucket
    included) plans the same bytes on disk and on the host as the search said."""
    import json
    import shlex

    budgets = dict(gpu_memory=80, host_memory=125, disk_memory=40)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in budgets.items()]
    argv = ["--largest", "--model-family", "llama", "--nvme-path", "/nonexistent/nv",
            "--save", ""] + flags + OFFLOAD_13B
    assert main(argv) == 0
    assert "buckets in memory, the last" in capsys.readouterr().out
    assert main(argv + ["--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    args = parse_args(shlex.split(planned["command"])[2:])
    assert args.training.optimizer_offload_host_memory is not None
    assert planned["model"]["vocab_size"] == args.data.default_vocab_size
    args.model = run_model(args)
    est = estimate_memory(args, PlanOptions(**budgets))
    assert est.fits and est.num_parameters >= 13e9 and 0 < est.disk_per_gpu <= 40e9
    assert (est.num_parameters, est.disk_per_gpu, est.host_per_gpu) == (
        planned["num_parameters"], planned["disk_per_gpu"], planned["host_per_gpu"])


def test_largest_plans_the_vocabulary_the_run_trains_with(tmp_path):
    """Without --data-path the run's embedding and head have the default corpus's
    vocabulary (--default-vocab-size), not the family's: every candidate is planned with it;
    with --data-path the family's stands for the tokenizer's."""
    given = parse_args(["--data-path", str(tmp_path / "corpus"), "--tokenizer-type",
                        "ByteLevelTokenizer"])
    for args, vocab in ((parse_args([]), 2048), (given, None),
                        (parse_args(["--default-vocab-size", "4096"]), 4096)):
        assert corpus_vocab(args) == vocab
        shapes = family_shapes("llama", 2048, corpus_vocab(args))
        assert {c.vocab_size for c in shapes} == {vocab or 32000}


def test_a_split_the_run_refuses_the_planner_refuses_in_its_words(tmp_path, capsys):
    """--optimizer-offload-host-memory below what the host share needs: the run refuses it
    before training (`split_store.host_store`), and the planner, given the same flags, says
    the same line instead of "fits" (one rule: `offload.check_offload_plan`)."""
    from helpers.runs import make_data, tiny_argv
    from megazoo.training.run import main as train

    data = make_data(tmp_path)
    flags = tiny_argv(data, "--optimizer-cpu-offload", "--nvme-path", str(tmp_path),
                      "--optimizer-offload-host-memory", "0.000001")
    assert train(flags) == 2
    run_line = capsys.readouterr().err.strip().splitlines()
    assert len(run_line) == 1 and "of host memory but 1e-06 GB is available" in run_line[0]
    assert main(flags) == 2
    plan_line = capsys.readouterr().err.strip().splitlines()
    number = re.compile(r"needs [0-9.e-]+ GB")  # the planner sizes the byte tokenizer's
    assert [number.sub("needs N GB", x) for x in plan_line] == \
        [number.sub("needs N GB", x) for x in run_line]  # vocabulary as the model config's
