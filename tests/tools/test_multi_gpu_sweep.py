"""bench/multi_gpu_sweep.py: which rows it runs on 2 and 4 GPUs, their flags, and the table's
ratios (the end-to-end CPU dry run needs megatron-core: `python -m bench.multi_gpu_sweep
--dry-run --out DIR` with it on PYTHONPATH)."""
from types import SimpleNamespace

import pytest

from bench.multi_gpu_sweep import layouts, megazoo_flags, table


def test_rows_per_machine(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)  # no deepspeed here
    assert layouts(2, 24) == {"dp2": (1, 1, 1, None), "tp2+SP": (2, 1, 1, None),
                              "pp2 interleaved": (1, 2, 2, None),
                              "Ulysses sp2": (1, 1, 1, ["--ds-sequence-parallel-size", "2"]),
                              "ZeRO-3 fsdp2 dp2": (1, 1, 1, ["--zero-impl", "fsdp2",
                                                             "--zero-stage", "3"])}
    four = layouts(4, 24)
    assert [k for k, v in four.items() if v[3] is None] == [
        "dp4", "tp2+SP x dp2", "tp4+SP", "tp2+SP x pp2 interleaved", "pp4 interleaved"]
    assert "pp4 interleaved" not in layouts(4, 4)  # 4 layers cannot split into 8 chunks
    finer = layouts(4, 24, vpp=6)  # one layer per virtual stage, named in the row
    assert finer["pp4 interleaved vpp6"] == (1, 4, 6, None)
    assert finer["tp2+SP x pp2 interleaved vpp6"] == (2, 2, 6, None)
    assert "pp4 interleaved vpp5" not in layouts(4, 24, vpp=5)


def test_vpp_below_two_refused(capsys):
    from bench.multi_gpu_sweep import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--out", "x", "--dry-run", "--vpp", "1"])
    assert "--vpp 1" in capsys.readouterr().err


def test_flags_of_a_pipeline_row_and_an_own_row():
    cfg = SimpleNamespace(iters=12, log_interval=3, dry_run=False, cuda_graph=False,
                          tp_comm_overlap=False, fsdp_blocks_per_unit=None)
    flags = megazoo_flags("gpt-1.3b", cfg, 1, 4, 2, None)
    assert flags[-4:] == ["--pipeline-model-parallel-size", "4",
                          "--num-layers-per-virtual-pipeline-stage", "3"]
    assert "--use-distributed-optimizer" in flags and "--bf16" in flags
    own = megazoo_flags("llama-8b-8l", cfg, 1, 1, 1, ["--zero-impl", "fsdp2"])
    assert own[-2:] == ["--zero-impl", "fsdp2"] and "--use-distributed-optimizer" not in own
    assert own[own.index("--global-batch-size") + 1] == "32"
    ulysses = megazoo_flags("gpt-1.3b", cfg, 1, 1, 1, ["--ds-sequence-parallel-size", "2"])
    assert "--use-distributed-optimizer" in ulysses  # the plain engine's rows all run it
    assert "--enable-cuda-graph" not in ulysses
    cfg.cuda_graph = True  # graphs where they capture: the plain engine
    assert "--enable-cuda-graph" in megazoo_flags("gpt-1.3b", cfg, 2, 1, 1, None)
    assert "--enable-cuda-graph" in megazoo_flags("gpt-1.3b", cfg, 1, 1, 1, ["--ds-sequence-parallel-size", "2"])
    assert "--enable-cuda-graph" in megazoo_flags("gpt-1.3b", cfg, 1, 4, 2, None)
    assert "--enable-cuda-graph" not in megazoo_flags("gpt-1.3b", cfg, 1, 1, 1, ["--zero-impl", "fsdp2"])
    cfg.tp_comm_overlap = True  # the tensor-parallel rows only
    assert "--tp-comm-overlap" in megazoo_flags("gpt-1.3b", cfg, 2, 2, 2, None)
    assert "--tp-comm-overlap" not in megazoo_flags("gpt-1.3b", cfg, 1, 4, 2, None)
    assert "--tp-comm-overlap" not in megazoo_flags("gpt-1.3b", cfg, 1, 1, 1,
                                                    ["--ds-sequence-parallel-size", "2"])
    cfg.fsdp_blocks_per_unit = 1  # the FSDP2 rows only
    fsdp2 = megazoo_flags("gpt-1.3b", cfg, 1, 1, 1, ["--zero-impl", "fsdp2"])
    assert fsdp2[-2:] == ["--fsdp-blocks-per-unit", "1"]
    assert "--fsdp-blocks-per-unit" not in megazoo_flags("gpt-1.3b", cfg, 1, 1, 1,
                                                         ["--deepspeed", "--zero-stage", "3"])


def test_table_ratios():
    saved = {"rows": {"one GPU": {"gpus": 1, "megazoo": {"tokens_per_s": 100.0},
                                  "mcore": {"tokens_per_s": 50.0}},
                      "tp2+SP": {"gpus": 2, "megazoo": {"tokens_per_s": 160.0},
                                 "mcore": {"error": "exit 1: boom"}},
                      "dp2": {"gpus": 2, "megazoo": {"tokens_per_s": 190.0},
                              "mcore": {"tokens_per_s": 95.0}}}}
    rows = {r["layout"]: r for r in table(saved)}
    assert rows["dp2"]["scaling"] == pytest.approx(0.95)
    assert rows["dp2"]["mcore scaling"] == pytest.approx(0.95)
    assert rows["dp2"]["vs mcore"] == pytest.approx(2.0)
    assert rows["tp2+SP"]["scaling"] == pytest.approx(0.8) and rows["tp2+SP"]["vs mcore"] is None
    assert rows["tp2+SP"]["error"] == "exit 1: boom"
