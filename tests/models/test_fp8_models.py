"""FP8 in whole models (ModelConfig.fp8_format): which linears run FP8, numerics of the CPU
emulation against the model dtype and against linears that call the emulation directly,
tensor / Megatron-sequence / pipeline parallelism, checkpoints across precisions.

Tolerances: an FP8 model against the same weights in float32: logits within 0.1 relative
Frobenius error (e4m3 rounds each operand to 2^-4 relative; a few GEMMs in sequence keep the
error a few times that, far below the logits' size). Against a model whose linears call
`fp8_linear` with the same recipe directly: equal (same ops, same order).
"""
import dataclasses
import warnings

import pytest
import torch

from helpers import fp8_model_checks
from helpers.fixtures import tiny_config
from megazoo.checkpoint import load_model_weights
from megazoo import save_checkpoint
from megazoo.config.precision import FP8Recipe
from megazoo.layers.fp8 import fp8_linear
from megazoo.models import build_model
from megazoo.testing import run_distributed

FAMILIES = ["gpt", "llama"]  # llama: SwiGLU (fused gate/up) and GQA (4 of 8 heads)


def _fp8_modules(model):
    return {n: m.fp8 for n, m in model.named_modules() if hasattr(m, "fp8")}


@pytest.mark.parametrize("layers", ["all", "mlp"])
def test_policy_fp8_linears_and_model_dtype_elsewhere(layers):
    model = build_model(tiny_config("llama", fp8_format="hybrid", fp8_layers=layers), device="cpu")
    on = sorted({n.rsplit(".", 1)[-1] for n, r in _fp8_modules(model).items() if r})
    assert on == (["dense", "fc1", "fc2", "qkv"] if layers == "all" else ["fc1", "fc2"])
    assert _fp8_modules(model)["output_layer"] is None
    assert build_model(tiny_config("llama"), device="cpu").config.fp8() is None


@pytest.mark.parametrize("bad,match", [(dict(fp8_format="e5m2"), "FP8 format must be one of"),
                                       (dict(fp8_recipe="delayed"), "FP8 recipe must be one of"),
                                       (dict(fp8_layers="attn"), "fp8_layers must be one of")])
def test_bad_fp8_fields_are_one_line(bad, match):
    with pytest.raises(ValueError, match=match):
        tiny_config("gpt", **bad)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fmt,rec", [("e4m3", "tensorwise"), ("hybrid", "rowwise")])
def test_fp8_logits_close_to_fp32_and_equal_direct_emulation(family, fmt, rec, monkeypatch):
    ids = fp8_model_checks.batch()[0]
    base = tiny_config(family)
    fp8_cfg = dataclasses.replace(base, fp8_format=fmt, fp8_recipe=rec)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no GEMM may fall back to the model dtype
        ref = build_model(base, device="cpu")(ids)
        got = build_model(fp8_cfg, device="cpu")(ids)
    err = ((got - ref).norm() / ref.norm()).item()
    assert 0 < err < 0.1, err  # measured 0.029-0.034
    recipe = FP8Recipe(fmt, rec, emulate=True)
    direct = build_model(base, device="cpu")  # model dtype layers whose F.linear is the emulation
    for name, m in direct.named_modules():
        if name.rsplit(".", 1)[-1] in ("qkv", "dense", "fc1", "fc2"):
            m.fp8 = recipe
    with torch.no_grad():
        emulated = direct(ids)
    torch.testing.assert_close(got, emulated, rtol=0, atol=0)


@pytest.mark.parametrize("src,dst", [("hybrid", None), (None, "e4m3")])
def test_checkpoint_loads_across_precisions(tmp_path, src, dst):
    """FP8 is compute only: the weights are saved in the model dtype, the fields in megazoo.json."""
    a = build_model(tiny_config("llama", fp8_format=src), device="cpu", seed=3)
    save_checkpoint(a, tmp_path / "ck")
    b = build_model(tiny_config("llama", fp8_format=dst), device="cpu", seed=7)
    meta, _ = load_model_weights(b, tmp_path / "ck")
    assert meta["model"]["fp8_format"] == src
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        real = getattr(p, "tp_unpadded", None) or p.shape[0]  # padded vocab rows load as 0
        assert p.dtype == q.dtype and torch.equal(p[:real], q[:real]), n


def _tp_configs():
    configs = {f"{fam} {rec}": tiny_config(fam, fp8_format="hybrid", fp8_recipe=rec)
               for fam in FAMILIES for rec in ("tensorwise", "rowwise")}
    configs["llama recompute full"] = tiny_config("llama", fp8_format="e4m3", recompute="full")
    return configs


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp2_and_megatron_sp_equal_per_shard_one_process(sequence_parallel):
    """Whole models, forward and backward: see tests/helpers/fp8_model_checks.py (rtol 1e-4, atol 1e-5)."""
    errors = run_distributed(fp8_model_checks.check_fp8_tp, 2, _tp_configs(), sequence_parallel,
                             timeout=300)
    assert errors == [[], []], "\n".join(errors[0][:20])


@pytest.mark.parametrize("family", FAMILIES)
def test_pipeline_pp2_equals_one_process(family):
    cfg = tiny_config(family, fp8_format="hybrid", fp8_recipe="rowwise")
    errors = run_distributed(fp8_model_checks.check_fp8_pp, 2, cfg, timeout=240)
    assert errors == [[], []], "\n".join(errors[0] + errors[1])
