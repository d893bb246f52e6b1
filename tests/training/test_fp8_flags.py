"""FP8 flags of pretrain_gpt.py: Megatron's --fp8-format / --fp8-recipe plus --fp8-layers,
and the one-line refusal of FP8 on a device without FP8 tensor cores (before any collective)."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megazoo.config.flags import parse_args
from megazoo.config.precision import FP8Recipe
from megazoo.layers import fp8

ROOT = Path(__file__).resolve().parents[2]
CPU_ERROR = ("error: --fp8-format needs a GPU with FP8 tensor cores (compute capability 8.9+: "
             "Ada, Hopper); this run is on cpu, where FP8 is only emulated, for tests: remove "
             "--fp8-format")


def test_flags_set_the_model_fields():
    model = parse_args(["--fp8-format", "hybrid", "--fp8-recipe", "rowwise",
                        "--fp8-layers", "mlp"]).model
    assert (model.fp8_format, model.fp8_recipe, model.fp8_layers) == ("hybrid", "rowwise", "mlp")
    assert model.fp8("mlp") == FP8Recipe("hybrid", "rowwise") and model.fp8("attention") is None
    assert parse_args([]).model.fp8() is None


@pytest.mark.parametrize("argv,rc,line", [
    (["--fp8-format", "e4m3"], 2, CPU_ERROR),
    (["--fp8-format", "e5m2"], 2, "pretrain_gpt.py: error: --fp8-format 'e5m2' is not one of "
     "its choices: choose from e4m3, hybrid (pretrain_gpt.py --help lists every flag)")])
def test_cli_fp8_on_cpu_or_bad_value_is_one_line_exit_2(argv, rc, line, tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), *argv],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == rc and proc.stderr.strip().splitlines()[-1] == line, proc.stderr
    assert "Traceback" not in proc.stderr


def test_pre_ada_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(fp8, "_cuda_fp8_capable", lambda index: (False, "sm_80"))
    with pytest.raises(ValueError, match=r"^FP8 GEMMs need FP8 tensor cores .*cuda:0 is sm_80: "
                                         r"run without FP8 \(--fp8-format\)$"):
        fp8.check_fp8_run(FP8Recipe(), torch.device("cuda", 0))
    fp8.check_fp8_run(None, torch.device("cpu"))  # FP8 off: nothing to check


def test_engines_keep_fp8_weight_casts_only_where_parameters_stay_whole():
    """The plain engine (and ZeRO-1/2) casts each FP8 weight once per step; an engine that
    gathers parameters per layer (ZeRO-3, FSDP2) keeps no casts, which would hold an FP8 copy
    of every weight of the stage."""
    import contextlib

    from megazoo.training.backends.base import Engine

    engine = Engine()
    with engine._weight_casts():
        assert fp8._WEIGHT_CASTS.get() == {}
    assert fp8._WEIGHT_CASTS.get() is None
    engine.gathers_parameters = True
    assert isinstance(engine._weight_casts(), contextlib.nullcontext)
