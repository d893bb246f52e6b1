"""The DeepSpeed config of a run: the user's JSON, the `--zero-*` flags and the training args.

    ds = build_ds_config(args, state)   # a dict for deepspeed.initialize(config=...)

Sources, merged key by key:
- `--deepspeed_config ds_config.json` (the file Megatron-DeepSpeed users already have);
- the ZeRO flags (`ZeroConfig`: `--zero-stage`, `--offload-optimizer`, `--offload-param`,
  `--nvme-path`): None means "not given", so the JSON's value (or DeepSpeed's default) holds;
- the training args (`TrainingConfig`: micro / global batch size, `--clip-grad`, `--bf16`,
  `--fp16`, loss-scale settings): these always have a value, because the data loader and the
  schedule are built from them before the engine exists.

A key the JSON sets to a value other than what the flags say is an error naming both
(`"auto"` in the JSON, as in Hugging Face's DeepSpeed integration, means "take the flag's").
Batch sizes are checked against each other and the data-parallel size: DeepSpeed's
`train_batch_size = micro * accumulation * dp`, where dp is our dp (not dp x sp: sp ranks see
pieces of the same sequences).

The JSON's `sparse_attention` section configures megazoo's own block-sparse attention (the
model's, `sparse_args.py`, in every engine) and is left out of the dict DeepSpeed gets:
DeepSpeed's sparse attention only ever served models built from its own SparseSelfAttention
modules, and DeepSpeed releases without it refuse a config holding the block
("DeepSpeed Sparse Attention has been removed"), which would stop every --deepspeed run of a
Megatron-DeepSpeed ds_config that has one. The file itself is never changed.
"""
from __future__ import annotations

import copy
import json
import math
import os

from .ds_schema import check_types

AUTO = "auto"
SPARSE_SECTION = "sparse_attention"  # megazoo's model reads it; DeepSpeed never gets it
# DeepSpeed's compressed-communication optimizers: their "optimizer" section passes through.
ONEBIT_OPTIMIZERS = ("onebitadam", "zerooneadam", "onebitlamb")


def load_ds_json(path: str) -> dict:
    """The JSON object in `path`; a clear error if it is missing, not a JSON object, or holds
    a value of the wrong type for its key (`ds_schema.check_types`)."""
    if not os.path.isfile(path):
        raise ValueError(f"--deepspeed_config {path}: no such file")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"--deepspeed_config {path} is not UTF-8 text (byte "
                         f"0x{raw[exc.start]:02x} at offset {exc.start}): save it as UTF-8 "
                         f"JSON") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"--deepspeed_config {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--deepspeed_config {path} must hold a JSON object, got {type(data).__name__}")
    check_types(data, f"--deepspeed_config {path}")
    return data


def _merge(ds: dict, keys: tuple[str, ...], value, flag: str, source: str) -> None:
    """Set ds[k0][k1]... = value unless the JSON already holds a different (non-auto) value."""
    node = ds
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ValueError(f"{source}: {'.'.join(keys[:-1])} must be a JSON object")
    old = node.get(keys[-1], AUTO)
    same_number = _num(old) and _num(value) and float(old) == float(value)
    if old != AUTO and old != value and not same_number:
        raise ValueError(f"{source} sets {'.'.join(keys)} = {old!r} but {flag} gives {value!r}: "
                         f"make them agree (change the flag or the JSON, or put \"auto\" in the JSON)")
    node[keys[-1]] = value


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _zero_flags(ds: dict, zero, source: str) -> None:
    if zero.zero_stage is not None:
        _merge(ds, ("zero_optimization", "stage"), zero.zero_stage, "--zero-stage", source)
    for key in ("offload_optimizer", "offload_param"):
        device = getattr(zero, key)
        if device is not None:
            _merge(ds, ("zero_optimization", key, "device"), device,
                   f"--{key.replace('_', '-')}", source)
    if zero.offload_optimizer_ratio is not None:
        _merge(ds, ("zero_optimization", "offload_optimizer", "ratio"), zero.offload_optimizer_ratio,
               "--offload-optimizer-ratio", source)
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
            if zero.nvme_path is not None:
                _merge(ds, ("zero_optimization", key, "nvme_path"), zero.nvme_path,
                       "--nvme-path", source)
            if not section.get("nvme_path"):
                raise ValueError(f"{key} to nvme needs a folder: pass --nvme-path DIR or set "
                                 f"zero_optimization.{key}.nvme_path in the JSON")


def _precision(ds: dict, training, source: str) -> None:
    _merge(ds, ("bf16", "enabled"), bool(training.bf16), "--bf16" if training.bf16 else
           "the absence of --bf16", source)
    _merge(ds, ("fp16", "enabled"), bool(training.fp16), "--fp16" if training.fp16 else
           "the absence of --fp16", source)
    if training.fp16:
        fp16 = ds["fp16"]
        fp16.setdefault("loss_scale", 0)  # dynamic
        fp16.setdefault("initial_scale_power", int(round(math.log2(training.initial_loss_scale))))
        fp16.setdefault("loss_scale_window", training.loss_scale_window)
        fp16.setdefault("min_loss_scale", training.min_loss_scale)


def _batches(ds: dict, training, dp: int, source: str) -> None:
    micro, glob = training.micro_batch_size, training.global_batch_size
    if glob % (micro * dp):
        raise ValueError(f"--global-batch-size {glob} must divide by --micro-batch-size {micro} "
                         f"x data-parallel size {dp}: change one of them")
    _merge(ds, ("train_micro_batch_size_per_gpu",), micro, f"--micro-batch-size {micro}", source)
    _merge(ds, ("train_batch_size",), glob, f"--global-batch-size {glob}", source)
    _merge(ds, ("gradient_accumulation_steps",), glob // (micro * dp),
           f"--global-batch-size {glob} / (--micro-batch-size {micro} x dp {dp})", source)


def _training_keys(ds: dict, training, dp: int, source: str) -> None:
    """Merge precision, clipping and batch sizes into `ds`: a JSON value other than the
    flags' is an error naming both (every engine's one check of these keys)."""
    _precision(ds, training, source)
    _merge(ds, ("gradient_clipping",), float(training.clip_grad), f"--clip-grad {training.clip_grad}",
           source)
    _batches(ds, training, dp, source)


def check_json_training_keys(args, dp: int) -> None:
    """For the engines other than DeepSpeed (plain, fsdp2), which read --deepspeed_config's
    batch sizes, clipping and precision but never build a DeepSpeed config: the JSON's
    values must agree with the flags exactly as `build_ds_config` requires for --deepspeed
    (the same check, the same message)."""
    path = args.zero.deepspeed_config
    if path:
        _training_keys(load_ds_json(path), args.training, dp, f"--deepspeed_config {path}")


def build_ds_config(args, dp: int) -> dict:
    """The DeepSpeed config dict of `args` (`args.zero`, `args.training`) at data-parallel
    size `dp`. Pure: no file is written and no collective is issued."""
    zero, training = args.zero, args.training
    source = "DeepSpeed config"
    ds: dict = {}
    if zero.deepspeed_config:
        ds = copy.deepcopy(load_ds_json(zero.deepspeed_config))
        ds.pop(SPARSE_SECTION, None)  # the model's (see the module doc)
        source = f"--deepspeed_config {zero.deepspeed_config}"
    _zero_flags(ds, zero, source)
    _training_keys(ds, training, dp, source)
    comm = getattr(getattr(args, "compression", None), "communication_data_type", None)
    if comm is not None:
        _merge(ds, ("communication_data_type",), comm, f"--communication-data-type {comm}", source)
    for key in ("optimizer", "scheduler"):
        if key == "optimizer" and onebit_optimizer(ds) is not None:
            continue
        if key in ds:
            raise ValueError(f"{source} has an \"{key}\" section: megazoo builds AdamW and the "
                             "learning-rate schedule from --lr, --weight-decay, --lr-* flags; "
                             f"remove \"{key}\" from the JSON")
    ds.setdefault("steps_per_print", 2 ** 31 - 1)  # megazoo logs; DeepSpeed stays quiet
    ds.setdefault("wall_clock_breakdown", False)
    return ds


def onebit_optimizer(ds: dict) -> str | None:
    """The "optimizer" section's type when it is one of DeepSpeed's 1-bit optimizers."""
    section = ds.get("optimizer")
    kind = section.get("type") if isinstance(section, dict) else None
    return kind if isinstance(kind, str) and kind.lower() in ONEBIT_OPTIMIZERS else None


def _lookup(ds: dict, keys: tuple[str, ...]):
    """ds[k0][k1]..., or AUTO where a key is absent."""
    node = ds
    for k in keys:
        node = node.get(k, AUTO) if isinstance(node, dict) else AUTO
    return node


JSON_TRAINING_KEYS = {"micro_batch_size": ("train_micro_batch_size_per_gpu",),
                      "global_batch_size": ("train_batch_size",),
                      "clip_grad": ("gradient_clipping",),
                      "bf16": ("bf16", "enabled"), "fp16": ("fp16", "enabled")}


def training_values_from_json(path: str) -> dict:
    """TrainingConfig fields a DeepSpeed JSON states ({"micro_batch_size": 4, ...}).

    For the argument parser: fill the training flags the user did not give from the JSON, so
    `--deepspeed_config ds.json` alone agrees with itself ("auto" and absent keys are left
    out). A flag given explicitly still wins and then must agree (`build_ds_config`)."""
    return _stated_training_values(load_ds_json(path))


def _stated_training_values(ds: dict) -> dict:
    return {field: value for field, keys in JSON_TRAINING_KEYS.items()
            if (value := _lookup(ds, keys)) != AUTO}


def training_defaults_from_json(path: str, given: dict, dp: int | None,
                                default_micro: int) -> dict:
    """The TrainingConfig fields missing from `given` (the flags on the command line) that the
    JSON at `path` determines: its own values, then DeepSpeed's rule
    train_batch_size = micro x gradient_accumulation_steps x dp for whichever of the micro
    and global batch sizes neither the flags nor the JSON set (`default_micro` stands in for
    a micro batch size nobody gave). `dp` None (the layout does not fit the world yet):
    nothing is derived from gradient_accumulation_steps; `build_ds_config` checks later."""
    ds = load_ds_json(path)
    stated = _stated_training_values(ds)
    out = {k: v for k, v in stated.items() if k not in given}
    gas = _lookup(ds, ("gradient_accumulation_steps",))
    if not _num(gas) or dp is None:
        return out
    known = {**stated, **given}
    if "global_batch_size" not in known:
        micro = known.get("micro_batch_size", default_micro)
        out["global_batch_size"] = int(micro) * int(gas) * dp
    elif "micro_batch_size" not in known:
        out["micro_batch_size"] = max(1, int(known["global_batch_size"]) // (int(gas) * dp))
    return out


def offload_device(ds: dict, key: str = "offload_optimizer") -> str:
    """"none", "cpu" or "nvme": where the config offloads the optimizer (or parameters)."""
    section = ds.get("zero_optimization", {}).get(key) or {}
    return section.get("device", "none") or "none"


def zero_stage(ds: dict) -> int:
    return int(ds.get("zero_optimization", {}).get("stage", 0))
