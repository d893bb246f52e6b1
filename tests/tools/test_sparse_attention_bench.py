"""bench/sparse_attention_bench.py --dry-run (CPU): the sweep's layouts and plans at a small
length, the path each row takes (the seeds' section on the strided plan, `seeds_rects` on the
gather plan with its chunk rectangles, `seeds_gather` without them), and every path's forward
against the dense-mask math path."""
import json

from bench.sparse_attention_bench import main


def test_dry_run_paths(tmp_path):
    out = tmp_path / "sparse.json"
    assert main(["--dry-run", "--seqs", "8192", "--modes", "seeds", "seeds_rects", "seeds_gather",
                 "bslongformer", "--blocks", "16", "--out", str(out)]) == 0
    rows = {r["config"]: r for r in json.loads(out.read_text())["dry_run"]}
    assert rows["seeds"]["path"] == "strided" and rows["seeds"]["rect_share"] is None
    assert 0.12 < rows["seeds"]["tile_density"] < 0.2  # density 12.6 %, plus the local tiles
    assert rows["seeds_rects"]["path"] == "rects" and rows["seeds_rects"]["rect_share"] > 0.5
    assert rows["seeds_gather"]["path"] == "gather" and rows["seeds_gather"]["rect_share"] is None
    assert rows["bslongformer"]["path"] == "tiles"


def test_sparse_training_dry_run(tmp_path):
    """bench/sparse_training.py: dense, the seeds' section and its path-before child all train
    (tiny, CPU) and the loss comparison is filled in."""
    from bench.sparse_training import main as training

    out = tmp_path / "training.json"
    assert training(["--dry-run", "--iters", "10", "--logs", str(tmp_path / "logs"),
                     "--out", str(out)]) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"dense", "seeds", "seeds_before"}
    assert all(r["iterations"] == 10 for r in rows.values())
    assert abs(rows["seeds"]["loss_vs_path_before"]) < 1e-3  # one function, two paths
