"""Every ```python block of README.md and of docs/*.md runs, so none can rot.

A block runs in a fresh namespace, in a scratch working folder: in this process (one rank, as
`python snippet.py` runs it: no process group), or on two spawned gloo ranks
(`run_distributed`) when the comment line just before its fence says
`<!-- snippet: torchrun 2 -->` (what the README tells users to launch under torchrun). `<!-- snippet: continues -->` runs a block after the
previous one, in its namespace (a snippet that goes on using the previous one's names), and
`<!-- snippet: skip REASON -->` leaves a block out; the README uses these sparingly.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from megazoo.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
BLOCK = re.compile(r"(?:<!-- snippet: (?P<mark>[^>]*?) -->\n)?```python\n(?P<code>.*?)```", re.S)


def sessions(text: str, name: str = "README.md") -> list[dict]:
    """A document's python blocks grouped into runs: {"ranks", "code", "line", "doc"}."""
    out = []
    for match in BLOCK.finditer(text):
        mark = (match["mark"] or "").split()
        line = text.count("\n", 0, match.start("code")) + 1
        if mark[:1] == ["skip"]:
            continue
        if mark[:1] == ["continues"]:
            if not out:
                raise ValueError(f"{name}:{line}: 'continues' needs an earlier block")
            out[-1]["code"] += f"\n# {name}:{line}\n" + match["code"]
            continue
        if mark and mark[0] != "torchrun":
            raise ValueError(f"{name}:{line}: unknown snippet mark {' '.join(mark)!r}")
        ranks = int(mark[1]) if mark else 1
        out.append({"ranks": ranks, "code": f"# {name}:{line}\n" + match["code"],
                    "line": line, "doc": name})
    return out


def _run_snippet(code: str, folder: str) -> bool:
    import os

    os.chdir(folder)  # a snippet that writes files writes them here
    exec(compile(code, "snippet", "exec"), {"__name__": "__main__"})
    return True


SESSIONS = [s for doc in DOCUMENTS for s in sessions(doc.read_text(), doc.relative_to(ROOT).as_posix())]


def test_documents_have_python_snippets():
    assert len(SESSIONS) >= 4 and any(s["ranks"] == 2 for s in SESSIONS)
    assert {s["doc"] for s in SESSIONS} >= {"README.md", "docs/parallelism.md", "docs/generation.md"}


@pytest.mark.parametrize("session", SESSIONS,
                         ids=lambda s: f"{s['doc']}:{s['line']}-{s['ranks']}rank")
def test_readme_snippet_runs(session, tmp_path, monkeypatch):
    if session["ranks"] == 1:
        monkeypatch.delenv("MASTER_ADDR", raising=False)  # one process, as the README runs it
        monkeypatch.delenv("WORLD_SIZE", raising=False)
        monkeypatch.chdir(tmp_path)  # restored after the test
        assert _run_snippet(session["code"], str(tmp_path))
        return
    assert run_distributed(_run_snippet, session["ranks"], session["code"], str(tmp_path),
                           timeout=120) == [True] * session["ranks"]


def test_marks_are_read():
    text = ("<!-- snippet: torchrun 2 -->\n```python\na = 1\n```\n"
            "<!-- snippet: continues -->\n```python\nb = a\n```\n"
            "<!-- snippet: skip needs a GPU -->\n```python\nimport cuda\n```\n```python\nc = 2\n```\n")
    got = sessions(text)
    assert [s["ranks"] for s in got] == [2, 1] and "b = a" in got[0]["code"]
    assert "import cuda" not in "".join(s["code"] for s in got)
    with pytest.raises(ValueError, match="unknown snippet mark 'torchrn 2'"):
        sessions("<!-- snippet: torchrn 2 -->\n```python\n```\n")
