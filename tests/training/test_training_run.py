"""End-to-end runs of pretrain_gpt.py on tiny byte-level data: exact resume (also at tp=2 and
pp=2 with dropout), crash mid-save, other layouts on gloo (tp=2, pp=2, Ulysses sp=2, Megatron
SP, dp=2, and a tp=1 checkpoint loaded at tp=2), fp16 skips, bf16, bad input.

Tolerances: a resumed run repeats the uninterrupted one bit for bit (same CPU kernels, same
order). Other layouts sum the same float32 numbers in another order (tp splits matmuls and
the vocabulary softmax), so their losses agree to 1e-5 relative, not exactly.
"""
import json
import subprocess
import sys

import numpy as np
import pytest

from megazoo.data import IndexedDatasetBuilder
from megazoo.testing import run_distributed
from megazoo.training.run import run_training

from helpers.runs import ROOT, make_data, tiny_argv


def test_loss_decreases_and_latest_points_at_last_checkpoint(reference):
    out, save = reference
    assert len(out["losses"]) == 6 and out["losses"][-1] < out["losses"][0]
    assert (save / "latest").read_text().strip() == "6"
    assert (save / "iter_0000003").is_dir() and (save / "iter_0000006").is_dir()


def test_cli_stop_at_3_and_resume_gives_identical_losses(data, reference, tmp_path):
    ref, _ = reference
    save, log = tmp_path / "ck", tmp_path / "log.jsonl"
    cmd = [sys.executable, str(ROOT / "pretrain_gpt.py"),
           *tiny_argv(data, "--save", str(save), "--exit-interval", "3", "--log-json", str(log))]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    first = [json.loads(x)["loss"] for x in log.read_text().splitlines() if '"loss"' in x]
    assert (save / "latest").read_text().strip() == "3"
    rest = run_training(tiny_argv(data, "--save", str(save), "--load", str(save)))["losses"]
    assert first + rest == ref["losses"]  # bit for bit


def test_crash_mid_save_keeps_previous_checkpoint(data, tmp_path, monkeypatch):
    save = tmp_path / "ck"
    run_training(tiny_argv(data, "--save", str(save), "--exit-interval", "3"))
    import megazoo.checkpoint.save as ckpt_save

    def crash(*args, **kwargs):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(ckpt_save, "write_json", crash)  # rank files written, metadata not
    with pytest.raises(OSError, match="simulated"):
        run_training(tiny_argv(data, "--save", str(save), "--load", str(save)))
    monkeypatch.undo()
    assert (save / "latest").read_text().strip() == "3"
    assert not (save / "iter_0000006").exists()
    out = run_training(tiny_argv(data, "--load", str(save), "--eval-only"))
    assert np.isfinite(out["valid_loss"])


FP16 = ("--fp16", "--train-iters", "2", "--lr-decay-iters", "6", "--micro-batch-size", "1")
FP16_PP = FP16 + ("--pipeline-model-parallel-size", "2")


def _two_rank_run(argv_sets):
    return [run_training(argv) for argv in argv_sets]


def test_two_rank_layouts_match_one_rank_and_tp1_checkpoint_loads_at_tp2(data, reference):
    ref, save = reference
    ref_valid = run_training(tiny_argv(data, "--load", str(save), "--eval-only"))["valid_loss"]
    runs = [tiny_argv(data, "--tensor-model-parallel-size", "2", "--train-iters", "3",
                      "--lr-decay-iters", "6"),
            tiny_argv(data, "--pipeline-model-parallel-size", "2", "--train-iters", "3",
                      "--lr-decay-iters", "6", "--micro-batch-size", "1"),
            tiny_argv(data, "--tensor-model-parallel-size", "2", "--load", str(save),
                      "--eval-only"),
            tiny_argv(data, *FP16_PP)]
    others = [tiny_argv(data, *flags, "--train-iters", "3", "--lr-decay-iters", "6")
              for flags in (("--sequence-parallel-size", "2"),
                            ("--tensor-model-parallel-size", "2", "--sequence-parallel"),
                            ())]  # Ulysses sp=2, Megatron SP at tp=2, dp=2
    ref_fp16 = run_training(tiny_argv(data, *FP16))["losses"]
    for rank_out in run_distributed(_two_rank_run, 2, runs + others, timeout=240):
        tp2, pp2, tp2_eval, pp2_fp16 = rank_out[:4]
        for other in rank_out[4:]:
            assert other["losses"] == pytest.approx(ref["losses"][:3], rel=1e-5)
        # fp16 loss scaling inside the pipeline's own backward; fp16 rounding: 1e-3
        assert pp2_fp16["losses"] == pytest.approx(ref_fp16, rel=1e-3)
        assert tp2["losses"] == pytest.approx(ref["losses"][:3], rel=1e-5)
        assert pp2["losses"] == pytest.approx(ref["losses"][:3], rel=1e-5)
        assert tp2_eval["valid_loss"] == pytest.approx(ref_valid, rel=1e-5)


def _stop_and_resume(runs):
    """Per (argv, save): 4 uninterrupted iterations, then stop at 2 and resume to 4."""
    out = []
    for argv, save in runs:
        full = run_training(argv)["losses"]
        first = run_training([*argv, "--save", save, "--exit-interval", "2"])["losses"]
        rest = run_training([*argv, "--save", save, "--load", save])["losses"]
        out.append((full, first, rest))
    return out


def test_two_rank_stop_and_resume_is_exact_at_tp2_and_pp2(data, tmp_path):
    """Resuming at tp=2 and at pp=2 (2 micro-batches through the schedule) repeats the
    uninterrupted run bit for bit, like tp=1 (the same kernels in the same order)."""
    four = ("--train-iters", "4", "--eval-interval", "2", "--hidden-dropout", "0.1")
    runs = [(tiny_argv(data, "--tensor-model-parallel-size", "2", *four), str(tmp_path / "tp")),
            (tiny_argv(data, "--pipeline-model-parallel-size", "2", "--micro-batch-size", "1",
                       *four), str(tmp_path / "pp"))]
    for rank_out in run_distributed(_stop_and_resume, 2, runs, timeout=240):
        for (full, first, rest), layout in zip(rank_out, ("tp=2", "pp=2")):
            assert len(full) == 4 and (len(first), len(rest)) == (2, 2), layout
            assert first + rest == full, layout  # bit for bit


def test_fp16_overflow_skips_steps_and_backs_off(data):
    """2^20 overflows fp16 gradients here (found by trying: 2^16 never does, 2^24 always)."""
    out = run_training(tiny_argv(data, "--fp16", "--initial-loss-scale", str(2.0 ** 20),
                                 "--loss-scale-window", "2", "--train-iters", "6"))
    assert all(np.isfinite(out["losses"]))
    steps, scale, clean = out["steps"], 2.0 ** 20, 0
    assert steps[0].skipped and any(not s.skipped for s in steps)
    for s in steps:  # the scaler's rule, replayed from the skip flags
        scale, clean = (scale / 2, 0) if s.skipped else (scale, clean + 1)
        if clean == 2:
            scale, clean = scale * 2, 0
        assert s.loss_scale == scale and np.isnan(s.grad_norm) == s.skipped


def test_bf16_autocast_trains_close_to_fp32(data, reference):
    """bf16 matmuls (8-bit mantissa) over fp32 weights: the first losses within 2%."""
    out = run_training(tiny_argv(data, "--bf16", "--train-iters", "3", "--lr-decay-iters", "6"))
    assert out["losses"] == pytest.approx(reference[0]["losses"][:3], rel=2e-2)


def test_skipped_fp16_step_leaves_weights_untouched(data):
    import torch

    from megazoo.config.flags import parse_args
    from megazoo.training.run import setup

    run = setup(parse_args(tiny_argv(data, "--fp16", "--initial-loss-scale", str(2.0 ** 40))),
                print_fn=lambda *a, **k: None)
    before = {n: p.detach().clone() for n, p in run.engine.model.named_parameters()}
    result = run.engine.train_step(run.data.train_batch(0, run.state))
    assert result.skipped and result.loss_scale == 2.0 ** 39
    for n, p in run.engine.model.named_parameters():
        assert torch.equal(p, before[n]), n


@pytest.mark.parametrize("case", ["missing", "corrupt", "vocab", "batch", "model"])
def test_bad_input_is_one_error_line_and_exit_2(case, data, reference, tmp_path, capsys):
    from megazoo.training.run import main

    argv = tiny_argv(data)
    if case == "missing":
        argv = tiny_argv(str(tmp_path / "nothing"))
    elif case == "corrupt":
        prefix = make_data(tmp_path)
        with open(prefix + ".bin", "r+b") as f:
            f.truncate(100)
        argv = tiny_argv(prefix)
    elif case == "vocab":
        prefix = str(tmp_path / "wide")
        with IndexedDatasetBuilder(prefix, np.uint16) as b:
            b.add_document([300] * 200)
        argv = tiny_argv(prefix)
    elif case == "batch":
        argv = tiny_argv(data, "--global-batch-size", "5")
    else:
        argv = tiny_argv(data, "--hidden-size", "64", "--load", str(reference[1]))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    expected = {"missing": "not found", "corrupt": "corrupt", "vocab": "token id 300",
                "batch": "--global-batch-size", "model": "checkpoint"}[case]
    assert expected in err[0]
