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
