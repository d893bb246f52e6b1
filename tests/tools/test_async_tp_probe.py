"""bench/async_tp_probe.py on CPU (gloo, 2 ranks, tiny shapes): every GEMM of a block with
its collective, in one call and on --tp-comm-overlap's path (on gloo its 4 chunks), agrees
with the one-call result (fp32: the same products summed in the same order); the row GEMMs
are also timed beside an independent reduce-scatter."""
from bench.async_tp_probe import probe
from megazoo.testing import run_distributed


def test_probe_rows_agree_on_gloo():
    rows = run_distributed(probe, 2, 64, 32, 64, 2, timeout=120)[0]
    assert {(r["gemm"], r["variant"]) for r in rows} == {
        (g, v) for g in ("qkv", "mlp_in", "attn_out", "mlp_out")
        for v in ("gemm", "nccl", "overlap")} | {
        ("attn_out", "beside"), ("mlp_out", "beside")}
    for r in rows:
        assert r["error"] is None and r["us"] > 0 and r["us_graph"] is None, r
        if r["variant"] != "gemm":
            assert r["rel_err"] < 1e-6, r
