"""`python -m megazoo.plan [pretrain_gpt.py flags] [--dp N] [--gpu-memory GB] [--json] [--out PNG]`.

The parser is `pretrain_gpt.py`'s own (`megazoo.config.flags.build_parser`), extended
with the planner's few flags; the parsed flags become the run's `PretrainArgs` through the
run's own `args_from_namespace` (and its checks). Every error is one line and exit status 2,
with a "did you mean" for a misspelt flag or preset (`HintingParser`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing

from ..cli_parser import HintingParser
from ..errors import report_error
from ..config.flags import (args_from_namespace, build_parser, field_docs, given_fields,
                            set_fields)
from ..config.presets import PRESETS
from ..config.run import PretrainArgs
from .command import launch_command
from .largest import LARGEST_DEFAULTS, describe, family_shapes, search
from .layout import PlanOptions, Resolved, corpus_vocab, resolve
from .memory import GB, RUNTIME_BYTES, MemoryEstimate, _estimate
from . import timecli
from .stages import PARTS, stacked_bars, stage_estimates


def plan_parser() -> argparse.ArgumentParser:
    """pretrain_gpt.py's flags plus the planner's (`--dp`, PlanOptions' fields, `--json`)."""
    parser = build_parser(HintingParser(
        prog="python -m megazoo.plan",
        description="Predict the GPU and host memory of a pretrain_gpt.py run: pass the run's "
                    "flags, plus the data-parallel size to plan for."))
    group = parser.add_argument_group("planner", "What only the planner needs.")
    group.add_argument("--dp", dest="parallel__dp", type=int, default=argparse.SUPPRESS,
                       metavar="DP", help="Data-parallel size (GPUs = tp * sp * pp * dp); "
                       "a launched run takes it from its world size. Default 1.")
    docs, hints = field_docs(PlanOptions), typing.get_type_hints(PlanOptions)
    for f in dataclasses.fields(PlanOptions):
        flag = "--" + f.name.replace("_", "-")
        kwargs = dict(dest="plan__" + f.name, help=docs[f.name])
        if hints[f.name] is bool:
            group.add_argument(flag, action="store_true", **kwargs)
        else:
            group.add_argument(flag, type=hints[f.name], default=f.default,
                               metavar=f.name.upper(), **kwargs)
    group.add_argument("--largest", action="store_true",
                       help="Find the largest model of --model-family whose plan fits "
                       "--gpu-memory, --host-memory and --disk-memory with the layout flags "
                       "given, and print the pretrain_gpt.py command that trains it.")
    group.add_argument("--model-family", choices=("llama", "gpt"), default="llama",
                       help="With --largest: the family of shapes searched (default llama).")
    group.add_argument("--json", action="store_true", help="Print JSON instead of a table.")
    group.add_argument("--out", metavar="PNG", default=None,
                       help="Also draw the plan: a stacked bar per pipeline stage (weights, "
                       "gradients, optimizer, activations, buffers) against --gpu-memory; "
                       "needs matplotlib. Default: no picture. With --cluster: the step's "
                       "parts per stage instead.")
    timecli.add_flags(parser)
    return parser


def format_table(name: str, layout: Resolved, est: MemoryEstimate) -> str:
    """A human-readable report."""
    rows = [("parameters", est.parameters), ("gradients", est.gradients),
            ("optimizer states", est.optimizer_states), ("activations", est.activations),
            ("communication buffers + runtime", est.communication_buffers),
            ("fragmentation allowance (10%)", est.fragmentation), ("GPU total", est.gpu_total)]
    lines = [f"{name}: {est.num_parameters:,} parameters; layout {layout.name} "
             f"({layout.world_size} GPUs), "
             f"{_engine(layout)}, recompute={layout.recompute}, micro-batch "
             f"{layout.micro_batch_size} x {layout.seq_length} tokens, "
             f"{layout.num_micro_batches} per step",
             f"  parameters per GPU before ZeRO: {est.parameters_per_gpu:,}"]
    lines += [f"  {label:<34}{value / GB:10.2f} GB" for label, value in rows]
    lines.append(f"  {'peak allocated, model build':<34}{est.build_peak / GB:10.2f} GB"
                 f" (training: {est.allocated / GB:.2f} GB)")
    lines.append(f"  {'host memory per GPU / per node':<34}{est.host_per_gpu / GB:10.2f} GB"
                 f" / {est.host_per_node / GB:.1f} GB")
    if est.disk_per_gpu:
        lines.append(f"  {'disk (--nvme-path) per GPU / node':<34}{est.disk_per_gpu / GB:10.2f}"
                     f" GB / {est.disk_per_node / GB:.1f} GB")
    opts = layout.options
    budgets = {"gpu": f"{opts.gpu_memory:g} GB per GPU", "host": f"{opts.host_memory:g} GB "
               "of host memory", "disk": f"{opts.disk_memory:g} GB of disk"}
    for key, ok in est.verdicts.items():
        lines.append(f"  => {'fits' if ok else 'does NOT fit'} in {budgets[key]}")
    lines += [f"  note: {n}" for n in est.notes]
    return "\n".join(lines)


def _engine(layout) -> str:
    """The engine and its offload, as the table's header says it."""
    if layout.plain_engine:
        off = layout.optimizer_offload
        where = "host, what does not fit on disk" if off.disk else "host"
        return "megazoo engine" + (f", {off.ratio:.0%} of the optimizer on the {where}"
                                   if off.on else "")
    return (f"{layout.zero_impl} ZeRO-{layout.zero_stage}, offload optimizer="
            f"{layout.optimizer_offload.device} param={layout.offload_param}")


def main(argv: list[str] | None = None) -> int:
    """Plan the run the flags describe; 0, or one "error: ..." line and 2."""
    parser = plan_parser()
    ns = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    given = {k[len("plan__"):]: v for k, v in vars(ns).items() if k.startswith("plan__")}
    try:
        if ns.search and not ns.cluster:
            raise ValueError("--search needs --cluster NAME (the GPUs and links to rank on)")
        if ns.cluster:
            return timecli.run(ns, parser, argv)
        _default_sequence(ns)
        options = PlanOptions(**given)
        if ns.largest:
            return _largest(ns, options, argv)
        args = _default_corpus_vocab(args_from_namespace(ns))  # the run's configs and checks
        layout = resolve(args, options)
        est = _estimate(args.model, layout)
        est.notes.extend(budget_notes(args, options))
        name = args.model_name or "the default model"
        if ns.out:
            picture = _draw(name, args, layout, ns.out)
    except (ValueError, OSError) as exc:  # a layout that cannot be: say what, no traceback
        return report_error(str(exc))
    if ns.json:
        print(json.dumps({"model": name, "layout": dataclasses.asdict(layout),
                          "args": args.to_dict(), **est.to_dict()}, indent=2))
    else:
        print(format_table(name, layout, est))
        if ns.out:
            print(picture)
    return 0


def budget_notes(args: PretrainArgs, options: PlanOptions) -> list[str]:
    """Lines for what the plan takes without saying: a --disk-memory it cannot use (nothing
    goes to disk without the plain engine's offload and its --nvme-path), and the default
    corpus's vocabulary it sized the embedding and head by."""
    t, notes = args.training, []
    if options.disk_memory and not (t.optimizer_cpu_offload and args.zero.nvme_path):
        need = " --optimizer-cpu-offload" if not t.optimizer_cpu_offload else ""
        notes.append(f"--disk-memory {options.disk_memory:g} is not used: the plan puts "
                     f"optimizer state on disk only with{need} --nvme-path DIR")
    if corpus_vocab(args) is not None:
        notes.append(f"vocabulary {corpus_vocab(args):,}: the default corpus's tokenizer, "
                     "what pretrain_gpt.py trains on without --data-path (with it, your "
                     "tokenizer's)")
    return notes


def _default_corpus_vocab(args: PretrainArgs) -> PretrainArgs:
    """Plan the vocabulary the run trains with (`layout.corpus_vocab`), not the model
    config's placeholder."""
    vocab = corpus_vocab(args)
    if vocab is not None:
        args.model = dataclasses.replace(args.model, vocab_size=vocab)
    return args


def _draw(name: str, args: PretrainArgs, layout, out: str) -> str:
    """Write the per-stage picture to `out`; return the line that says so."""
    stages = stage_estimates(args.model, layout)
    top = max(range(len(stages)), key=lambda r: stages[r].gpu_total)
    title = (f"{name}: {layout.name}, "
             f"{'megazoo engine' if layout.plain_engine else layout.zero_impl} ZeRO-"
             f"{layout.zero_stage}, micro-batch "
             f"{layout.micro_batch_size} x {layout.seq_length}, recompute {layout.recompute}")
    gpu = layout.options.gpu_memory
    series = {label: [getattr(e, field) / GB for e in stages] for label, field in PARTS}
    stacked_bars("the memory plan picture", series, "GB per GPU", title, out,
                 limit=(gpu, f"GPU {gpu:g} GB"))
    return (f"wrote {out}: one bar per pipeline stage; stage {top} is the most loaded at "
            f"{stages[top].gpu_total / GB:.2f} GB")


def _default_sequence(ns) -> None:
    """A --model preset's sequence length (its positions) when --seq-length is not given,
    instead of the small default run's 128; with --largest also its other defaults."""
    if ns.largest:
        for group, values in LARGEST_DEFAULTS.items():
            set_fields(ns, group, values)
        # the run's checks see the family's smallest shape (the search replaces it)
        first = family_shapes(ns.model_family, given_fields(ns, "data")["seq_length"])[0]
        ns.model_name = None
        set_fields(ns, "model", {name: getattr(first, name) for name in (
            "family", "num_layers", "hidden_size", "num_attention_heads",
            "num_key_value_heads", "ffn_hidden_size", "max_position_embeddings")},
            keep_given=False)
    if ns.model_name:
        set_fields(ns, "data", {"seq_length": PRESETS[ns.model_name].max_position_embeddings})


def _largest(ns, options: PlanOptions, argv: list[str]) -> int:
    """--largest: search the family, print the answer and its command (0), or why none fits (2)."""
    training = given_fields(ns, "training")
    set_fields(ns, "training", {"global_batch_size": training["micro_batch_size"]
                                * given_fields(ns, "parallel").get("dp", 1)})
    args = args_from_namespace(ns)
    pick = args.training.optimizer_cpu_offload and "optimizer_offload_fraction" not in training
    best, following = search(args, options, ns.model_family, pick)
    if best is None:
        return report_error(f"no {ns.model_family} shape fits; the smallest: "
                            f"{describe(following[0], following[1], options)}")
    config, est, run_args = best
    command = launch_command(run_args)
    if ns.json:
        print(json.dumps({"model": dataclasses.asdict(config), "command": command,
                          "next_larger": following and dataclasses.asdict(following[0]),
                          **est.to_dict()}, indent=2))
        return 0
    print(f"largest that trains here: {describe(config, est, options)}")
    if following:
        print(f"next larger: {describe(following[0], following[1], options)}")
    for note in budget_notes(args, options):  # (the answer first, then what it assumed)
        print(f"note: {note}")
    if est.build_peak + RUNTIME_BYTES > est.gpu_total:  # the fp32 build sets the limit
        alone, _ = search(args, options, ns.model_family, pick, with_build=False)
        if alone is not None and alone[1].num_parameters > est.num_parameters:
            print(f"the model's fp32 build on the GPU sets this limit; training alone would "
                  f"fit {describe(alone[0], alone[1], options).split(':')[0]}")
    print(format_table(f"{config.family} L{config.num_layers} h{config.hidden_size}",
                       resolve(run_args, options), est))
    print(f"command:\n  {command}")
    return 0
