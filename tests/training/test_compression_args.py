"""Compressed communication configured from `--deepspeed_config` (gradient_compression,
communication_data_type) and flags of the same names; refusals are one line."""
import json
import subprocess
import sys

import pytest
import torch

from megazoo.config.compression import (INTERNALS, RECIPES, CompressionConfig,
                                        check_onebit_backend)
from megazoo.config.ds_config import build_ds_config
from megazoo.config.flags import parse_args
from helpers.runs import ROOT, make_data, tiny_argv

SEEDS = {"gradient_compression": {"algorithm": "topk", "topk_ratio": 0.01},
         "communication_data_type": "fp16"}


def _json(tmp_path, data) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_json_sections_configure_the_plain_engine_without_a_warning(tmp_path, capsys):
    a = parse_args(["--deepspeed_config", _json(tmp_path, SEEDS)])
    c = a.compression
    assert (c.algorithm, c.value("topk_ratio"), c.wire_dtype) == ("topk", 0.01, torch.float16)
    assert c.value("compression_start_step") == 0
    assert "ignores" not in capsys.readouterr().err


def test_flags_alone_and_agreeing_with_the_json(tmp_path):
    a = parse_args(["--gradient-compression", "1bit", "--compression-start-step", "50",
                    "--compression-block-size", "256", "--communication-data-type", "bf16"])
    c = a.compression
    assert (c.algorithm, c.value("compression_start_step"), c.value("compression_block_size"),
            c.wire_dtype) == ("1bit", 50, 256, torch.bfloat16)
    b = parse_args(["--deepspeed_config", _json(tmp_path, SEEDS), "--topk-ratio", "0.01"])
    assert b.compression.value("topk_ratio") == 0.01


def test_a_recipe_from_the_json_section_or_the_flag_fills_keys_and_internals(tmp_path):
    tuned = {"momentum_share": 0.3, "topk_selection": "update", "local_clipping": True}
    section = {"recipe": "topk-tuned"}
    for argv in (["--deepspeed_config", _json(tmp_path, {"gradient_compression": section})],
                 ["--compression-recipe", "topk-tuned"]):
        c = parse_args(argv).compression
        assert (c.algorithm, c.value("topk_ratio"), c.value("compression_start_step"),
                c.freeze_variance) == ("topk", 0.01, 300, True)
        assert c.internals == tuned
    section["compression_start_step"] = 5  # a key given explicitly wins over the recipe's
    c = parse_args(["--deepspeed_config", _json(tmp_path, {"gradient_compression": section})])
    assert c.compression.value("compression_start_step") == 5
    plain = parse_args(["--gradient-compression", "topk", "--compression-start-step", "5",
                        "--freeze-variance"]).compression
    assert plain.internals == INTERNALS  # 1-bit Adam's rule (all the momentum) unless a recipe


@pytest.mark.parametrize("recipe, message", [
    ({"gradient_compression": "topk", "momentum_share": 0.5},
     "momentum_share 0.5 needs freeze_variance"),
    ({"gradient_compression": "topk", "compression_start_step": 5, "freeze_variance": True,
      "momentum_share": 1.5}, "and a value in \\[0, 1\\]"),
    ({"gradient_compression": "topk", "topk_selection": "update"},
     "topk_selection update weighs topk's entries by AdamW's frozen variance"),
    ({"gradient_compression": "1bit", "compression_start_step": 5, "freeze_variance": True,
      "topk_selection": "update"}, "it needs topk and freeze_variance"),
    ({"gradient_compression": "topk", "topk_selection": "size"}, "topk_selection must be one of"),
])
def test_bad_recipe_internals_are_one_line(monkeypatch, recipe, message):
    """Research recipes (bench/experimental) set the internals; their checks still hold."""
    monkeypatch.setitem(RECIPES, "research", recipe)
    with pytest.raises(ValueError, match=message):
        CompressionConfig(compression_recipe="research")


@pytest.mark.parametrize("data, flags, message", [
    (SEEDS, ["--topk-ratio", "0.1"],
     "sets gradient_compression.topk_ratio = 0.01 but --topk-ratio gives 0.1: make them agree"),
    (SEEDS, ["--communication-data-type", "bf16"],
     "sets communication_data_type = 'fp16' but --communication-data-type gives 'bf16'"),
    ({"gradient_compression": {"algorithm": "1bit", "ratio": 2}}, [], "unknown keys \\['ratio'\\]"),
    ({"gradient_compression": "topk"}, [], "gradient_compression = \"topk\" must be a JSON object"),
    ({"gradient_compression": {"algorithm": "topk", "huffman_coding": True}}, [],
     "huffman_coding is not implemented"),
    ({"gradient_compression": {"algorithm": "3bit"}}, [], "must be one of"),
    ({"communication_data_type": "int8"}, [], "--communication-data-type must be one of"),
    ({}, ["--topk-ratio", "0.1"], "--topk-ratio is read only with --gradient-compression topk"),
    ({}, ["--gradient-compression", "topk", "--topk-ratio", "0"], "must be in \\(0, 1\\]"),
    ({}, ["--gradient-compression", "1bit", "--compression-block-size", "12"], "multiple of 8"),
    ({"gradient_compression": {"recipe": "topk-best"}}, [],
     "--compression-recipe must be one of \\['1bit-adam', 'topk-tuned'\\]"),
    ({}, ["--compression-recipe", "topk-tuned", "--gradient-compression", "1bit"],
     "--compression-recipe topk-tuned is topk but --gradient-compression gives '1bit'"),
    ({"gradient_compression": {"algorithm": "topk", "topk_selection": "update"}}, [],
     "unknown keys \\['topk_selection'\\]"),
    ({}, ["--compression-recipe", "topk-tuned", "--tp", "2"],
     "--compression-recipe topk-tuned clips each rank's gradient by its own norm"),
    ({}, ["--compression-recipe", "topk-tuned", "--use-distributed-optimizer"],
     "needs the whole variance on every rank"),
    ({}, ["--gradient-compression", "1bit", "--deepspeed"],
     "compresses the plain engine's gradient buckets; DeepSpeed reduces gradients itself"),
    ({}, ["--gradient-compression", "2bit", "--zero-impl", "fsdp2"],
     "FSDP2 \\(--zero-impl fsdp2\\) reduces gradients itself"),
])
def test_bad_settings_are_one_line(tmp_path, data, flags, message):
    argv = (["--deepspeed_config", _json(tmp_path, data)] if data else []) + flags
    with pytest.raises(ValueError, match=message):
        parse_args(argv)


def test_deepspeed_gets_communication_data_type_and_onebit_optimizers(tmp_path):
    a = parse_args(["--deepspeed", "--communication-data-type", "bf16"])
    assert build_ds_config(a, 1)["communication_data_type"] == "bf16"
    onebit = {"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 100}}}
    b = parse_args(["--deepspeed", "--deepspeed_config", _json(tmp_path, onebit)])
    ds = build_ds_config(b, 1)
    assert ds["optimizer"]["type"] == "OneBitAdam"  # passed through, not refused
    with pytest.raises(ValueError, match="gradient_compression\": {\"algorithm\": \"1bit\"}"):
        check_onebit_backend("OneBitAdam", ds, torch.device("cpu"))


def test_pretrain_gpt_refuses_onebit_adam_here_in_one_line(tmp_path):
    """On this CPU (and with DeepSpeed releases that dropped the 1-bit optimizers) the run
    stops before any step with one error line naming the alternative; exit status 2."""
    ds = _json(tmp_path, {"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}}})
    argv = tiny_argv(make_data(tmp_path), "--deepspeed", "--deepspeed_config", ds)
    proc = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), *argv],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "--gradient-compression 1bit" in lines[0], proc.stderr[-2000:]


def test_memory_planner_counts_the_residuals():
    """gpt-125m at dp 2: 1bit adds a worker residual (4 B per parameter) and a server
    residual of half that buffer; topk only the worker's; dp 1 nothing (no reduction)."""
    import dataclasses

    from megazoo.parallel import ParallelConfig
    from megazoo.plan import PlanOptions, estimate_memory

    def optim(dp, *flags):
        args = parse_args(["--model", "gpt-125m", *flags])
        args = dataclasses.replace(args, parallel=ParallelConfig(dp=dp))
        return estimate_memory(args, PlanOptions())

    base, one = optim(2), optim(2, "--gradient-compression", "1bit")
    top = optim(2, "--gradient-compression", "topk")
    n = base.parameters_per_gpu
    assert one.optimizer_states - base.optimizer_states == 4 * n * 1.5
    assert top.optimizer_states - base.optimizer_states == 4 * n
    assert optim(1, "--gradient-compression", "1bit").optimizer_states == \
        optim(1).optimizer_states
