"""A training run's user and environment errors are one line and exit status 2, before the
first step where they can be seen then: a --save, --log-json or --data-cache-path that cannot
be written (a file in the way, a full disk), a disk that fills up at save time (`latest`
stays), CUDA graphs without a GPU, a tokenizer file that does not parse, a --prompt that is not UTF-8, an abbreviated
flag. And what a resumed run keeps: a finished run says so and how to extend it, the metrics
of every segment stay in SAVE/metrics.jsonl (the curves and `python -m megazoo.plot SAVE` show
the whole run), and --seed seeds Python's and numpy's generators too (two fresh runs save the
same states)."""
from __future__ import annotations

import errno
import json
import random

import numpy as np
import pytest
import torch

from helpers.runs import tiny_argv
from megazoo.checkpoint import save as checkpoint_save
from megazoo.plot import read_log
from megazoo.training.run import main


def one_line(capsys, code, expected: int = 2) -> str:
    out, err = capsys.readouterr()
    assert code == expected and len(err.strip().splitlines()) == 1, (code, err)
    assert "iteration 1 |" not in out  # refused before the first step
    return err.strip()


def test_a_file_where_the_save_folder_should_be_is_refused_before_training(data, tmp_path, capsys):
    (tmp_path / "f").write_text("mine")
    save = tmp_path / "f" / "ck"
    err = one_line(capsys, main(tiny_argv(data, "--save", str(save))))
    assert err == (f"error: --save {save}: {tmp_path / 'f'} is a file where a folder is "
                   f"expected: move it away or choose another --save")
    assert (tmp_path / "f").read_text() == "mine"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine captures the graphs")
def test_cuda_graphs_without_a_gpu_are_one_line(data, capsys):
    err = one_line(capsys, main(tiny_argv(data, "--enable-cuda-graph")))
    assert err == "error: --enable-cuda-graph needs CUDA GPUs: drop it on this machine"


def test_log_json_on_a_full_disk(data, capsys):
    err = one_line(capsys, main(tiny_argv(data, "--log-json", "/dev/full")))
    assert err.startswith("error: --log-json /dev/full: no space left on the disk of /dev/full")
    assert err.endswith("free some space or choose a --log-json on another disk")


def test_data_cache_path_under_a_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "f").write_text("")
    err = one_line(capsys, main(["--data-cache-path", "f/cache", "--train-iters", "1"]))
    assert err == ("error: --data-cache-path f/cache: f is a file where a folder is expected: "
                   "move it away or choose another --data-cache-path")


def test_disk_full_at_save_time_is_one_line_and_latest_stays(data, tmp_path, monkeypatch, capsys):
    save = tmp_path / "ck"
    argv = tiny_argv(data, "--save", str(save), "--train-iters", "4", "--save-interval", "2")
    real = checkpoint_save._write_rank_file

    def fills_up(model, file, aux):
        if "iter_0000004" in file:
            raise OSError(errno.ENOSPC, "No space left on device", file)
        return real(model, file, aux)

    monkeypatch.setattr(checkpoint_save, "_write_rank_file", fills_up)
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"error: --save {save}: no space left on the disk of {save}/iter_0000004")
    assert (save / "latest").read_text().strip() == "2"
    assert sorted(p.name for p in save.iterdir() if p.name.startswith("iter")) == ["iter_0000002"]


def test_tokenizer_files_that_do_not_parse(data, tmp_path, capsys):
    bad = tmp_path / "tok.model"
    bad.write_bytes(b"\xffnot a model")
    argv = tiny_argv(data, "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                     str(bad))
    err = one_line(capsys, main(argv))
    assert err.startswith(f"error: {bad} is not a readable SentencePiece model (")
    (tmp_path / "tokenizer.json").write_text('{"model": ')
    argv[argv.index(str(bad))] = str(tmp_path / "tokenizer.json")
    argv[argv.index("SentencePieceTokenizer")] = "HFTokenizer"
    err = one_line(capsys, main(argv))
    assert err.startswith(f"error: {tmp_path / 'tokenizer.json'} is not a readable Hugging "
                          f"Face tokenizer.json (")


def test_abbreviated_flags_are_refused_with_the_full_name(data, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(tiny_argv(data, "--train-iter", "10"))
    err = one_line(capsys, exit_info.value.code)
    assert "unrecognized argument --train-iter: did you mean --train-iters?" in err


def test_resuming_a_finished_run_says_how_to_extend_it(data, tmp_path):
    save, lines = tmp_path / "ck", []
    argv = tiny_argv(data, "--train-iters", "2", "--save", str(save))
    assert main(argv) == 0
    assert main(argv + ["--load", str(save)], print_fn=lines.append) == 0
    assert lines[-1] == ("the run is complete at iteration 2 (--train-iters 2): nothing to "
                         "train; to extend it, pass --train-iters N with N > 2")
    assert not any(line.startswith("done:") for line in lines)


def test_metrics_of_every_segment_stay_in_the_save_folder(data, tmp_path, capsys):
    save = tmp_path / "ck"
    assert main(tiny_argv(data, "--train-iters", "2", "--save", str(save))) == 0
    assert main(tiny_argv(data, "--train-iters", "4", "--save", str(save),
                          "--load", str(save))) == 0
    records, tokens_per_step = read_log(str(save))  # the folder form of `megazoo.plot SAVE`
    assert [r["iteration"] for r in records if "loss" in r] == [1, 2, 3, 4]
    assert tokens_per_step == 4 * 32
    starts = [json.loads(x).get("start_iteration") for x in
              (save / "metrics.jsonl").read_text().splitlines()]
    assert [s for s in starts if s is not None] == [0, 2]


def test_a_resumed_segment_replaces_what_a_killed_one_logged_past_its_start(tmp_path):
    log = tmp_path / "m.jsonl"
    rows = [{"tokens_per_step": 8, "start_iteration": 0}] + \
        [{"iteration": i, "loss": 10.0 - i} for i in (1, 2, 3)] + \
        [{"tokens_per_step": 8, "start_iteration": 2}, {"iteration": 3, "loss": 1.0}]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records, _ = read_log(str(log))
    assert [(r["iteration"], r["loss"]) for r in records] == [(1, 9.0), (2, 8.0), (3, 1.0)]


def test_two_fresh_runs_save_the_same_random_states(data, tmp_path):
    states = []
    for name in ("a", "b"):
        np.random.seed(None)  # fresh from the OS, as in a new process
        random.seed(None)
        save = tmp_path / name
        assert main(tiny_argv(data, "--train-iters", "1", "--save", str(save),
                              "--generate-tokens", "0")) == 0
        meta = json.loads((save / "iter_0000001" / "megazoo.json").read_text())
        states.append(meta["extra"]["rng"])
    assert states[0]["numpy"] == states[1]["numpy"] and states[0]["random"] == states[1]["random"]
    assert states[0]["torch"] == states[1]["torch"]


def test_a_sample_prompt_that_is_not_utf8_is_refused_before_training(data, capsys):
    err = one_line(capsys, main(tiny_argv(data, "--prompt", "def \udcff")))
    assert err == "error: --prompt is not valid UTF-8 text: pass the prompt as UTF-8"


def test_a_file_of_the_user_in_the_disk_tier_folder_is_one_line_and_kept(data, tmp_path, capsys):
    """--nvme-path's rank folder holding a file the disk store did not make (a user's file
    named like a shard) is refused before anything is written, and the file is kept."""
    mine = tmp_path / "nv" / "rank00000" / "shard00000.bin"
    mine.parent.mkdir(parents=True)
    mine.write_bytes(b"a user's data")
    err = one_line(capsys, main(tiny_argv(data, "--optimizer-cpu-offload", "--nvme-path",
                                          str(tmp_path / "nv"), "--ddp-bucket-size", "3000",
                                          "--optimizer-offload-host-memory", "0.0007")))
    assert "did not make (shard00000.bin)" in err and "--nvme-path" in err
    assert mine.read_bytes() == b"a user's data"


def test_a_longer_resume_says_the_cosine_schedule_rewarms(data, tmp_path):
    """Resuming with a larger --train-iters moves the end of the decay: the lr climbs back up
    (here 1.0e-3 at the end of 2 iterations, then near the peak again). A line says so and
    how to continue the old schedule; the same --train-iters prints nothing of the kind."""
    from megazoo.training.run import run_training

    save = tmp_path / "ck"
    run_training(tiny_argv(data, "--train-iters", "4", "--save", str(save),
                           "--save-interval", "2", "--exit-interval", "2"))
    lines = []
    run_training(tiny_argv(data, "--train-iters", "4", "--save", str(save), "--load", str(save)),
                 print_fn=lines.append)
    assert not any("learning-rate schedule changed" in x for x in lines), lines
    longer = tmp_path / "longer"
    run_training(tiny_argv(data, "--train-iters", "2", "--save", str(longer)))
    lines = []
    run_training(tiny_argv(data, "--train-iters", "6", "--save", str(longer), "--load",
                           str(longer)), print_fn=lines.append)
    note = [x for x in lines if "learning-rate schedule changed" in x]
    assert len(note) == 1 and "iteration 3 would have used lr 1.000e-03" in note[0], lines
    assert "pass --lr-decay-iters 2 to continue the old schedule" in note[0]


def test_the_first_log_line_says_how_long_the_run_takes_and_what_to_pass(data):
    from megazoo.training.metrics import speed_note
    from megazoo.training.run import run_training

    idle = speed_note(760, 0.15, threads=2, cores=2, load=2.1, threads_given=False)
    assert idle == "at this speed the remaining 760 steps take about 2 min"
    busy = speed_note(760, 4.0, threads=2, cores=2, load=7.0, threads_given=False)
    assert busy == ("at this speed the remaining 760 steps take about 51 min; the machine is "
                    "busy (load average 7.0 on 2 cores): --cpu-threads 1 is likely faster "
                    "than the 2 threads now")
    assert "busy" not in speed_note(760, 4.0, threads=2, cores=2, load=7.0, threads_given=True)
    lines = []
    run_training(tiny_argv(data), print_fn=lines.append)
    notes = [x for x in lines if x.startswith("at this speed the remaining 5 steps take about")]
    assert len(notes) == 1 and lines.index(notes[0]) == \
        next(i for i, x in enumerate(lines) if x.startswith("iteration 1 |")) + 1
