"""The command-line convention (megazoo/cli.py): console commands, Megatron-path shims, modules."""
from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from megazoo import cli

ROOT = Path(__file__).resolve().parents[2]
SHIMS = ["pretrain_gpt.py", *sorted(p.relative_to(ROOT).as_posix()
                                    for p in (ROOT / "checkpoints_tools").glob("*.py"))]


def test_every_command_resolves_to_a_function_of_megazoo_cli():
    assert set(cli.COMMANDS) >= {"megazoo-pretrain", "megazoo-plan", "megazoo-convert-hf"}
    for name, target in cli.COMMANDS.items():
        module, _, function = target.partition(":")
        assert callable(getattr(importlib.import_module(module), function)), name


def test_setup_installs_exactly_these_commands():
    """setup.py reads COMMANDS from megazoo/cli.py's text; the entry_points line uses it."""
    setup = (ROOT / "setup.py").read_text()
    assert 'entry_points={"console_scripts": _console_scripts()}' in setup
    assert re.search(r'getattr\(t, "id", None\) == "COMMANDS"', setup)


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_help_exits_0(name, capsys):
    function = getattr(cli, cli.COMMANDS[name].partition(":")[2])
    with pytest.raises(SystemExit) as info:
        function(["--help"])
    assert info.value.code == 0
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("script", SHIMS)
def test_scripts_are_thin_shims_without_path_hacks(script):
    text = (ROOT / script).read_text()
    assert "sys.path" not in text, f"{script} edits sys.path"
    called = re.search(r"from megazoo\.cli import (\w+)", text)
    assert called and f"sys.exit({called.group(1)}())" in text, script
    body = ast.parse(text).body  # docstring, import sys, the import, the __main__ call
    assert len(body) <= 4, f"{script}: {len(body)} top-level statements; the logic belongs in megazoo"


def test_sparse_layout_says_when_the_causal_mask_is_applied(capsys):
    """--causal intersects the layout with causality; the printed section still says
    "attention": "bidirectional" (DeepSpeed's key), so the line says the mask is applied."""
    from megazoo.cli import sparse_layout

    assert sparse_layout(["--seq", "256", "--causal"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert "'attention': 'bidirectional'" in header and "intersected with the causal mask" in header
    assert sparse_layout(["--seq", "256"]) == 0
    assert "causal" not in capsys.readouterr().out.splitlines()[0]
