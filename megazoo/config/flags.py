"""The `pretrain_gpt.py` command line, generated from the config dataclasses.

Every documented field becomes a flag: `train_iters` -> `--train-iters`, its docstring the
help text, its annotation the type (bool: a switch; list: several values); `ALIASES` adds the
Megatron-LM / Megatron-DeepSpeed spellings (the first is shown). Only flags given reach the
dataclasses, so their defaults (and a `--model` preset's shape) hold for the rest, after the
`--deepspeed_config` keys (`ds_config.merge_flags`). The result passes `validate.check_args`,
the checks `python -m megazoo.plan` applies too.

    args = parse_args(["--model", "gpt-125m", "--num-layers", "4", "--bf16"])
    args.model.num_layers, args.training.bf16        # 4, True
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import os
import textwrap
import typing

import torch.distributed as dist

from ..cli_parser import HintingParser
from .precision import FORMATS as FP8_FORMATS, RECIPES as FP8_RECIPES
from ..parallel.config import ParallelConfig
from .compression import ALGORITHMS, DTYPES as COMM_DTYPES, RECIPES, \
    CompressionConfig, resolve_compression
from .ds_config import read_ds_config, training_fields, warn_unused_sections
from .model import CHOICES as MODEL_CHOICES, ModelConfig, _default_ffn
from .presets import PRESETS
from .run import CheckpointConfig, DataConfig, LoggingConfig, PretrainArgs, TrainingConfig
from .sparse_attention import add_sparse_flags, sparse_section
from .validate import check_args
from .zero import ZeroConfig

# Field -> flags, where Megatron's names differ from `--field-name`.
ALIASES = {
    "tp": ["--tensor-model-parallel-size", "--tp"],
    "pp": ["--pipeline-model-parallel-size", "--pp"],
    "sp": ["--sequence-parallel-size", "--ds-sequence-parallel-size"],
    "cp": ["--context-parallel-size", "--cp"],
    "vpp": ["--virtual-pipeline-model-parallel-size"],
    "order": ["--parallel-order"],
    "megatron_sp": ["--sequence-parallel"],
    "recompute": ["--recompute-granularity", "--recompute"],
    "init_std": ["--init-method-std"],
    "deepspeed_config": ["--deepspeed_config", "--deepspeed-config"],
}
# Fields whose flag takes one of these values.
CHOICES = {"fp8_format": FP8_FORMATS, "fp8_recipe": FP8_RECIPES,
           "fp8_layers": MODEL_CHOICES["fp8_layers"], "gradient_compression": ALGORITHMS,
           "communication_data_type": tuple(COMM_DTYPES), "compression_recipe": tuple(RECIPES)}
# The ModelConfig fields a user may override on top of a preset (vocab comes from the data).
MODEL_FIELDS = ("family", "num_layers", "hidden_size", "num_attention_heads",
                "num_key_value_heads", "ffn_hidden_size", "max_position_embeddings",
                "make_vocab_size_divisible_by", "position_embedding", "norm", "activation",
                "rope_theta", "init_std", "hidden_dropout", "attention_dropout", "recompute",
                "recompute_num_layers", "attention_backend", "bias_gelu_fusion", "fp8_format",
                "fp8_recipe", "fp8_layers")
PARALLEL_FIELDS = ("tp", "sp", "cp", "pp", "vpp", "megatron_sp", "order")
# Group name in PretrainArgs -> (dataclass, fields exposed; None: all).
GROUPS = {
    "model": (ModelConfig, MODEL_FIELDS),
    "parallel": (ParallelConfig, PARALLEL_FIELDS),
    "training": (TrainingConfig, None),
    "data": (DataConfig, None),
    "checkpoint": (CheckpointConfig, None),
    "logging": (LoggingConfig, None),
    "zero": (ZeroConfig, None),
    "compression": (CompressionConfig, None),
}
# The model of the no-argument run: small enough to learn Python source on 2 CPU cores.
DEFAULT_MODEL = ModelConfig(family="gpt", num_layers=4, hidden_size=128, num_attention_heads=4,
                            max_position_embeddings=512)


def field_docs(cls) -> dict[str, str]:
    """The docstring under each field of dataclass `cls` (read from its source)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def _add_field(group, dest: str, name: str, hint, doc: str, default) -> None:
    flags = ALIASES.get(name, ["--" + name.replace("_", "-")])
    shown = f"{doc} (default: {_shown_default(default)})".replace("%", "%%")
    kwargs = dict(dest=dest, default=argparse.SUPPRESS, help=shown)
    args = typing.get_args(hint)
    base = next((a for a in args if a is not type(None)), hint) if args else hint
    if typing.get_origin(hint) is list or typing.get_origin(base) is list:
        kwargs.update(nargs="+", type=str, metavar="X")
    elif base is bool:
        kwargs["action"] = argparse.BooleanOptionalAction if default is True else "store_true"
    elif base is tuple or typing.get_origin(base) is tuple:
        kwargs["type"] = str
    else:
        kwargs["type"] = base
        if name in CHOICES:
            kwargs["choices"] = CHOICES[name]
        else:
            kwargs["metavar"] = name.upper()
    group.add_argument(*flags, **kwargs)


def _shown_default(value) -> str:
    """How --help shows a default: on / off, none, list items separated by spaces."""
    if value is None or value is dataclasses.MISSING:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return " ".join(str(v) for v in value)
    return str(value)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The full parser: one argument group per config dataclass (added to `parser` if given:
    the memory planner extends the run's own flags)."""
    parser = parser or HintingParser(
        prog="pretrain_gpt.py", description="Pre-train a GPT / BLOOM / LLaMA model "
        "(no flags: a small GPT on Python's standard library, on CPU, in minutes).")
    parser.add_argument("--model", dest="model_name", default=None, choices=sorted(PRESETS),
                        help="start from this preset's shape (flags below override fields)")
    parser.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int,
                        default=argparse.SUPPRESS, help="set by launchers; read from env")
    for group_name, (cls, names) in GROUPS.items():
        group = parser.add_argument_group(group_name, (cls.__doc__ or "").strip())
        hints, docs = typing.get_type_hints(cls), field_docs(cls)
        for f in dataclasses.fields(cls):
            if (names is None or f.name in names) and f.name in docs:
                # model fields: the no-flag run's model (a --model preset brings its own)
                default = getattr(DEFAULT_MODEL, f.name) if cls is ModelConfig else f.default
                _add_field(group, f"{group_name}__{f.name}", f.name, hints[f.name],
                           docs[f.name], default)
    add_sparse_flags(parser)
    return parser


def given_fields(ns: argparse.Namespace, group: str) -> dict:
    """{field: value} of the `group` fields ("model", "training", ...) given in `ns`: what the
    configs are built from, and what a caller that completes a command line (the planner)
    asks instead of argparse's names."""
    prefix = group + "__"
    return {k[len(prefix):]: v for k, v in vars(ns).items() if k.startswith(prefix)}


def set_fields(ns: argparse.Namespace, group: str, values: dict, *,
               keep_given: bool = True) -> None:
    """Set `group` fields of `ns` as if given on the command line; `keep_given`: only those
    not given already (defaults of a caller's own)."""
    for name, value in values.items():
        if not (keep_given and hasattr(ns, f"{group}__{name}")):
            setattr(ns, f"{group}__{name}", value)


def _model_config(ns: argparse.Namespace) -> ModelConfig:
    base = PRESETS[ns.model_name] if ns.model_name else DEFAULT_MODEL  # copied, never changed
    overrides = given_fields(ns, "model")
    if "family" in overrides and overrides["family"] != base.family:
        # A new family: its own defaults for the conventions, the preset's shape.
        keep = {k: getattr(base, k) for k in ("num_layers", "hidden_size", "num_attention_heads",
                                              "max_position_embeddings")}
        return ModelConfig(**{**keep, **overrides})
    # Derived fields follow the fields they derive from unless given (or set apart).
    if "num_key_value_heads" not in overrides and base.num_key_value_heads == base.num_attention_heads:
        overrides.setdefault("num_key_value_heads", None)
    if "ffn_hidden_size" not in overrides and \
            base.ffn_hidden_size == _default_ffn(base.hidden_size, base.activation):
        overrides["ffn_hidden_size"] = None
    return dataclasses.replace(base, **overrides)


def _data_parallel_size(par: dict) -> int | None:
    """dp of this launch (the world ParallelState.initialize will see); None if it does not fit."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else \
        int(os.environ.get("WORLD_SIZE", "1"))
    try:
        return ParallelConfig(**par).resolve(world).dp
    except ValueError:
        return None  # setup raises the layout error, with the world at hand


def args_from_namespace(ns: argparse.Namespace, check_data=None) -> PretrainArgs:
    """Dataclasses from parsed flags; raises ValueError saying which flag to change.
    `check_data(data_path, must_exist)`: the --data-path files' check, at its place in the
    order of checks (the training run passes `data.indexed.check_data_path`; config does no
    I/O itself)."""
    model = _model_config(ns)
    zero = ZeroConfig(**given_fields(ns, "zero"))
    ds, source = read_ds_config(zero.deepspeed_config)
    warn_unused_sections(ds, source, zero.zero_impl)
    sparse = sparse_section(ns, ds, source)
    if sparse is not None:
        model = dataclasses.replace(model, sparse_attention=sparse)
    compression = resolve_compression(given_fields(ns, "compression"), ds, source)
    par = given_fields(ns, "parallel")
    default_micro = TrainingConfig.__dataclass_fields__["micro_batch_size"].default
    training = TrainingConfig(**training_fields(ds, given_fields(ns, "training"), _data_parallel_size(par),
                                                source, default_micro))
    if training.num_layers_per_virtual_pipeline_stage is not None:
        per, pp = training.num_layers_per_virtual_pipeline_stage, par.get("pp", 1)
        if per < 1 or model.num_layers % (pp * per):
            raise ValueError(f"--num-layers {model.num_layers} must divide by "
                             f"--pipeline-model-parallel-size {pp} x "
                             f"--num-layers-per-virtual-pipeline-stage {per}")
        par["vpp"] = model.num_layers // (pp * per)
    data = given_fields(ns, "data")
    if data.get("data_path") and check_data is not None:  # before the tokenizer's checks
        check_data(data["data_path"], must_exist=data.get("tokenizer_type") is None)
    args = PretrainArgs(model=model, parallel=ParallelConfig(**par), training=training,
                        data=DataConfig(**data),
                        checkpoint=CheckpointConfig(**given_fields(ns, "checkpoint")),
                        logging=LoggingConfig(**given_fields(ns, "logging")),
                        zero=zero, compression=compression, model_name=ns.model_name)
    check_args(args)
    return args


def parse_args(argv: list[str] | None = None, check_data=None) -> PretrainArgs:
    """Parse a command line (argparse errors exit 2; bad values raise ValueError);
    `check_data` as in `args_from_namespace` (`megazoo.training.run.parse_run_args` passes
    the data files' check)."""
    return args_from_namespace(build_parser().parse_args(argv), check_data)
