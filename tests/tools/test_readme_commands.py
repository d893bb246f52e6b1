"""Every command of README.md's ```bash blocks works when run in order, as a new user runs
them in a fresh clone (each command sees the files the earlier ones left, so a second run
saving into the main job's --save folder fails here).

The commands run in one scratch folder, in README order, as written, with two exceptions:
installing (`python -m pip ...`) and running this test suite (`python -m pytest ...`) are
left out (the suite runs in the installed environment, and inside itself), and every
`pretrain_gpt.py` run gets `SHRINK` appended: fewer and smaller iterations (2 of 2
sequences) and a smaller default corpus, the model and every other flag as written, so CI
spends seconds, not the main job's minutes. `python X.py` and
`python -m M` run in this process (runpy), `torchrun --nproc-per-node N` on N spawned gloo
ranks (`run_distributed`), anything else (`echo ... > file`) in bash. What the README
expects the user to bring (`gpt2-local`, a Hugging Face GPT-2 folder) the test makes, tiny
and random, before the first command naming it. `<!-- commands: skip REASON -->` on the line
before a block's fence leaves the block out (for commands CI cannot run: GPU-sized models).
"""
from __future__ import annotations

import contextlib
import os
import re
import runpy
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from megazoo.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
BLOCK = re.compile(r"(?:<!-- commands: (?P<mark>[^>]*?) -->\n)?```bash\n(?P<code>.*?)```", re.S)
LEFT_OUT = (("python", "-m", "pip"), ("python", "-m", "pytest"))
# the main job's and every other pretrain_gpt.py run's work, shrunk (iterations, corpus size)
SHRINK = ["--train-iters", "2", "--eval-iters", "1", "--eval-interval", "2", "--log-interval",
          "1", "--global-batch-size", "2", "--micro-batch-size", "1", "--generate-tokens", "4",
          "--default-corpus-mb", "0.2", "--default-vocab-size", "600", "--cpu-threads", "1",
          "--no-progress", "--no-plot-curves"]


def commands(text: str) -> list[dict]:
    """{"words", "line"} of every command to run, in README order."""
    out = []
    for match in BLOCK.finditer(text):
        mark = (match["mark"] or "").split()
        line = text.count("\n", 0, match.start("code")) + 1
        if mark and mark[0] != "skip":
            raise ValueError(f"README.md:{line}: unknown commands mark {' '.join(mark)!r}")
        if mark:
            continue
        for n, command in enumerate(match["code"].replace("\\\n", " ").splitlines()):
            words = shlex.split(command, comments=True)
            parts = [list(p) for p in _split(words, "&&")]
            for part in parts:
                if part and not any(tuple(part[:3]) == left for left in LEFT_OUT):
                    out.append({"words": part, "line": line + n})
    return out


def _split(words: list[str], separator: str):
    part = []
    for word in words:
        if word == separator:
            yield part
            part = []
        else:
            part.append(word)
    yield part


def _script_argv(words: list[str]) -> list[str]:
    """`pretrain_gpt.py ...` with SHRINK appended (later flags win)."""
    return words + SHRINK if Path(words[0]).name == "pretrain_gpt.py" else words


def run_python(words: list[str], folder: str):
    """`python ...` words, in this process: a script, `-m module` or `-c code`; True on exit 0."""
    os.chdir(folder)
    if words[0] == "-c":
        exec(compile(words[1], "<README -c>", "exec"), {"__name__": "__main__"})
        return True
    module = words[0] == "-m"
    argv = _script_argv(words[1:] if module else [str(ROOT / words[0]), *words[1:]])
    saved = sys.argv
    sys.argv = list(argv)
    threads = torch.get_num_threads()
    try:
        with warnings.catch_warnings():  # runpy: "found in sys.modules" (imported by its package)
            warnings.simplefilter("ignore", RuntimeWarning)
            if module:
                runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        assert exc.code in (0, None), f"{' '.join(words)}: exit status {exc.code}"
    finally:
        sys.argv = saved
        torch.set_num_threads(threads)  # --cpu-threads, for the tests after this one
    return True


def run(command: dict, folder: Path) -> None:
    words = command["words"]
    if words[0] == "python":
        with contextlib.chdir(folder):
            assert run_python(words[1:], str(folder))
    elif words[0] == "torchrun":
        assert words[1] == "--nproc-per-node", words
        ranks = int(words[2])
        assert run_distributed(run_python, ranks, words[3:], str(folder),
                               timeout=240) == [True] * ranks
    else:  # shell one-liners: echo / printf into a file
        subprocess.run(["bash", "-c", shlex.join(words[:-2]) + " > " + words[-1]
                        if words[-2:-1] == [">"] else shlex.join(words)], cwd=folder, check=True)


def make_gpt2_local(folder: Path) -> None:
    """A tiny random GPT-2 in Hugging Face's format (what `gpt2-local` stands for)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=96,
                                     n_positions=32)
    transformers.GPT2LMHeadModel(config).save_pretrained(folder / "gpt2-local")


USER_INPUTS = {"gpt2-local": make_gpt2_local}  # what a README command expects the user to have


def test_every_readme_command_runs_in_order(tmp_path, monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)  # one process, as `python` runs
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    (tmp_path / "docs").mkdir()  # a clone has it (pipeline pictures are written there)
    for command in commands(README.read_text()):
        for name, make in USER_INPUTS.items():
            if name in command["words"] and not (tmp_path / name).exists():
                make(tmp_path)
        try:
            run(command, tmp_path)
        except BaseException as exc:
            raise AssertionError(f"README.md:{command['line']}: {shlex.join(command['words'])} "
                                 f"failed: {exc}") from exc
    assert (tmp_path / "checkpoints-tp2" / "latest").read_text().strip() == "2"
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "2"


def test_commands_are_read_with_their_marks():
    text = ("```bash\npython -m pip install x && python a.py --n 1 \\\n    --m 2  # note\n```\n"
            "<!-- commands: skip needs GPUs -->\n```bash\npython big.py\n```\n"
            "```bash\n# a comment\necho '{}' > f.json\n```\n")
    got = commands(text)
    assert [c["words"] for c in got] == [["python", "a.py", "--n", "1", "--m", "2"],
                                         ["echo", "{}", ">", "f.json"]]
    assert [c["line"] for c in got] == [2, 11]
    with pytest.raises(ValueError, match="unknown commands mark 'skp x'"):
        commands("<!-- commands: skp x -->\n```bash\n```\n")
