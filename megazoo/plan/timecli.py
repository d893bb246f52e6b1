"""The planner's step-time side: `--cluster C` (predict one layout) and `--search`.

    python -m megazoo.plan --model bloom-176b --tp 4 --pp 12 --dp 8 --micro-batch-size 2 \
        --global-batch-size 2048 --seq-length 2048 --bf16 --use-distributed-optimizer \
        --recompute full --cluster jean-zay [--json] [--out step.png]
    python -m megazoo.plan --model bloom-176b --global-batch-size 2048 --seq-length 2048 \
        --bf16 --cluster a100-80gb --gpus 384 --search [--top 5] [--json]

`add_flags` adds --cluster, --search, --top, --gpus to the planner's parser; `run` answers
them (cli.py hands over when --cluster is given). Memory comes from the memory planner (the
most loaded pipeline stage, against the cluster's GPU memory), time from `timing.py`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json

from ..config.flags import args_from_namespace
from .clusters import load_cluster
from .layout import PlanOptions, resolve
from .memory import GB
from .published import megatron_deepspeed_gb, plan_args
from .search import LAYOUT_FLAGS, SEARCH_FLAGS, drop_flags, search
from .stages import stacked_bars, stage_estimates
from .timing import step_time

PARTS = ("compute", "tp_comm", "host", "bubble", "dp_comm", "optimizer")


def add_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("step time", "Predict step time on a cluster.")
    group.add_argument("--cluster", default=None, metavar="NAME|FILE.json",
                       help="Predict the step time on this cluster: h100-sxm, h200, a100-80gb, "
                            "jean-zay, selene, or a JSON file of the same fields "
                            "(megazoo/plan/clusters.py)")
    group.add_argument("--search", action="store_true",
                       help="With --cluster: rank every layout the run accepts for the model "
                            "and global batch on --gpus GPUs by predicted tokens/s")
    group.add_argument("--top", type=int, default=5, help="--search: how many to show")
    group.add_argument("--gpus", type=int, default=None,
                       help="--search: GPUs available (default: those of the given layout)")


def predict(ns) -> dict:
    """Everything about one layout on one cluster, as a JSON-ready dict."""
    cluster = load_cluster(ns.cluster)
    args, config, notes = plan_args(ns)
    layout = resolve(args, PlanOptions(gpu_memory=cluster.hbm_gb,
                                       gpus_per_node=cluster.gpus_per_node))
    memory = stage_estimates(config, layout)
    top = max(range(len(memory)), key=lambda r: memory[r].gpu_total)
    time = step_time(args, layout, cluster, config)
    extra = {}
    if notes:  # a layout only Megatron-DeepSpeed runs: its engine's memory too
        extra["gpu_memory_gb_megatron_deepspeed"] = megatron_deepspeed_gb(memory[top])
        notes.append(f"with Megatron-DeepSpeed's BF16 optimizer (a bf16 gradient per parameter "
                     f"kept beside the fp32 one): {extra['gpu_memory_gb_megatron_deepspeed']:.1f}"
                     " GB per GPU")
    return {"model": args.model_name or "the default model", "cluster": cluster.name,
            "layout": layout.name,
            **dataclasses.asdict(time), "gpu_memory_gb": memory[top].gpu_total / GB,
            "gpu_memory_stage": top, "memory": memory[top].to_dict(), **extra,
            "fits": all(m.fits for m in memory),  # the fp32 build too, as the notes say
            "notes": notes + time.notes + memory[top].notes}


def format_prediction(p: dict) -> str:
    lines = [f"{p['model']} {p['layout']} on {p['cluster']} ({p['gpus']} GPUs): step "
             f"{p['step_s']:.3f} s, {p['tokens_per_s']:,.0f} tokens/s, {p['tflops_per_gpu']:.1f} "
             f"model TFLOP/s per GPU ({p['tflops_per_gpu_megatron']:.1f} counted as Megatron-LM "
             f"does), {p['gpu_memory_gb']:.1f} GB on stage {p['gpu_memory_stage']} "
             f"({'fits' if p['fits'] else 'does NOT fit'})",
             "  stage  layers " + "".join(f"{k:>11}" for k in PARTS) + "   (seconds per step)"]
    for r, s in enumerate(p["stages"]):
        lines.append(f"  {r:5d}  {s['layers']:6d} " + "".join(f"{s[k]:11.3f}" for k in PARTS))
    return "\n".join(lines + [f"  note: {n}" for n in p["notes"]])


def draw(p: dict, out: str) -> str:
    """A stacked bar per stage of the step's parts; returns the line that says so."""
    title = (f"{p['model']} {p['layout']} on {p['cluster']}: {p['step_s']:.2f} s/step, "
             f"{p['tflops_per_gpu']:.0f} TFLOP/s per GPU")
    stacked_bars("the step-time picture", {k: [s[k] for s in p["stages"]] for k in PARTS},
                 "seconds per step", title, out)
    return f"wrote {out}: the step's parts per pipeline stage"


def run_search(ns, parser, argv: list[str]) -> dict:
    cluster = load_cluster(ns.cluster)
    args, config, _ = plan_args(ns)
    args = dataclasses.replace(args, model=config)
    gpus = ns.gpus or (args.parallel.tp * args.parallel.sp * args.parallel.cp
                       * args.parallel.pp * (args.parallel.dp or 1))
    base = drop_flags(argv, LAYOUT_FLAGS | SEARCH_FLAGS)  # the user's other flags

    def parse(flags: list[str]):  # strictly what the run accepts: no uneven pipeline split
        return args_from_namespace(parser.parse_args(flags))
    found, refused, too_big = search(parse, base, args.model.num_layers, gpus,
                                     args.training.global_batch_size, cluster)
    rows = [{"flags": " ".join(c.flags), "gpus": c.gpus, "step_s": c.time.step_s,
             "tokens_per_s": c.time.tokens_per_s, "tflops_per_gpu": c.time.tflops_per_gpu,
             "tflops_per_gpu_megatron": c.time.tflops_per_gpu_megatron,
             "gpu_memory_gb": c.gpu_memory_gb, "command": c.command(cluster.gpus_per_node)}
            for c in found[:ns.top]]
    result = {"cluster": cluster.name, "gpus": gpus, "fitting": len(found),
              "refused": refused, "too_big": len(too_big), "top": rows, "why": []}
    if not found:
        result["why"].append(_none_fit(too_big, refused, cluster))
    given_layout = {"--tp", "--tensor-model-parallel-size", "--pp", "--dp",
                    "--pipeline-model-parallel-size"} & {a.split("=")[0] for a in argv}
    if found and given_layout:  # compare with the layout the user gave
        given = predict(ns)
        result["given"] = {k: given[k] for k in ("layout", "gpus", "step_s", "tokens_per_s",
                                                 "tflops_per_gpu", "gpu_memory_gb", "fits")}
        result["why"] = explain(found[0], given, args)
    if found and max(c.gpus for c in found) < gpus:
        result["why"].append(
            f"no layout the run accepts uses all {gpus} GPUs: dp must divide global batch / "
            f"micro-batch ({args.training.global_batch_size}), pp the {args.model.num_layers} "
            f"layers, tp x sp the {args.model.num_attention_heads} heads")
    return result


def _none_fit(too_big: list, refused: int, cluster) -> str:
    """Why a search found nothing: the nearest layout and its memory, or the run's checks."""
    if too_big:
        gb, flags = too_big[0]
        return (f"nothing fits {cluster.hbm_gb:g} GB per GPU: the nearest, {' '.join(flags)}, "
                f"needs {gb:.1f} GB; more GPUs (--gpus), a smaller --micro-batch-size or "
                f"--recompute-granularity full make room")
    return (f"the run's checks refuse all {refused} layouts of these GPUs: the sizes must "
            f"divide the heads, the layers and the global batch; pass --gpus N or change them")


def _shares(stages: list[dict], step: float) -> dict:
    """Mean share of the step per part over the stages."""
    return {k: sum(s[k] for s in stages) / len(stages) / step for k in PARTS}


def explain(best, given: dict, args) -> list[str]:
    """Why the best layout is faster than the given one (or why the given one is best)."""
    ratio = best.time.tokens_per_s / given["tokens_per_s"]
    mine = _shares([dataclasses.asdict(s) for s in best.time.stages], best.time.step_s)
    theirs = _shares(given["stages"], given["step_s"])
    if ratio <= 1.0:
        return [f"the given layout {given['layout']} is the fastest that fits "
                f"({given['tokens_per_s']:,.0f} tokens/s)"]
    lines = [f"best is {ratio:.2f}x the given {given['layout']} ({given['tokens_per_s']:,.0f} "
             f"tokens/s on {given['gpus']} GPUs, {given['gpu_memory_gb']:.1f} GB); per GPU "
             f"{best.time.tflops_per_gpu:.1f} vs {given['tflops_per_gpu']:.1f} model TFLOP/s"]
    recompute = "--recompute" in best.flags and best.flags[best.flags.index("--recompute") + 1]
    if recompute != args.model.recompute:
        lines.append(f"recompute {recompute} instead of {args.model.recompute} (full reruns "
                     "each block's forward: about a third more compute)")
    for part in ("bubble", "tp_comm", "host", "dp_comm"):
        if abs(mine[part] - theirs[part]) > 0.01:
            lines.append(f"{part}: {mine[part]:.1%} of the step vs {theirs[part]:.1%}")
    return lines


def format_search(result: dict) -> str:
    lines = [f"{result['fitting']} layouts fit on {result['gpus']} GPUs of {result['cluster']} "
             f"({result['too_big']} too big, {result['refused']} refused by the run's checks):"]
    for i, r in enumerate(result["top"]):
        lines.append(f"{i + 1}. {r['tokens_per_s']:,.0f} tokens/s, {r['tflops_per_gpu']:.1f} "
                     f"TFLOP/s per GPU, {r['gpu_memory_gb']:.1f} GB, {r['gpus']} GPUs: "
                     f"{r['flags']}")
        lines.append(f"   {r['command']}")
    return "\n".join(lines + [f"why: {w}" for w in result["why"]])


def run(ns, parser, argv: list[str]) -> int:
    """Answer --cluster [--search]; print text or JSON."""
    if ns.search:
        result = run_search(ns, parser, argv)
        print(json.dumps(result, indent=2) if ns.json else format_search(result))
        return 0
    prediction = predict(ns)
    picture = draw(prediction, ns.out) if ns.out else None
    print(json.dumps(prediction, indent=2) if ns.json else format_prediction(prediction))
    if picture and not ns.json:
        print(picture)
    return 0
