"""Every flag an error message tells the user to pass exists in the command that prints it.

The messages are read from the source (the text of every `raise`, and of the functions whose
names say they give advice); each module belongs to the commands that run its code, and a
message that names another command (`python generate.py ...`, `tools/preprocess_data.py`) is
checked against that one. The commands' flags come from their own parsers, captured as they
parse. So a message suggesting `--allow-nonfinite-load` to a tool without it, or a flag that
was renamed, fails here.
"""
from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

import pytest

from megazoo import cli

ROOT = Path(__file__).resolve().parents[2]
# a flag to pass; not "a --save folder" (a kind of folder) nor "--offload-*" (a family)
FLAG = re.compile(r"(?<![\w-])(?<!\ba )(?<!\ban )--[a-z][a-z0-9_-]*[a-z0-9](?![\w-]*\*)")

# module (path prefix under megazoo/) -> the commands running it; the longest prefix wins
OWNERS = {
    "": ("megazoo-pretrain",),
    "generation/": ("megazoo-generate",),
    "convert/": ("megazoo-convert-hf", "megazoo-export-hf", "megazoo-reshard",
                 "megazoo-convert-zero"),
    "checkpoint/": ("megazoo-pretrain", "megazoo-generate", "megazoo-export-hf",
                    "megazoo-reshard"),
    "checkpoint/output.py": ("megazoo-convert-hf", "megazoo-export-hf", "megazoo-reshard",
                             "megazoo-convert-zero"),
    "convert/hf_io.py": ("megazoo-convert-hf",),
    "data/preprocess.py": ("megazoo-preprocess-data",),
    "plan/": ("megazoo-plan",),
    "plot.py": ("megazoo-plot",),
    "pipeline/show.py": ("megazoo-pipeline-show",),
    "kernels/__main__.py": ("megazoo-kernels",),
}
# a message naming a command is about that command's flags
NAMED = {"generate.py": "megazoo-generate", "preprocess_data.py": "megazoo-preprocess-data",
         "reshard.py": "megazoo-reshard", "megazoo_to_hf.py": "megazoo-export-hf",
         "hf_to_megazoo.py": "megazoo-convert-hf", "zero_to_megazoo.py": "megazoo-convert-zero",
         "megazoo.plan": "megazoo-plan", "megazoo.plot": "megazoo-plot",
         "pretrain_gpt.py": "megazoo-pretrain"}


class _Parsed(Exception):
    pass


def command_flags(name: str, monkeypatch) -> set[str]:
    """The option strings of the parser command `name` builds (captured when it parses)."""
    seen = []

    def capture(self, args=None, namespace=None):
        seen.append(self)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
    module, func = cli.COMMANDS[name].split(":")
    with pytest.raises(_Parsed):
        getattr(cli, func)([])
    return {s for action in seen[0]._actions for s in action.option_strings}


@pytest.fixture(scope="module")
def flags():
    with pytest.MonkeyPatch.context() as mp:
        return {name: command_flags(name, mp) for name in cli.COMMANDS}


def _text(node: ast.AST) -> str:
    """The string pieces inside `node`, joined."""
    return " ".join(n.value for n in ast.walk(node)
                    if isinstance(n, ast.Constant) and isinstance(n.value, str))


def messages(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each raise, of each return in a function whose name holds 'hint' or
    'advice', and of each such constant (TOKENIZER_HINT = ...)."""
    tree = ast.parse(path.read_text())
    out = [(n.lineno, _text(n)) for n in ast.walk(tree) if isinstance(n, ast.Raise) and n.exc]
    for node in ast.walk(tree):
        name = getattr(node, "name", None) or " ".join(
            getattr(t, "id", "") for t in getattr(node, "targets", []))
        if not any(word in (name or "").lower() for word in ("hint", "advice")):
            continue
        if isinstance(node, ast.FunctionDef):
            out += [(n.lineno, _text(n)) for n in ast.walk(node) if isinstance(n, ast.Return)]
        elif isinstance(node, ast.Assign):
            out.append((node.lineno, _text(node)))
    return out


def owners(relative: str) -> tuple[str, ...]:
    return OWNERS[max((p for p in OWNERS if relative.startswith(p)), key=len)]


def unfollowable(flags: dict[str, set[str]]) -> list[str]:
    bad = []
    for path in sorted((ROOT / "megazoo").rglob("*.py")):
        relative = path.relative_to(ROOT / "megazoo").as_posix()
        for line, text in messages(path):
            named = [cmd for word, cmd in NAMED.items() if word in text]
            for flag in FLAG.findall(text):
                for command in named or owners(relative):
                    if flag not in flags[command]:
                        bad.append(f"megazoo/{relative}:{line}: {flag} is not a flag of {command}")
    return bad


def test_every_flag_a_message_names_exists_in_its_command(flags):
    assert unfollowable(flags) == []


def test_the_check_reads_flags_and_messages(flags, tmp_path):
    assert "--allow-nonfinite-load" not in flags["megazoo-reshard"]
    assert {"--allow-nonfinite-load", "--train-iters"} <= flags["megazoo-pretrain"]
    assert len(flags) == len(cli.COMMANDS) and all(flags.values())
    module = tmp_path / "m.py"
    module.write_text('def f(x):\n    raise ValueError(f"bad {x}: pass --allow-nonfinite-load '
                      'or a --save folder, not --offload-*")\n')
    [(line, text)] = messages(module)
    assert line == 2 and FLAG.findall(text) == ["--allow-nonfinite-load"]
