"""The memory plan per pipeline stage, and its picture (`python -m megazoo.plan ... --out`).

The planner's report is the most loaded rank. Stages differ: the first holds the embedding
and the most micro-batches in flight, the last the head, the final norm and the loss's logits,
the middle ones only their blocks. Per stage r:

- parameters: its blocks (num_layers / pp of them), plus the embedding on the first stage and
  the head and final norm on the last (`rank_parameters`); gradients, optimizer states and
  buffers follow from them as in the report (`_estimate`);
- activations: one block's bytes x the blocks of one chunk (num_layers / (pp vpp)) x the
  peak number of (chunk, micro-batch) activations the stage holds, read from the schedule the
  run executes, simulated (`megazoo.pipeline.simulate`: 1F1B holds min(pp - r, m) on stage r);
  plus full recompute's working block, the first stage's embedding side and the last stage's
  head side and logits (`stage_activations`).

For 1F1B and no pipeline, the most loaded stage is the report's total. Interleaved schedules
also keep (vpp - 1) pp + 1 chunk activations on the last stage, which the report's last-stage
term (one micro-batch) leaves out; this picture counts them.
"""
from __future__ import annotations

from ..config.model import ModelConfig
from ..matplotlib_figure import new_figure
from ..pipeline.schedules import build_schedule
from ..pipeline.simulate import simulate
from .activations import stage_activations
from .layout import Resolved
from .memory import MemoryEstimate, _estimate, rank_parameters
from .timing import stage_layers

# (legend label, MemoryEstimate field), stacked bottom to top.
PARTS = (("weights", "parameters"), ("gradients", "gradients"),
         ("optimizer states", "optimizer_states"), ("activations", "activations"),
         ("buffers + runtime", "communication_buffers"),
         ("allocator allowance (10%)", "fragmentation"))


def stage_estimates(config: ModelConfig, layout: Resolved) -> list[MemoryEstimate]:
    """The planner's estimate for each pipeline stage (first to last), blocks split over the
    stages as `stage_layers` splits them."""
    p, v = layout.pp, layout.vpp
    layers = stage_layers(config.num_layers, p, 1)
    params = rank_parameters(config, layout.tp, layers)
    act = stage_activations(config, layout)
    if p == 1:
        return [_estimate(config, layout, n_gpu=params[0], act=act["total"])]
    in_flight = simulate(build_schedule(p, v, layout.num_micro_batches)).peak_inflight
    chunk = config.num_layers // (p * v) * act["block"]
    stages = []
    for r in range(p):
        held = (chunk if v > 1 else layers[r] * act["block"]) * in_flight[r] + act["working"]
        if r == 0:
            held += act["embed_side"] * in_flight[r] / v
        if r == p - 1:
            held += act["head_side"] + act["logits"]
        stages.append(_estimate(config, layout, n_gpu=params[r], act=held))
    return stages


def stacked_bars(picture: str, series: dict[str, list[float]], ylabel: str, title: str,
                 out: str, limit: tuple[float, str] | None = None) -> None:
    """Write to `out` one stacked bar per pipeline stage, a segment per entry of `series`
    (label -> value of each stage), and `limit` (value, label) as a dashed line; ValueError
    naming the `picture` without matplotlib."""
    n = len(next(iter(series.values())))
    figure = new_figure(picture, figsize=(max(5.0, 1.1 * n + 3.5), 4.2), layout="constrained")
    axes = figure.add_subplot()
    bottom = [0.0] * n
    for i, (label, values) in enumerate(series.items()):
        axes.bar(range(n), values, bottom=bottom, width=0.6, label=label, color=f"C{i}")
        bottom = [b + v for b, v in zip(bottom, values)]
    top = max(bottom)
    if limit is not None:
        axes.axhline(limit[0], color="black", linestyle="--", linewidth=1)
        axes.text(n - 0.5, limit[0], f" {limit[1]}", va="bottom", ha="right", fontsize=8)
        top = max(top, limit[0])
    axes.set_xticks(range(n), [f"stage {r}" for r in range(n)])
    axes.set_ylabel(ylabel)
    axes.set_ylim(0, 1.15 * top)
    axes.set_title(title, fontsize=9)
    axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    figure.savefig(out, dpi=110)
