"""bench/sparse_attention_bench.py --dry-run (CPU): the sweep's layouts and plans at a small
length, the path each row takes (the seeds' section on its chunk rectangles, `seeds_gather`
on the plan without them), and every path's forward against the dense-mask math path."""
import json

from bench.sparse_attention_bench import main


def test_dry_run_paths(tmp_path):
    out = tmp_path / "sparse.json"
    assert main(["--dry-run", "--seqs", "8192", "--modes", "seeds", "seeds_gather", "bslongformer",
                 "--blocks", "16", "--out", str(out)]) == 0
    rows = {r["config"]: r for r in json.loads(out.read_text())["dry_run"]}
    assert rows["seeds"]["path"] == "rects" and rows["seeds"]["rect_share"] > 0.5
    assert rows["seeds_gather"]["path"] == "gather" and rows["seeds_gather"]["rect_share"] is None
    assert rows["bslongformer"]["path"] == "tiles"
