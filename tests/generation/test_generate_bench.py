"""bench/generate_bench.py --dry-run: the benchmark's code on CPU with tiny sizes (its
numbers mean nothing here; the test checks that every row is measured and written)."""
import json

import pytest

from bench.generate_bench import main


def test_dry_run_writes_every_row(tmp_path):
    pytest.importorskip("transformers")
    payload = main(["--dry-run", "--out", str(tmp_path / "g.json")])
    assert json.loads((tmp_path / "g.json").read_text()) == payload
    rows = {(r["impl"], r["batch"]): r for r in payload["rows"]}
    assert set(rows) == {(impl, b) for impl in ("megazoo", "megazoo-eager", "transformers")
                         for b in (1, 2)}
    assert all(r["tokens_per_s"] > 0 and r["vs_transformers"] > 0 for r in rows.values())
    assert set(payload["megazoo_vs_transformers"]) == {"1", "2"}
