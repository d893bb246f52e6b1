"""A training run never loses a checkpoint or a user's file, and never moves `latest` to
weights that give a non-finite loss.

- `--overwrite-checkpoints` replaces only what the run writes: a user's file in an iteration
  folder it would replace is named and the run refused (exit 2) before the first step;
- `latest` pointed back at an earlier iteration: resuming refuses (exit 2), naming the later
  complete folder and the flag, instead of deleting it; the folder a save killed before
  moving `latest` left (its `.megazoo-saving` note) is still replaced without a flag;
- a run that blows up (finite weights, non-finite loss) stops with exit 1 and one line, and
  `latest` keeps naming the last good checkpoint.
Each case asserts the exit code, the one line, and every byte of the save folder.
"""
from __future__ import annotations

import shutil

import pytest

from megazoo.checkpoint import CheckpointReader
from megazoo.training.run import main

from helpers.checkpoints import snapshot
from helpers.runs import tiny_argv


@pytest.fixture
def save(reference, tmp_path):
    """A copy of the reference run's --save folder (iterations 3 and 6, latest 6)."""
    path = tmp_path / "ck"
    shutil.copytree(reference[1], path)
    return path


def one_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_overwrite_checkpoints_keeps_a_users_file(data, save, capsys):
    (save / "iter_0000006" / "eval_results.txt").write_text("mine")
    before = snapshot(save)
    assert main(tiny_argv(data, "--save", str(save), "--overwrite-checkpoints")) == 2
    err = one_error(capsys)
    assert "--overwrite-checkpoints would delete eval_results.txt in " \
           f"{save / 'iter_0000006'}" in err, err
    assert snapshot(save) == before


def test_latest_pointed_back_does_not_delete_the_later_checkpoint(data, save, capsys):
    (save / "latest").write_text("3\n")
    before = snapshot(save)
    assert main(tiny_argv(data, "--save", str(save), "--load", str(save))) == 2
    err = one_error(capsys)
    assert f"holds {save / 'iter_0000006'}, a complete checkpoint later than iteration 3" in err
    assert "--overwrite-checkpoints" in err
    assert snapshot(save) == before
    (save / "iter_0000006" / "notes.txt").write_text("mine")  # the flag never deletes a file
    assert main(tiny_argv(data, "--save", str(save), "--load", str(save),
                          "--overwrite-checkpoints")) == 2
    assert "would delete notes.txt" in one_error(capsys)
    (save / "iter_0000006" / "notes.txt").unlink()
    assert main(tiny_argv(data, "--save", str(save), "--load", str(save),
                          "--overwrite-checkpoints")) == 0
    assert (save / "latest").read_text().strip() == "6"


def test_the_folder_of_a_save_killed_before_latest_is_replaced(data, save, reference):
    """What a kill between publishing iter_6 and moving `latest` leaves: the run resumes from
    3 and writes iteration 6 again, with no flag (the same weights, bit for bit)."""
    (save / "latest").write_text("3\n")
    (save / ".megazoo-saving").write_text("6\n")
    assert main(tiny_argv(data, "--save", str(save), "--load", str(save))) == 0
    assert sorted(p.name for p in save.iterdir()) == ["iter_0000003", "iter_0000006", "latest",
                                                      "metrics.jsonl"]
    ours, ref = CheckpointReader(save / "iter_0000006"), CheckpointReader(reference[1])
    assert all(ours.full_tensor(n).equal(ref.full_tensor(n)) for n in ref.names())


@pytest.mark.parametrize("how", [["--load", "SAVE", "--train-iters", "8"],
                                 ["--bf16", "--train-iters", "3"]])
def test_a_blow_up_does_not_move_latest(data, save, capsys, how):
    """--lr 1e30 without clipping: the first step makes the weights huge but finite, the
    next losses are nan (skipped steps); the save at the end is refused, exit 1."""
    argv = [str(save) if a == "SAVE" else a for a in how]
    if "--load" not in argv:
        shutil.rmtree(save)
    before = checkpoints(save)
    assert main(tiny_argv(data, "--save", str(save), "--lr", "1e30", "--clip-grad", "0",
                          "--lr-warmup-iters", "0", "--eval-interval", "100", *argv)) == 1
    err = one_error(capsys)
    assert "not saving a checkpoint, the training loss nan" in err, err
    assert "likely cause: the learning rate is too high (--lr 1e+30)" in err
    assert checkpoints(save) == before


def checkpoints(save) -> dict[str, bytes]:
    """The files of `save` but the run's metrics log, which records a refused run's losses too
    (appended across runs by design)."""
    files = snapshot(save) if save.exists() else {}
    files.pop("metrics.jsonl", None)
    return files


def test_resuming_through_a_symlinked_iteration_folder_is_this_runs_folder(tmp_path):
    """--save SAVE --load SAVE/iter_0000010, where that folder is a symlink to a checkpoint
    kept elsewhere: --load is compared as the folder it resolves to, inside SAVE, so the run
    resumes (real paths on both sides) instead of taking SAVE for another run's folder."""
    from megazoo.checkpoint import save_checkpoint
    from megazoo.training.run_checks import prepare_save_dir

    from helpers.checkpoints import tiny_model
    from helpers.run_args import tiny_args

    save_checkpoint(tiny_model(), tmp_path / "kept" / "ck10",
                    extra={"args": {"training": {"seed": 1234}}})
    save = tmp_path / "SAVE"
    save.mkdir()
    (save / "iter_0000010").symlink_to(tmp_path / "kept" / "ck10")
    (save / "latest").write_text("10\n")
    prepare_save_dir(tiny_args(save, "--load", str(save / "iter_0000010")), True, print)
    with pytest.raises(ValueError, match="holds checkpoints up to iteration 10"):
        prepare_save_dir(tiny_args(save), True, print)  # not resuming: still refused


def test_an_unfinished_folder_is_replaced_only_when_a_killed_save_left_it(tmp_path):
    """DeepSpeed writes its shards into iter_N before megazoo.json: a save killed between
    leaves an incomplete folder, which the next save may replace (its note names it) as
    long as it holds only DeepSpeed's files; any other incomplete folder is named."""
    from megazoo.training.checkpoint import check_save_target

    folder = tmp_path / "iter_0000006"
    (folder / "zero").mkdir(parents=True)
    (folder / "zero" / "mp_rank_00_model_states.pt").write_bytes(b"partial")
    (tmp_path / "latest").write_text("3\n")
    with pytest.raises(ValueError, match="is not a complete checkpoint .*nor left by a killed"):
        check_save_target(str(tmp_path), 6, "deepspeed", True, 3)
    (tmp_path / ".megazoo-saving").write_text("6\n")
    assert check_save_target(str(tmp_path), 6, "deepspeed", False, 3)
    (folder / "mine.txt").write_text("x")
    with pytest.raises(ValueError, match="would delete mine.txt"):
        check_save_target(str(tmp_path), 6, "deepspeed", False, 3)
    (tmp_path / "latest").write_text("6\n")  # a stale note (latest moved past it) counts not
    (folder / "mine.txt").unlink()
    with pytest.raises(ValueError, match="is not a complete checkpoint"):
        check_save_target(str(tmp_path), 6, "deepspeed", False, 3)


def test_overwrite_checkpoints_refuses_an_iteration_folder_that_is_a_link(data, save, tmp_path,
                                                                          capsys):
    target = tmp_path / "elsewhere"
    shutil.move(save / "iter_0000006", target)
    (save / "iter_0000006").symlink_to(target)
    before = snapshot(save), snapshot(target)
    assert main(tiny_argv(data, "--save", str(save), "--overwrite-checkpoints")) == 2
    assert f"holds {save / 'iter_0000006'}, a symbolic link" in one_error(capsys)
    assert (snapshot(save), snapshot(target)) == before


def test_save_pointed_at_an_iteration_folder_names_the_parent(data, save, capsys):
    before = snapshot(save)
    assert main(tiny_argv(data, "--save", str(save / "iter_0000006"), "--load", str(save))) == 2
    assert f"new checkpoints would nest inside it: pass --save {save}" in one_error(capsys)
    assert snapshot(save) == before
