"""Values the run's configuration refuses (one ValueError naming the flag or the JSON key)
and what it no longer refuses: non-finite learning rates and host-memory budgets, flags that
need another flag, ds_config offload values neither engine knows, a ds_config nvme_path that
disagrees with --nvme-path, and no false warning for an offload section the plain engine
applies."""
from __future__ import annotations

import json
import re

import pytest

from megazoo.config.flags import parse_args
from megazoo.config.offload import plain_offload


def _json(tmp_path, data) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize("argv, says", [
    (["--lr", "inf"], "need 0 <= --min-lr <= --lr, both finite, got --lr inf"),
    (["--lr", "nan"], "need 0 <= --min-lr <= --lr, both finite, got --lr nan"),
    (["--lr", "1e-3", "--min-lr", "nan"], "--min-lr nan"),
    (["--optimizer-cpu-offload", "--nvme-path", "/tmp", "--optimizer-offload-host-memory",
      "nan"], "--optimizer-offload-host-memory must be a finite >= 0 GB, got nan"),
    (["--offload-delayed-update-start", "5"],
     "--offload-delayed-update-start needs --offload-delayed-update"),
    (["--cpu-threads", "0"], "--cpu-threads must be >= 1, got 0"),
])
def test_refused_values(argv, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        parse_args(argv)


def test_lr_alone_below_the_old_min_lr_default_is_accepted():
    """Megatron's --min-lr default is 0: a run that sets only --lr decays to 0."""
    t = parse_args(["--lr", "3e-5"]).training
    assert (t.lr, t.min_lr) == (3e-5, 0.0)


@pytest.mark.parametrize("section, says", [
    ({"device": "gpu"}, "zero_optimization.offload_optimizer.device = 'gpu' is not one of"),
    ({"device": "cpu", "ratio": 1.5}, "zero_optimization.offload_optimizer.ratio = 1.5 is the "
                                      "share offloaded, in (0, 1]"),
    ({"device": "cpu", "ratio": 0}, "ratio = 0 is the share"),
])
def test_ds_config_offload_values(tmp_path, section, says):
    ds = _json(tmp_path, {"zero_optimization": {"offload_optimizer": section}})
    for engine in ([], ["--deepspeed", "--zero-stage", "3"]):
        with pytest.raises(ValueError, match=re.escape(says)):
            parse_args(["--deepspeed_config", ds, *engine])


def test_ds_config_nvme_path_must_agree_with_the_flag(tmp_path):
    ds = _json(tmp_path, {"zero_optimization": {"offload_optimizer": {
        "device": "nvme", "nvme_path": str(tmp_path / "json_dir")}}})
    with pytest.raises(ValueError, match="offload_optimizer.nvme_path = .*json_dir.* but "
                                         "--nvme-path gives .*flag_dir.*make them agree"):
        parse_args(["--deepspeed_config", ds, "--nvme-path", str(tmp_path / "flag_dir")])
    same = parse_args(["--deepspeed_config", ds, "--nvme-path", str(tmp_path / "json_dir")])
    assert plain_offload(same).nvme_path == str(tmp_path / "json_dir")


def test_an_offload_section_the_plain_engine_applies_gets_no_warning(tmp_path, capsys):
    ds = _json(tmp_path, {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}})
    args = parse_args(["--deepspeed_config", ds])
    assert plain_offload(args) is not None  # the plain engine offloads as the JSON says
    assert "ignores" not in capsys.readouterr().err


def test_a_fraction_that_whole_buckets_cannot_split_is_said(data, capsys):
    """One gradient bucket: --optimizer-offload-fraction 0.5 offloads all of it; a line says
    so and which flag splits finer. Many small buckets: nothing to say."""
    from megazoo.config.offload import fraction_note
    from helpers.runs import tiny_argv
    from megazoo.training.run import run_training

    assert fraction_note(0.5, [100], [100]).startswith(
        "--optimizer-offload-fraction 0.5 offloads 100% here")
    assert fraction_note(0.5, [10] * 5, [10] * 10) is None
    lines = []
    run_training(tiny_argv(data, "--optimizer-cpu-offload", "--optimizer-offload-fraction",
                           "0.5", "--train-iters", "1"), print_fn=lines.append)
    assert any("offloads 100% here" in x and "--ddp-bucket-size" in x for x in lines), lines
