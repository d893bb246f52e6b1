"""Sparse attention configured from `--deepspeed_config`'s sparse_attention section (every
engine) and the --sparse-* flags; a short pretrain_gpt.py run with the seeds' section."""
import json
import shutil
import subprocess
import sys

import pytest

from megazoo.config.flags import parse_args
from helpers.runs import ROOT, make_data, tiny_argv

SEEDS = {"sparse_attention": {"mode": "fixed", "block": 16, "different_layout_per_head": True}}


def _json(tmp_path, data) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_json_section_reaches_the_model_config_without_deepspeed(tmp_path, capsys):
    ds = _json(tmp_path, {**SEEDS, "zero_optimization": {"stage": 1}, "train_batch_size": 16})
    a = parse_args(["--deepspeed_config", ds])
    assert a.model.sparse.mode == "fixed" and a.model.sparse.different_layout_per_head
    assert a.training.global_batch_size == 16
    err = capsys.readouterr().err
    assert "the plain engine ignores zero_optimization (read only with --deepspeed)" in err


def test_flags_alone_and_with_agreeing_json(tmp_path):
    a = parse_args(["--sparse-attention-mode", "bigbird", "--sparse-block", "32",
                    "--sparse-attention-config", '{"num_random_blocks": 2}'])
    assert (a.model.sparse.mode, a.model.sparse.block, a.model.sparse.num_random_blocks) == \
        ("bigbird", 32, 2)
    b = parse_args(["--deepspeed_config", _json(tmp_path, SEEDS), "--sparse-block", "16"])
    assert b.model.sparse_attention == parse_args(["--deepspeed_config",
                                                   _json(tmp_path, SEEDS)]).model.sparse_attention


@pytest.mark.parametrize("flags, message", [
    (["--sparse-block", "32"], r"sets sparse_attention.block = 16 but --sparse-block gives 32"),
    (["--sparse-attention-config", '{"mode": "bigbird"}'],
     r"sets sparse_attention.mode = 'fixed' but --sparse-attention-config's 'mode' gives"),
])
def test_json_and_flag_disagreeing_is_an_error_naming_both(tmp_path, flags, message):
    with pytest.raises(ValueError, match=message):
        parse_args(["--deepspeed_config", _json(tmp_path, SEEDS), *flags])


@pytest.mark.parametrize("flags, message", [
    (["--sparse-attention-config", "[1]"], "must be a JSON object"),
    (["--sparse-attention-config", "{"], "is not valid JSON"),
    (["--sparse-attention-mode", "fixed", "--sparse-attention-config", '{"mode": "variable"}'],
     "but --sparse-attention-mode gives 'fixed'"),
    (["--sparse-attention-mode", "fixed", "--sparse-attention-config", '{"typo": 1}'],
     "unknown key"),
])
def test_bad_flags_are_one_line(flags, message):
    with pytest.raises(ValueError, match=message):
        parse_args(flags)


def test_pretrain_gpt_runs_the_seeds_sparse_section(tmp_path):
    """pretrain_gpt.py, plain engine, seq 64 with block 16 (fixed, per-head layouts); the
    checkpoint's model config keeps the section. No sample generation: its prompts have any
    length, which the block need not divide."""
    data, save = make_data(tmp_path), tmp_path / "ck"
    argv = tiny_argv(data, "--seq-length", "64", "--train-iters", "3", "--save", str(save),
                     "--save-interval", "3", "--generate-tokens", "0",
                     "--deepspeed_config", _json(tmp_path, SEEDS))
    proc = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), *argv],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads((save / "iter_0000003" / "megazoo.json").read_text())
    assert meta["model"]["sparse_attention"]["mode"] == "fixed"
    assert meta["model"]["sparse_attention"]["different_layout_per_head"] is True


def test_resuming_keeps_the_checkpoints_sparse_layout_or_refuses_another(data, tmp_path, capsys):
    """A checkpoint trained sparse resumes sparse without the flags (the same losses as with
    them, and the next checkpoint records the layout); another layout is refused by name."""
    from megazoo.training.run import main, run_training

    sparse = ["--sparse-attention-mode", "fixed", "--sparse-block", "16"]
    base = ["--seq-length", "64", "--generate-tokens", "0", "--save-interval", "2"]
    save = tmp_path / "ck"
    run_training(tiny_argv(data, *base, *sparse, "--train-iters", "2", "--save", str(save)))
    again = tmp_path / "again"
    shutil.copytree(save, again)
    lines = []
    out = run_training(tiny_argv(data, *base, "--train-iters", "4", "--save", str(save),
                                 "--load", str(save)), print_fn=lines.append)
    assert any("resuming with the checkpoint's sparse attention" in line for line in lines)
    meta = json.loads((save / "iter_0000004" / "megazoo.json").read_text())
    assert meta["model"]["sparse_attention"]["mode"] == "fixed"
    same = run_training(tiny_argv(data, *base, *sparse, "--train-iters", "4", "--save",
                                  str(again), "--load", str(again)))
    assert out["losses"] == same["losses"]
    for other in (["--sparse-attention-mode", "bigbird", "--sparse-block", "16"], []):
        if not other:  # a dense checkpoint resumed with sparse flags
            dense = tmp_path / "dense"
            run_training(tiny_argv(data, *base, "--train-iters", "2", "--save", str(dense)))
            argv = tiny_argv(data, *base, *sparse, "--train-iters", "4", "--load", str(dense))
        else:
            argv = tiny_argv(data, *base, *other, "--train-iters", "4", "--load", str(save))
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "was trained with" in err[0] and "this run asks for" in err[0]
