"""bench/host_pace.py: the host's time per micro-batch per layout on the fake process group,
and the planner constants it fits (the GPU numbers come from `--device cuda`)."""
import json
import os

import pytest
import torch

from bench import host_pace


def test_cpu_rows_and_fit(tmp_path, capsys):
    out = tmp_path / "pace.json"
    assert host_pace.main(["--layers", "2", "--heads", "4", "--seq", "16", "--steps", "2",
                           "--repeats", "1", "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert set(saved["rows"]) == set(host_pace.LAYOUTS)
    assert all(r["ms_per_micro_batch"] > 0 for r in saved["rows"].values())
    assert saved["fit"]["host_block_ms"] > 0 and saved["fit"]["host_collective_ms"] >= 0
    assert saved["fit"]["host_fsdp2_unit_ms"] > 0  # FSDP2's hooks cost host time
    assert saved["fit"]["host_deepspeed_block_ms"] > 0  # and DeepSpeed ZeRO-3's
    assert all(0 < r["forward_ms"] < r["ms_per_micro_batch"] for r in saved["rows"].values())
    assert 0 < saved["fit"]["host_forward_share"] < 1
    assert "fit: host_block_ms" in capsys.readouterr().out


def test_kernel_rows(tmp_path, capsys):
    """--kernels reports each layout's compute per micro-batch (on CPU the aten operators'
    own time) and fits no host constant."""
    out = tmp_path / "kernels.json"
    assert host_pace.main(["--kernels", "--layers", "2", "--heads", "4", "--seq", "16",
                           "--steps", "2", "--layouts", "tp1", "tp2+SP", "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert all(r["kernel_ms"] > 0 for r in saved["rows"].values()) and saved["fit"] == {}
    assert "fit:" not in capsys.readouterr().out


def test_fit_arithmetic():
    """tp1 gives the time per block; tp2 + SP's extra time spread over its 8 calls per block
    (2 all-gathers and 2 reduce-scatters each way); the forward's share pooled over the rows."""
    args = host_pace.parse_args(["--layers", "4", "--heads", "4", "--fsdp-blocks-per-unit", "1"])
    rows = {"tp1": {"ms_per_micro_batch": 8.0, "forward_ms": 4.0},
            "tp2+SP": {"ms_per_micro_batch": 11.2, "forward_ms": 5.0},
            "fsdp2 dp4": {"ms_per_micro_batch": 14.0, "forward_ms": 6.8}}
    fit = host_pace.fit(rows, args)
    assert fit["host_forward_share"] == pytest.approx(15.8 / 33.2)  # pooled over the rows
    assert fit["host_block_ms"] == pytest.approx(2.0)
    assert fit["host_collective_ms"] == pytest.approx(3.2 / (4 * 8))
    assert fit["host_fsdp2_unit_ms"] == pytest.approx(6.0 / 4)  # FSDP2's extra per block
    args = host_pace.parse_args(["--layers", "4", "--heads", "4", "--fsdp-blocks-per-unit", "2"])
    assert host_pace.fit(rows, args)["host_fsdp2_unit_ms"] == pytest.approx(6.0 / 2)  # per unit


def test_fsdp2_row_runs_sharded_without_gradient_sync():
    """The FSDP2 row's model is FSDP2-sharded over a dp 4 mesh and, as in a micro-batch
    before the step's last, does not reduce-scatter its gradients."""
    from torch.distributed.fsdp import FSDPModule

    args = host_pace.parse_args(["--layers", "2", "--heads", "4", "--seq", "16"])
    try:
        _, model, _ = host_pace._model(args, *host_pace.LAYOUTS["fsdp2 dp4"])
        assert torch.distributed.get_world_size() == 4 and isinstance(model, FSDPModule)
        assert all(isinstance(block, FSDPModule) for block in model.layers.values())
        ids = torch.randint(0, 2048, (1, 16))
        model(ids, ids).backward()
        # without gradient sync FSDP2 keeps the unsharded gradients: no sharded .grad
        assert all(p.grad is None for p in model.parameters())
        model.set_requires_gradient_sync(True)
        model(ids, ids).backward()
        assert all(p.grad is not None for p in model.parameters())
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()  # no later test sees the fake group


def test_deepspeed_row_runs_zero3_over_dp4():
    """The DeepSpeed row is DeepSpeed's ZeRO-3 engine over the fake dp 4 group: its
    parameters partitioned (an empty module tensor, a quarter of each in its partition)."""
    args = host_pace.parse_args(["--layers", "2", "--heads", "4", "--seq", "16"])
    try:
        with host_pace.launcher_variables():
            _, engine, backward = host_pace._model(args, *host_pace.LAYOUTS["deepspeed dp4"])
            weight = engine.module.layers["0"].mlp.fc1.weight
            ids = torch.randint(0, 1000, (1, 16))
            backward(engine(ids, ids))
        assert engine.zero_optimization_stage() == 3 and engine.dp_world_size == 4
        assert weight.numel() == 0 and weight.ds_tensor.numel() == -(-weight.ds_numel // 4)
        assert "LOCAL_RANK" not in os.environ
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_refuses_a_split_that_does_not_divide(capsys):
    with pytest.raises(SystemExit):
        host_pace.parse_args(["--seq", "15", "--layouts", "tp2+SP"])
    assert "must divide by 2" in capsys.readouterr().err
