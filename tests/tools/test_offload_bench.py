"""bench/offload_bench.py's dry run (tiny shape on CPU): the rows the next GPU call measures
(bf16 main gradients at the planned fraction, the delayed update, the FSDP2 peer, the
largest model the planner finds and DeepSpeed's) run end to end and report a rate and falling losses."""
import json

import pytest

from bench import offload_bench
from bench.offload_largest import run_flags


def test_run_flags_drop_the_batch_sizes_the_rows_set():
    command = ("python pretrain_gpt.py --family llama --num-layers 2 --micro-batch-size 1 "
               "--global-batch-size 1 --bf16 --nvme-path /x")
    assert run_flags(command) == ["--family", "llama", "--num-layers", "2", "--bf16",
                                  "--nvme-path", "/x"]


@pytest.mark.slow
def test_dry_run_of_the_new_rows(tmp_path):
    out = tmp_path / "rows.json"
    offload_bench.main(["--dry-run", "--rows", "fwd", "delayed16", "fsdp2", "--iters", "3",
                        "--largest",
                        "--largest-iters", "3", "--nvme-path", str(tmp_path / "nvme"),
                        "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["row"].split(" f=")[0] for r in rows] == [
        "fwd+bwd gb 16", "delayed16", "fsdp2 zero3 cpu-offload gb 16", "disk rates",
        "largest gb 4", "largest gb 16"], rows
    rates = rows.pop(3)
    assert "--zero-impl fsdp2" in rows.pop(2)["command"]
    assert rates["write_gb_per_s"] > 0 and rates["read_gb_per_s"] > 0
    for r in rows:
        assert "error" not in r and r["tokens_per_s"] > 0, r
    assert "--offload-delayed-update" in rows[1]["command"]
    assert rows[2]["num_parameters"] > 13e9 and "pretrain_gpt.py" in rows[2]["planned_command"]
    # the planner's 13B: the host share split, part of it on disk; the dry run's tiny model
    # (its budget sends it all to disk) leaves the store's files there
    planned = rows[2]["planned_command"]
    assert "--nvme-path" in planned and "--optimizer-offload-host-memory" in planned
    assert 0 < rows[2]["planned_disk_gb"] <= 40 and rows[2]["disk_gb"] > 0


def test_infinity_parameter_count_is_the_built_models():
    """The size estimate counts the parameters megazoo's LLaMA has (a tiny one, built; its
    vocabulary padded to 384), and its largest weight."""
    from megazoo.models import ModelConfig, build_model

    from bench.offload_infinity import largest_weight, num_parameters

    shape = dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn=96)
    cfg = ModelConfig(family="llama", num_layers=2, hidden_size=64, num_attention_heads=4,
                      num_key_value_heads=2, ffn_hidden_size=96, vocab_size=300,
                      max_position_embeddings=32)
    model = build_model(cfg, state=None, device="cpu", seed=0)
    assert num_parameters(shape, vocab=300) == sum(p.numel() for p in model.parameters())
    assert largest_weight(shape, vocab=300) == max(p.numel() for p in model.parameters())


def test_infinity_config_is_one_megazoo_and_deepspeed_accept(tmp_path):
    """The ds_config the rows write goes through megazoo's merge with the rows' flags, and
    its swap buffers hold what DeepSpeed asserts they hold: a parameter buffer the largest
    sub-group (a sub-group closes after the weight that brings it past sub_group_size)."""
    from megazoo.config.ds_config import build_ds_config
    from megazoo.config.flags import parse_args

    from bench.offload_bench import model_flags
    from bench.offload_infinity import (BIG, engine_flags, largest_weight, layer_parameters,
                                        write_config)

    shape = dict(BIG, layers=12)
    nvme = str(tmp_path / "nvme")
    config = write_config(shape, nvme, str(tmp_path), "nvme")
    args = parse_args(model_flags(shape) + ["--global-batch-size", "4", "--bf16"]
                      + engine_flags(config, nvme, "nvme"))
    zo = build_ds_config(args, 1)["zero_optimization"]
    assert zo["offload_param"]["device"] == zo["offload_optimizer"]["device"] == "nvme"
    assert zo["offload_param"]["nvme_path"] == zo["offload_optimizer"]["nvme_path"] == nvme
    assert zo["offload_param"]["buffer_size"] >= zo["sub_group_size"] + largest_weight(shape)
    assert largest_weight(shape) == 2 * 14336 * 4096  # fc1: gate and up, fused
    # a swapped-in weight takes a whole buffer: 4 weights a layer (qkv, dense, fc1, fc2), the
    # live layers and one prefetched must have one each
    live = zo["stage3_max_live_parameters"] // layer_parameters(shape)
    assert zo["offload_param"]["buffer_count"] >= 4 * (live + 1) and live >= 1
    cpu = json.loads(open(write_config(shape, nvme, str(tmp_path), "cpu")).read())
    assert cpu["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True}


def test_infinity_sizes_fit_the_disk_largest_first():
    """The largest size's swap files fit 90% of the free disk and one layer more does not;
    the second try is at most 0.85 of the first's parameters; a cap, a small disk and a small
    host bound it."""
    from bench.offload_infinity import BIG, disk_need, infinity_sizes, num_parameters

    disk, host = 55e9, 120e9
    sizes = infinity_sizes(disk, host)
    assert len(sizes) == 2 and sizes[0] > sizes[1] > 0, sizes
    assert disk_need(dict(BIG, layers=sizes[0])) <= 0.9 * disk
    assert disk_need(dict(BIG, layers=sizes[0] + 1)) > 0.9 * disk
    n = [num_parameters(dict(BIG, layers=x)) for x in sizes]
    assert n[1] <= 0.85 * n[0] and num_parameters(dict(BIG, layers=sizes[1] + 1)) > 0.85 * n[0]
    # 18 B per parameter: 55 GB holds about 2.7B parameters of it
    assert 2.4e9 < n[0] < 2.8e9, n
    assert infinity_sizes(disk, host, max_layers=sizes[1])[0] == sizes[1]
    assert infinity_sizes(1e9, host) == []
    assert infinity_sizes(disk, 1e9) == []  # the pinned buffers do not fit such a host


@pytest.mark.slow
def test_dry_run_of_the_infinity_rows(tmp_path):
    """ZeRO-Infinity's rows on CPU (tiny shape, DeepSpeed's nvme swapper, when its async_io op
    builds here) and the plain engine at the same size: rates, losses, the swap files."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible(verbose=False):
        pytest.skip("no libaio here: source the unpacked one as .gpu/setup.sh does")
    out = tmp_path / "rows.json"
    offload_bench.main(["--dry-run", "--rows", "infinity", "plain-at", "--largest-iters", "3",
                        "--nvme-path", str(tmp_path / "nvme"), "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["row"].split(" f=")[0] for r in rows] == ["infinity 0.39B gb 2", "plain-at L8"], rows
    for r in rows:
        assert "error" not in r and r["tokens_per_s"] > 0 and r["steps"] == 3, r
    assert "--offload-param nvme" in rows[0]["command"]
    assert rows[0]["disk_gb"] > 0
    assert "--optimizer-cpu-offload" in rows[1]["command"]
