"""DeepSpeed config merging (`megazoo.config.ds_config`), without processes."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from megazoo.config.ds_config import build_ds_config
from megazoo.config.ds_tuning import layer_elements, zero3_settings
from megazoo.config.presets import PRESETS
from megazoo.config.run import TrainingConfig
from megazoo.parallel import ParallelConfig

from helpers.run_args import ds_args as args


def test_flags_only():
    a = args(zero_stage=3, offload_optimizer="cpu")
    ds = build_ds_config(a, dp=2)
    assert ds["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                       **zero3_settings(a.model)}
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["train_batch_size"] == 32
    assert ds["gradient_accumulation_steps"] == 4 and ds["gradient_clipping"] == 1.0
    assert ds["bf16"] == {"enabled": False} and ds["fp16"] == {"enabled": False}


def test_json_and_agreeing_flags(tmp_path):
    user = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto",
            "train_batch_size": 32, "gradient_clipping": 1.0,
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu",
                                                                    "pin_memory": True},
                                  "overlap_comm": True}}
    training = TrainingConfig(micro_batch_size=4, global_batch_size=32, bf16=True)
    ds = build_ds_config(args(tmp_path, user, training, zero_stage=2), dp=2)
    zo = ds["zero_optimization"]
    assert zo["stage"] == 2 and zo["overlap_comm"] and zo["offload_optimizer"]["pin_memory"]
    assert ds["gradient_accumulation_steps"] == 4 and ds["bf16"]["enabled"] is True


@pytest.mark.parametrize("user, zero, words", [
    ({"zero_optimization": {"stage": 1}}, {"zero_stage": 3}, ["stage = 1", "--zero-stage", "3"]),
    ({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}},
     {"offload_optimizer": "cpu"}, ["'nvme'", "--offload-optimizer", "'cpu'"]),
    ({"train_micro_batch_size_per_gpu": 2}, {}, ["= 2", "--micro-batch-size gives 4"]),
    ({"train_batch_size": 64}, {}, ["= 64", "--global-batch-size gives 32"]),
    ({"gradient_accumulation_steps": 8}, {}, ["= 8", "dp 2"]),
    ({"gradient_clipping": 0.5}, {}, ["= 0.5", "--clip-grad gives 1.0"]),
    ({"bf16": {"enabled": True}}, {}, ["bf16.enabled = True", "the absence of --bf16 gives False"]),
    ({"optimizer": {"type": "Adam"}}, {}, ["optimizer", "remove"]),
    ({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}, {},
     ["--nvme-path"]),
    ({}, {"zero_stage": 2, "offload_param": "cpu"}, ["stage 3", "2"]),
])
def test_conflicts_name_both_values(tmp_path, user, zero, words):
    with pytest.raises(ValueError) as err:
        build_ds_config(args(tmp_path, user, **zero), dp=2)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_bad_json_and_batch_sizes(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(ValueError, match="not valid JSON"):
        build_ds_config(args(deepspeed_config=str(bad)), dp=1)
    with pytest.raises(ValueError, match="no such file"):
        build_ds_config(args(deepspeed_config=str(tmp_path / "missing.json")), dp=1)
    with pytest.raises(ValueError, match="must divide by"):
        build_ds_config(args(), dp=3)


def test_engines_refuse_bad_layouts_before_collectives():
    from megazoo.parallel.state import ParallelState
    from megazoo.training.backends.fsdp2 import check_args
    from megazoo.config.validate import check_deepspeed_pipeline

    state = ParallelState.single(ParallelConfig())
    with pytest.raises(ValueError, match="zero-impl fsdp2"):
        check_deepspeed_pipeline(2)
    with pytest.raises(ValueError, match="--zero-stage 3"):
        check_args(args(zero_impl="fsdp2", deepspeed=False, zero_stage=2), state)
    with pytest.raises(ValueError, match="fp16"):
        check_args(args(training=TrainingConfig(fp16=True), zero_impl="fsdp2",
                        deepspeed=False), state)


def test_merge_reads_the_json_where_no_flag_is_given():
    """The one merge rule: "auto" and absent keys are left out, stated ones read, a given
    flag that agrees (numbers by value) is kept and written into the JSON dict."""
    from megazoo.config.ds_config import TRAINING_KEYS, merge_flags

    ds = {"train_micro_batch_size_per_gpu": 2, "train_batch_size": "auto",
          "gradient_clipping": 0.5, "bf16": {"enabled": True}}
    assert merge_flags(ds, {}, TRAINING_KEYS, "ds.json") == {"micro_batch_size": 2,
                                                             "clip_grad": 0.5, "bf16": True}
    assert merge_flags(ds, {"micro_batch_size": 2.0, "global_batch_size": 8, "fp16": False},
                       TRAINING_KEYS, "ds.json") == {"micro_batch_size": 2.0, "clip_grad": 0.5,
                                                     "global_batch_size": 8, "bf16": True,
                                                     "fp16": False}
    assert ds["train_batch_size"] == 8 and ds["fp16"] == {"enabled": False}
    with pytest.raises(ValueError, match=r'ds.json: "bf16" must be a JSON object'):
        merge_flags({"bf16": True}, {"bf16": True}, TRAINING_KEYS, "ds.json")


def _parse_with_json(tmp_path, ds: dict, *flags: str):
    from megazoo.config.flags import parse_args

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    return parse_args(["--deepspeed", "--deepspeed_config", str(path), *flags])


USER_JSON = {"train_micro_batch_size_per_gpu": 4, "train_batch_size": 32,
             "gradient_clipping": 0.5, "bf16": {"enabled": True},
             "zero_optimization": {"stage": 2}}


def test_json_fills_training_flags_not_given(tmp_path, monkeypatch):
    """The parser's defaults (micro 8, global 16, clip 1.0, fp32) all disagree with the JSON:
    the JSON wins for every flag not on the command line, and the config then merges."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    t = _parse_with_json(tmp_path, USER_JSON).training
    assert (t.micro_batch_size, t.global_batch_size, t.clip_grad, t.bf16, t.fp16) == \
        (4, 32, 0.5, True, False)
    a = _parse_with_json(tmp_path, USER_JSON)
    ds = build_ds_config(a, dp=2)
    assert ds["gradient_accumulation_steps"] == 4 and ds["zero_optimization"]["stage"] == 2
    # Explicit flags that agree with the JSON are fine.
    a = _parse_with_json(tmp_path, USER_JSON, "--micro-batch-size", "4", "--bf16",
                         "--global-batch-size", "32", "--clip-grad", "0.5")
    assert build_ds_config(a, dp=2)["train_micro_batch_size_per_gpu"] == 4


@pytest.mark.parametrize("flags, words", [
    (("--micro-batch-size", "8"), ["= 4", "--micro-batch-size gives 8"]),
    (("--global-batch-size", "64"), ["= 32", "--global-batch-size gives 64"]),
    (("--clip-grad", "1.0"), ["= 0.5", "--clip-grad gives 1.0"]),
])
def test_given_flag_disagreeing_with_json_names_both(tmp_path, monkeypatch, flags, words):
    """Refused when the flags are parsed (for every engine), before any engine is built."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError) as err:
        _parse_with_json(tmp_path, USER_JSON, *flags)
    for word in words + ["ds.json"]:
        assert word in str(err.value), (word, str(err.value))


def test_global_batch_from_accumulation_steps_and_world(tmp_path, monkeypatch):
    """train_batch_size = micro x gradient_accumulation_steps x dp, dp from the launch."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}
    a = _parse_with_json(tmp_path, ds, "--tensor-model-parallel-size", "2")  # dp = 4
    assert (a.training.micro_batch_size, a.training.global_batch_size) == (2, 24)
    assert build_ds_config(a, dp=4)["gradient_accumulation_steps"] == 3
    a = _parse_with_json(tmp_path, {"train_batch_size": 48, "gradient_accumulation_steps": 3})
    assert (a.training.micro_batch_size, a.training.global_batch_size) == (2, 48)  # dp = 8
    a = _parse_with_json(tmp_path, ds, "--global-batch-size", "16")  # given: kept, then checked
    with pytest.raises(ValueError, match="gradient_accumulation_steps = 3"):
        build_ds_config(a, dp=8)


@pytest.mark.parametrize("ds, words", [
    ({"bf16": {"enabled": "false"}}, 'bf16.enabled = "false" must be a JSON bool'),
    ({"fp16": {"enabled": 1}}, "fp16.enabled = 1 must be a JSON bool"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": True}}},
     "zero_optimization.offload_optimizer.ratio = true must be a number"),
    ({"zero_optimization": {"stage": "2"}}, 'zero_optimization.stage = "2" must be an integer'),
    ({"train_batch_size": 32.5}, "train_batch_size = 32.5 must be an integer or \"auto\""),
    ({"gradient_clipping": "1.0"}, 'gradient_clipping = "1.0" must be a number or "auto"'),
    ({"gradient_compression": {"algorithm": "topk", "local_gradient_clipping": "false"}},
     'gradient_compression.local_gradient_clipping = "false" must be a JSON bool'),
    ({"zero_optimization": {"overlap_comm": "true"}},
     'zero_optimization.overlap_comm = "true" must be a JSON bool (true or false) or null'),
])
def test_json_values_of_the_wrong_type_are_one_line(tmp_path, capsys, ds, words):
    """A string "false" would be truthy and `true` a ratio of 1.0: each is refused, naming
    the key, the value and the type, before anything else (exit 2, one line)."""
    from megazoo.training.run import main

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    assert main(["--deepspeed", "--deepspeed_config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"error: --deepspeed_config {path}: {words}" in err[0], err


def test_json_values_of_the_right_type_pass(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ds = {"train_batch_size": "auto", "gradient_clipping": 1, "bf16": {"enabled": True},
          "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8, "overlap_comm": None,
                                "offload_optimizer": {"device": "cpu", "pin_memory": False}}}
    a = _parse_with_json(tmp_path, ds)
    assert build_ds_config(a, dp=1)["zero_optimization"]["reduce_bucket_size"] == 5e8


@pytest.mark.parametrize("json_values, flags", [
    ({"train_batch_size": 32}, ["--global-batch-size", "64"]),
    ({"train_micro_batch_size_per_gpu": 4}, ["--micro-batch-size", "8"]),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
     ["--global-batch-size", "16"]),
])
@pytest.mark.parametrize("engine", [[], ["--zero-impl", "fsdp2"]])
def test_every_engine_refuses_json_batch_conflicts_alike(tmp_path, monkeypatch, json_values,
                                                         flags, engine):
    """The plain and FSDP2 engines read the JSON's batch sizes too: a flag contradicting
    them is the error --deepspeed gives, word for word (one merge), whether the flags' parse
    finds it or (a conflict that needs the data-parallel size) the engine's setup."""
    from megazoo.parallel import ParallelState
    from megazoo.config.flags import parse_args
    from megazoo.training.backends import build_engine

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(json_values))

    def refusal(argv, build) -> str:
        with pytest.raises(ValueError) as exc:
            build(parse_args(argv))
        return str(exc.value)

    deepspeed = refusal(["--deepspeed", "--deepspeed_config", str(path), *flags],
                        lambda a: build_ds_config(a, 1))
    other = refusal(["--deepspeed_config", str(path), *flags, *engine],
                    lambda a: build_engine(a, torch.nn.Linear(2, 2), ParallelState.single()))
    assert other == deepspeed and "make them agree" in other


def test_zero3_gets_a_users_tuning_scaled_to_the_model(tmp_path):
    """ZeRO-3 without those keys: overlap, contiguous gradients, one layer per reduce bucket
    and prefetch, norms and biases whole; the JSON's own values (and only "auto" ones are
    replaced) win; stages 1-2 are left as DeepSpeed has them."""
    gpt = PRESETS["gpt-1.3b"]  # 24 x 2048: one layer is 12 h^2 (4h MLP, no GQA)
    assert layer_elements(gpt) == 12 * 2048 ** 2
    llama = dataclasses.replace(PRESETS["gpt-1.3b"], family="llama", activation="swiglu",
                                num_key_value_heads=4, ffn_hidden_size=5504)
    assert layer_elements(llama) == 2 * 2048 ** 2 + 2 * 2048 * 512 + 3 * 2048 * 5504
    user = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 123,
                                  "stage3_prefetch_bucket_size": "auto", "overlap_comm": False}}
    a = args(tmp_path, user)
    a.model = gpt
    zo = build_ds_config(a, dp=2)["zero_optimization"]
    assert zo["reduce_bucket_size"] == 123 and zo["overlap_comm"] is False
    assert zo["stage3_prefetch_bucket_size"] == 12 * 2048 ** 2
    assert zo["stage3_param_persistence_threshold"] == 20480 and zo["contiguous_gradients"]
    assert build_ds_config(args(zero_stage=2), dp=2)["zero_optimization"] == {"stage": 2}
    stage2 = {"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}
    assert build_ds_config(args(tmp_path, stage2), dp=2)["zero_optimization"] == {"stage": 2}


def test_bf16_zero3_accumulates_gradients_in_fp32(tmp_path):
    """bf16 ZeRO-3 with several micro-batches per step sums their gradients in fp32 like the
    plain engine's main gradients; the JSON's own data_types win; fp32 runs, one micro-batch
    per step, an offloaded optimizer and stages 1-2 get no data_types section."""
    def built(ds=None, micro=4, **training):
        cfg = TrainingConfig(micro_batch_size=micro, global_batch_size=32, **training)
        a = args(tmp_path, ds, training=cfg, zero_stage=3 if ds is None else None)
        return build_ds_config(a, dp=2)

    assert built(bf16=True)["data_types"] == {"grad_accum_dtype": "fp32"}
    user = {"zero_optimization": {"stage": 3}, "data_types": {"grad_accum_dtype": "bf16"}}
    assert built(user, bf16=True)["data_types"] == {"grad_accum_dtype": "bf16"}
    assert "data_types" not in built()
    assert "data_types" not in built(micro=16, bf16=True)  # one micro-batch per step
    offload = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    assert "data_types" not in built(offload, bf16=True)
    assert "data_types" not in built({"zero_optimization": {"stage": 2}}, bf16=True)
