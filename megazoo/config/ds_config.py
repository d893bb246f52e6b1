"""A DeepSpeed JSON and the flags: one merge, one conflict rule, one message.

    values = merge_flags(ds, given, TRAINING_KEYS, source)   # {field: value}
    ds = build_ds_config(args, dp)     # the dict for deepspeed.initialize(config=...)

Each section of a run's configuration that a ds_config can also state (batches, clipping,
precision, ZeRO stage and offload, compression, sparse attention) is a table of `JsonKey`s:
the field, where the JSON holds it, the flag that gives it. `merge_flags` applies the one
rule to any table: a flag given wins where the JSON says nothing or "auto" (as in Hugging
Face's DeepSpeed integration), a flag not given takes the JSON's value, and a JSON value
other than a given flag's (numbers compare by value) is an error naming both:

    --deepspeed_config ds.json sets train_batch_size = 64 but --global-batch-size gives 32:
    make them agree (change the flag or the JSON, or put "auto" in the JSON)

The parser (`flags.py`) merges the training, compression and sparse attention tables for
every engine; `build_ds_config` merges the ZeRO table (DeepSpeed's alone) and the run's
training values into a copy of the JSON, with DeepSpeed's `train_batch_size = micro *
accumulation * dp` (our dp, not dp x sp: sp ranks see pieces of the same sequences).

The `sparse_attention` section is the model's (every engine) and is left out of the dict
DeepSpeed gets: releases without DeepSpeed's own sparse attention refuse a config holding it.
"""
from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass

from .ds_schema import check_types
from .ds_tuning import fill_zero

AUTO = "auto"
SPARSE_SECTION = "sparse_attention"  # megazoo's model reads it; DeepSpeed never gets it
COMPRESSION_SECTION = "gradient_compression"  # the plain engine's; refused by the others
# DeepSpeed's compressed-communication optimizers: their "optimizer" section passes through.
ONEBIT_OPTIMIZERS = ("onebitadam", "zerooneadam", "onebitlamb")


@dataclass(frozen=True)
class JsonKey:
    """A config field, where a ds_config holds it, and the flag that gives it."""

    field: str
    path: tuple[str, ...]
    flag: str
    switch: bool = False
    """A store-true flag: False is "the absence of" the flag."""


TRAINING_KEYS = (
    JsonKey("micro_batch_size", ("train_micro_batch_size_per_gpu",), "--micro-batch-size"),
    JsonKey("global_batch_size", ("train_batch_size",), "--global-batch-size"),
    JsonKey("clip_grad", ("gradient_clipping",), "--clip-grad"),
    JsonKey("bf16", ("bf16", "enabled"), "--bf16", switch=True),
    JsonKey("fp16", ("fp16", "enabled"), "--fp16", switch=True))
ZERO_KEYS = (
    JsonKey("zero_stage", ("zero_optimization", "stage"), "--zero-stage"),
    JsonKey("offload_optimizer", ("zero_optimization", "offload_optimizer", "device"),
            "--offload-optimizer"),
    JsonKey("offload_param", ("zero_optimization", "offload_param", "device"), "--offload-param"),
    JsonKey("offload_optimizer_ratio", ("zero_optimization", "offload_optimizer", "ratio"),
            "--offload-optimizer-ratio"))
COMM_KEY = JsonKey("communication_data_type", ("communication_data_type",),
                   "--communication-data-type")
# Top-level keys that every engine reads (DeepSpeed's engine reads the whole file).
READ_BY_ALL = {SPARSE_SECTION, COMPRESSION_SECTION, COMM_KEY.path[0],
               "gradient_accumulation_steps"} | {k.path[0] for k in TRAINING_KEYS}


def read_ds_config(path: str | None) -> tuple[dict, str]:
    """(the JSON object at `path`, the name errors give it); ({}, ...) without a file. A clear
    error if the file is missing, not a JSON object, or holds a value of the wrong type for its
    key (`ds_schema.check_types`)."""
    if not path:
        return {}, "DeepSpeed config"
    source = f"--deepspeed_config {path}"
    if not os.path.isfile(path):
        raise ValueError(f"{source}: no such file")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{source} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset "
                         f"{exc.start}): save it as UTF-8 JSON") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{source} must hold a JSON object, got {type(data).__name__}")
    check_types(data, source)
    _check_offload_values(data, source)
    return data, source


def _check_offload_values(ds: dict, source: str) -> None:
    """The offload sections' values (their types are checked): a device DeepSpeed and the plain
    engine know, and a ratio that is a share."""
    zo = ds.get("zero_optimization") or {}
    for key in ("offload_optimizer", "offload_param"):
        section = zo.get(key) or {}
        device = section.get("device")
        if device not in (None, "none", "cpu", "nvme"):
            raise ValueError(f"{source}: zero_optimization.{key}.device = {device!r} is not "
                             f"one of \"none\", \"cpu\", \"nvme\": fix the JSON")
        ratio = section.get("ratio", 1.0)
        if not 0 < ratio <= 1:
            raise ValueError(f"{source}: zero_optimization.{key}.ratio = {ratio!r} is the share "
                             f"offloaded, in (0, 1]: fix the JSON")


def merge_nvme_path(ds: dict, nvme_path: str | None, source: str, sections=None) -> None:
    """--nvme-path into the offload sections of `ds` (all that are objects, or `sections`): the
    one merge rule, so a JSON nvme_path that disagrees with the flag is refused by name."""
    zo = ds.get("zero_optimization") or {}
    for key in sections or ("offload_optimizer", "offload_param"):
        if nvme_path is not None and isinstance(zo.get(key), dict):
            flag = JsonKey("nvme_path", ("zero_optimization", key, "nvme_path"), "--nvme-path")
            merge_flags(ds, {"nvme_path": nvme_path}, [flag], source)


def merge_flags(ds: dict, given: dict, keys, source: str) -> dict:
    """The one merge of flags with a ds_config (see the module doc) over the table `keys`:
    {field: value} of every key that the flags (`given`, by field) or the JSON (`ds`, named
    `source` in errors) state. Given values are also written into `ds`."""
    out = {}
    for key in keys:
        old = _lookup(ds, key.path, source)
        if key.field not in given:
            if not _unset(old):
                out[key.field] = old
            continue
        value = given[key.field]
        if not _unset(old) and old != value and not (_num(old) and _num(value)
                                                     and float(old) == float(value)):
            flag = f"the absence of {key.flag}" if key.switch and value is False else key.flag
            raise ValueError(f"{source} sets {'.'.join(key.path)} = {old!r} but {flag} gives "
                             f"{value!r}: make them agree (change the flag or the JSON, or put "
                             f"\"auto\" in the JSON)")
        node = ds
        for k in key.path[:-1]:
            if not isinstance(node.get(k), dict):
                node[k] = {}  # absent or null
            node = node[k]
        node[key.path[-1]] = value
        out[key.field] = value
    return out


def _lookup(ds: dict, path: tuple[str, ...], source: str):
    """ds[k0][k1]..., or AUTO where a key is absent."""
    node = ds
    for i, k in enumerate(path[:-1]):
        node = node.get(k)
        if node is None:
            return AUTO
        if not isinstance(node, dict):
            raise ValueError(f"{source}: \"{'.'.join(path[:i + 1])}\" must be a JSON object, "
                             f"got {type(node).__name__}")
    return node.get(path[-1], AUTO)


def _unset(value) -> bool:
    return value is None or value == AUTO


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _zero_flags(ds: dict, zero, source: str) -> None:
    given = {k.field: getattr(zero, k.field) for k in ZERO_KEYS if getattr(zero, k.field) is not None}
    merge_flags(ds, given, ZERO_KEYS, source)
    zo = ds.setdefault("zero_optimization", {})
    zo.setdefault("stage", 0)
    ratio = (zo.get("offload_optimizer") or {}).get("ratio", 1.0)
    if ratio != 1.0 and zo["stage"] != 3:
        raise ValueError(f"a partial optimizer offload (ratio {ratio}) needs ZeRO stage 3, but the "
                         f"stage is {zo['stage']}: pass --zero-stage 3 or drop the ratio")
    param_dev = (zo.get("offload_param") or {}).get("device", "none")
    if param_dev not in (None, "none") and zo["stage"] != 3:
        raise ValueError(f"parameter offload ({param_dev}) needs ZeRO stage 3, but the stage is "
                         f"{zo['stage']}: pass --zero-stage 3 or drop --offload-param")
    for key in ("offload_optimizer", "offload_param"):
        section = zo.get(key)
        if isinstance(section, dict) and section.get("device") == "nvme":
            merge_nvme_path(ds, zero.nvme_path, source, [key])
            if not section.get("nvme_path"):
                raise ValueError(f"{key} to nvme needs a folder: pass --nvme-path DIR or set "
                                 f"zero_optimization.{key}.nvme_path in the JSON")


def _training(ds: dict, training, dp: int, source: str) -> None:
    """The run's batches, clipping and precision into `ds` (fp16: its loss scaling too)."""
    micro, glob = training.micro_batch_size, training.global_batch_size
    if glob % (micro * dp):
        raise ValueError(f"--global-batch-size {glob} must divide by --micro-batch-size {micro} "
                         f"x data-parallel size {dp}: change one of them")
    accumulation = JsonKey("gradient_accumulation_steps", ("gradient_accumulation_steps",),
                           f"--global-batch-size {glob} / (--micro-batch-size {micro} x dp {dp})")
    values = {"micro_batch_size": micro, "global_batch_size": glob,
              "clip_grad": float(training.clip_grad), "bf16": bool(training.bf16),
              "fp16": bool(training.fp16), "gradient_accumulation_steps": glob // (micro * dp)}
    merge_flags(ds, values, (*TRAINING_KEYS, accumulation), source)
    if training.fp16:
        fp16 = ds["fp16"]
        fp16.setdefault("loss_scale", 0)  # dynamic
        fp16.setdefault("initial_scale_power", int(round(math.log2(training.initial_loss_scale))))
        fp16.setdefault("loss_scale_window", training.loss_scale_window)
        fp16.setdefault("min_loss_scale", training.min_loss_scale)


def _grad_accumulation(ds: dict, training) -> None:
    """bf16 ZeRO-3 that accumulates micro-batches on the GPU sums their gradients into fp32
    partitions, as the plain engine's main gradients are (DeepSpeed's default there is the
    model's dtype: the 8 micro-batches of a LLaMA-8B-like step at dp 4 round each gradient
    8 times); the JSON's data_types.grad_accum_dtype wins ("bf16" keeps DeepSpeed's). Left as
    DeepSpeed has them: one micro-batch per step (nothing is summed), an offloaded optimizer
    (the partitions live in pinned host memory, which fp32 would double), stages 1-2 (at
    stage 1 fp32 accumulation swaps in another optimizer wrapper)."""
    if training.bf16 and zero_stage(ds) == 3 and offload_device(ds) == "none" and \
            ds.get("gradient_accumulation_steps", 1) > 1:
        ds.setdefault("data_types", {}).setdefault("grad_accum_dtype", "fp32")


def check_json_training_keys(args, dp: int) -> None:
    """For the plain and fsdp2 engines, which read --deepspeed_config's batches, clipping and
    precision: the JSON must agree with the run as `build_ds_config` requires (same message)."""
    if args.zero.deepspeed_config:
        ds, source = read_ds_config(args.zero.deepspeed_config)
        _training(ds, args.training, dp, source)


def build_ds_config(args, dp: int) -> dict:
    """The DeepSpeed config dict of `args` (`args.zero`, `args.training`, `args.model` for
    ZeRO-3's tuned buckets: `ds_tuning`) at data-parallel size `dp`. Pure: no file is
    written and no collective is issued."""
    ds, source = read_ds_config(args.zero.deepspeed_config)
    ds.pop(SPARSE_SECTION, None)  # the model's (see the module doc)
    _zero_flags(ds, args.zero, source)
    fill_zero(ds["zero_optimization"], args.model)  # ZeRO-3's tuning where the JSON is silent
    _training(ds, args.training, dp, source)
    _grad_accumulation(ds, args.training)
    comm = getattr(getattr(args, "compression", None), "communication_data_type", None)
    merge_flags(ds, {} if comm is None else {COMM_KEY.field: comm}, [COMM_KEY], source)
    for key in ("optimizer", "scheduler"):
        if key in ds and not (key == "optimizer" and onebit_optimizer(ds)):
            raise ValueError(f"{source} has an \"{key}\" section: megazoo builds AdamW and the "
                             "learning-rate schedule from --lr, --weight-decay, --lr-* flags; "
                             f"remove \"{key}\" from the JSON")
    ds.setdefault("steps_per_print", 2 ** 31 - 1)  # megazoo logs; DeepSpeed stays quiet
    ds.setdefault("wall_clock_breakdown", False)
    return ds


def onebit_optimizer(ds: dict) -> str | None:
    """The "optimizer" section's type when it is one of DeepSpeed's 1-bit optimizers."""
    kind = (ds.get("optimizer") or {}).get("type")  # a string: `read_ds_config` checked
    return kind if kind and kind.lower() in ONEBIT_OPTIMIZERS else None


def training_fields(ds: dict, given: dict, dp: int | None, source: str,
                    default_micro: int) -> dict:
    """The TrainingConfig fields: the flags `given`, merged with the JSON `ds` over
    TRAINING_KEYS (`merge_flags`), then DeepSpeed's rule train_batch_size = micro x
    gradient_accumulation_steps x dp for whichever batch size neither states
    (`default_micro` stands in for a micro batch size nobody gave). `dp` None (the layout
    does not fit the world yet): nothing is derived; `build_ds_config` checks later."""
    out = {**given, **merge_flags(ds, given, TRAINING_KEYS, source)}
    gas = ds.get("gradient_accumulation_steps")
    if not _num(gas) or dp is None:
        return out
    if "global_batch_size" not in out:
        out["global_batch_size"] = int(out.get("micro_batch_size", default_micro)) * int(gas) * dp
    elif "micro_batch_size" not in out:
        out["micro_batch_size"] = max(1, int(out["global_batch_size"]) // (int(gas) * dp))
    return out


def warn_unused_sections(ds: dict, source: str, zero_impl: str) -> None:
    """One stderr line naming the ds_config sections an engine other than DeepSpeed ignores."""
    if not ds or zero_impl == "deepspeed" or os.environ.get("RANK", "0") != "0":
        return
    read = set(READ_BY_ALL)
    zo = ds.get("zero_optimization")
    if zero_impl == "none" and isinstance(zo, dict) and zo.get("stage", 0) == 0 and \
            set(zo) - {"stage"} <= {"offload_optimizer", "offload_param"}:
        read.add("zero_optimization")  # the plain engine's own offload (config/offload.py)
    unused = sorted(set(ds) - read)
    if unused:
        engine = "the plain engine" if zero_impl == "none" else f"--zero-impl {zero_impl}"
        print(f"warning: {source}: {engine} ignores {', '.join(unused)} (read only with "
              f"--deepspeed)", file=sys.stderr, flush=True)


def offload_device(ds: dict, key: str = "offload_optimizer") -> str:
    """"none", "cpu" or "nvme": where the config offloads the optimizer (or parameters)."""
    section = ds.get("zero_optimization", {}).get(key) or {}
    return section.get("device", "none") or "none"


def zero_stage(ds: dict) -> int:
    return int(ds.get("zero_optimization", {}).get("stage", 0))
