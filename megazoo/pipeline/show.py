"""Draw a simulated pipeline schedule: one row per rank, time left to right.

    python -m megazoo.pipeline.show --pp 4 --vpp 2 --microbatches 8 --out sched.png

Forward blocks are blue, backward blocks red/orange; darker shades are later model
chunks (see the legend). Each block is labelled with its micro-batch number when it is
wide enough. The title gives the bubble and the peak activations held per rank. Needs matplotlib (optional dependency); it draws
off-screen with the Agg canvas and leaves matplotlib's global backend alone.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from megazoo.pipeline.schedules import (
    ActionKind,
    build_schedule,
    interleaved_schedule,
    one_f_one_b_schedule,
)
from megazoo.pipeline.simulate import SimulationResult, simulate

__all__ = ["draw_timeline", "main"]

_FORWARD_SHADES = ("#9ecae1", "#6baed6", "#4292c6", "#2171b5", "#08519c", "#08306b")
_BACKWARD_SHADES = ("#fdae6b", "#fd8d3c", "#f16913", "#d94801", "#a63603", "#7f2704")


def _import_matplotlib():
    """Return (Figure, FigureCanvasAgg, Patch), or raise ImportError saying what to do."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "drawing a pipeline schedule needs matplotlib, which is an optional "
            "dependency of megazoo; install it with `pip install matplotlib`"
        ) from error
    return Figure, FigureCanvasAgg, Patch


def _shade(shades: Sequence[str], chunk: int, vpp: int) -> str:
    """Colour of ``chunk`` out of ``vpp``: light for chunk 0, dark for the last."""
    if vpp == 1:
        return shades[2]
    return shades[round(chunk * (len(shades) - 1) / (vpp - 1))]


def draw_timeline(result: SimulationResult, out: str | Path, title: str) -> Path:
    """Write a PNG of ``result``'s per-rank timelines to ``out``; return the path."""
    Figure, FigureCanvasAgg, Patch = _import_matplotlib()
    pp = len(result.timelines)
    vpp = 1 + max((e.action.chunk for t in result.timelines for e in t), default=0)
    width = min(40.0, max(8.0, 0.35 * result.makespan))
    figure = Figure(figsize=(width, 1.4 + 0.5 * pp))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    inches_per_unit = 0.85 * width / result.makespan
    for rank, timeline in enumerate(result.timelines):
        for entry in timeline:
            action = entry.action
            forward = action.kind is ActionKind.F
            shades = _FORWARD_SHADES if forward else _BACKWARD_SHADES
            duration = entry.end - entry.start
            axes.barh(rank, duration, left=entry.start, height=0.8, edgecolor="white",
                      linewidth=0.5, color=_shade(shades, action.chunk, vpp))
            label = str(action.microbatch)
            if duration * inches_per_unit >= 0.07 * len(label) + 0.04:
                axes.text(entry.start + duration / 2, rank, label, ha="center",
                          va="center", fontsize=7, color="white" if action.chunk else "black")
    axes.set_yticks(range(pp), [f"rank {r}" for r in range(pp)])
    axes.set_ylim(pp - 0.5, -0.5)
    axes.set_xlim(0, result.makespan)
    axes.set_xlabel("time")
    handles = [Patch(color=_shade(_FORWARD_SHADES, c, vpp), label=f"F chunk {c}")
               for c in range(vpp)]
    handles += [Patch(color=_shade(_BACKWARD_SHADES, c, vpp), label=f"B chunk {c}")
                for c in range(vpp)]
    axes.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0),
                fontsize=8, frameon=False)
    axes.set_title(title, fontsize=10)
    figure.tight_layout()
    path = Path(out)
    figure.savefig(path, dpi=110)
    return path


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line flags."""
    parser = argparse.ArgumentParser(prog="python -m megazoo.pipeline.show",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=4, help="pipeline ranks")
    parser.add_argument("--vpp", type=int, default=1, help="model chunks per rank")
    parser.add_argument("--microbatches", type=int, default=8, help="micro-batches (m)")
    parser.add_argument("--schedule", choices=("1f1b", "interleaved"), default=None,
                        help="default: interleaved when vpp > 1, else 1f1b")
    parser.add_argument("--forward-time", type=float, default=1.0,
                        help="forward time per chunk per micro-batch")
    parser.add_argument("--backward-time", type=float, default=2.0,
                        help="backward time per chunk per micro-batch")
    parser.add_argument("--p2p-time", type=float, default=0.0, help="latency of one send")
    parser.add_argument("--out", default="sched.png", help="PNG file to write")
    args = parser.parse_args(argv)
    if args.schedule is None:
        args.schedule = "interleaved" if args.vpp > 1 else "1f1b"
    if args.schedule == "1f1b" and args.vpp != 1:
        parser.error(f"--schedule 1f1b runs one chunk per rank; drop --vpp {args.vpp} "
                     "or use --schedule interleaved")
    return args


def main(argv: Sequence[str] | None = None) -> Path:
    """Build, simulate and draw a schedule from command-line flags; return the PNG path."""
    args = _parse(argv)
    pp, vpp, m = args.pp, args.vpp, args.microbatches
    if args.schedule == "interleaved":
        schedule = interleaved_schedule(pp, vpp, m)
    elif pp > 1:
        schedule = one_f_one_b_schedule(pp, m)
    else:
        schedule = build_schedule(pp, vpp, m)
    result = simulate(schedule, args.forward_time, args.backward_time, args.p2p_time)
    title = (f"{args.schedule} pp={pp} vpp={vpp} m={m} (tf={args.forward_time:g}, "
             f"tb={args.backward_time:g}, p2p={args.p2p_time:g})\nmakespan "
             f"{result.makespan:g}, bubble {result.bubble_fraction:.1%} of makespan "
             f"= {result.bubble_ratio:.3f} x ideal; peak in flight per rank "
             f"{result.peak_inflight}")
    path = draw_timeline(result, args.out, title)
    print(f"wrote {path}: {title}")
    return path


if __name__ == "__main__":
    main()
