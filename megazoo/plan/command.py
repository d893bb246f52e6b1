"""The pretrain_gpt.py command of a planned run, built from its parsed config (`PretrainArgs`),
never from the planner's command line: every field that differs from its default becomes its
flag (`config.flags`' names), so the planner's own flags (--gpu-memory, --host-memory, --dp,
...) never reach it and the command runs as pasted. The key/value heads are the one field
compared with the model itself: derived from the heads (MHA) they get no flag, set apart
(GQA) they always do.

    run_argv(args)         # ["--model", "gpt-1.3b", "--bf16", ...]
    launch_command(args)   # "torchrun --nproc-per-node 8 pretrain_gpt.py ..."
"""
from __future__ import annotations

import dataclasses
import json
import shlex

from ..config.flags import ALIASES, DEFAULT_MODEL, GROUPS, field_docs
from ..config.presets import PRESETS
from ..config.run import PretrainArgs
from ..config.sparse_attention import CONFIG_FLAG


def _flag(name: str, value, default) -> list[str]:
    """The words that set field `name` to `value` (its default `default`)."""
    flag = ALIASES.get(name, ["--" + name.replace("_", "-")])[0]
    if isinstance(value, bool):
        return [flag] if value else ["--no-" + flag[2:]] if default is True else []
    if value is None:
        return [flag, ""]
    if isinstance(value, (list, tuple)):
        return [flag, *(str(v) for v in value)]
    return [flag, repr(value) if isinstance(value, float) else str(value)]


def _group_argv(group: str, config, base, skip: tuple[str, ...] = ()) -> list[str]:
    """Flags of one config group: its exposed fields (but `skip`) that differ from `base`'s."""
    cls, names = GROUPS[group]
    docs, out = field_docs(cls), []
    for f in dataclasses.fields(cls):
        if (names is None or f.name in names) and f.name in docs and f.name not in skip:
            value = getattr(config, f.name)
            default = getattr(base, f.name) if base is not None else f.default
            if value != default and default is not dataclasses.MISSING:
                out += _flag(f.name, value, default)
    return out


def run_argv(args: PretrainArgs) -> list[str]:
    """pretrain_gpt.py's arguments that parse back to `args` (a preset by name, the model
    fields that differ from it, and every other field that differs from its default)."""
    argv = ["--model", args.model_name] if args.model_name else []
    base = PRESETS[args.model_name] if args.model_name else DEFAULT_MODEL
    model, kv = args.model, "num_key_value_heads"  # judged against the model's own heads
    argv += _group_argv("model", model, base, skip=(kv,))
    if model.num_key_value_heads != model.num_attention_heads:  # set apart: GQA / MQA
        argv += _flag(kv, model.num_key_value_heads, None)
    parallel = args.parallel
    if args.training.num_layers_per_virtual_pipeline_stage is not None:  # it sets vpp
        parallel = dataclasses.replace(parallel, vpp=1)
    argv += _group_argv("parallel", parallel, None)
    for group in ("training", "data", "checkpoint", "logging", "zero", "compression"):
        argv += _group_argv(group, getattr(args, group), None)
    if model.sparse_attention is not None:
        argv += [CONFIG_FLAG, json.dumps(dict(model.sparse_attention), sort_keys=True)]
    return argv


def launch_command(args: PretrainArgs, per_node: int | None = None) -> str:
    """The shell line that launches the run: python for one GPU, else torchrun over the
    layout's GPUs (nodes of `per_node` GPUs where given and exceeded)."""
    par = args.parallel
    world = par.tp * par.sp * par.cp * par.pp * (par.dp or 1)
    if world == 1:
        launch = ["python"]
    elif per_node and world > per_node:
        launch = ["torchrun", "--nnodes", world // per_node, "--nproc-per-node", per_node]
    else:
        launch = ["torchrun", "--nproc-per-node", world]
    words = launch + ["pretrain_gpt.py"] + run_argv(args)
    return " ".join(shlex.quote(str(x)) for x in words)
