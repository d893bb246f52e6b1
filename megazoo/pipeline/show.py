"""Draw a simulated pipeline schedule: one row per rank, time left to right.

    python -m megazoo.pipeline.show --pp 4 --vpp 2 --microbatches 8 --out sched.png

Forward blocks are blue, backward blocks red/orange; darker shades are later model
chunks (see the legend). Each block is labelled with its micro-batch number when it is
wide enough. The title gives the bubble and the peak activations held per rank.

Times are per rank's whole share of the model: `--forward-time` is one micro-batch's forward
through all of a rank's layers, so with vpp chunks per rank one chunk takes forward-time / vpp
(the same for backward). The same flags then draw 1F1B and interleaved schedules of the same
model on the same time axis, and the shorter makespan is the interleaved schedule's gain.

Needs matplotlib (`pip install -e ".[plot]"`); without it, one "error: ..." line and exit
status 2. It draws off-screen on the Agg canvas.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from megazoo.pipeline.schedules import ActionKind, build_schedule, interleaved_schedule
from megazoo.pipeline.simulate import SimulationResult, simulate
from ..cli_parser import HintingParser
from ..errors import report_error
from ..matplotlib_figure import new_figure

_FORWARD_SHADES = ("#9ecae1", "#6baed6", "#4292c6", "#2171b5", "#08519c", "#08306b")
_BACKWARD_SHADES = ("#fdae6b", "#fd8d3c", "#f16913", "#d94801", "#a63603", "#7f2704")


def _shade(shades: Sequence[str], chunk: int, vpp: int) -> str:
    """Colour of ``chunk`` out of ``vpp``: light for chunk 0, dark for the last."""
    if vpp == 1:
        return shades[2]
    return shades[round(chunk * (len(shades) - 1) / (vpp - 1))]


def draw_timeline(result: SimulationResult, out: str | Path, title: str) -> Path:
    """Write a PNG of ``result``'s per-rank timelines to ``out``; return the path (ValueError
    without matplotlib)."""
    pp = len(result.timelines)
    vpp = 1 + max((e.action.chunk for t in result.timelines for e in t), default=0)
    width = min(40.0, max(8.0, 0.6 * result.makespan))  # inches per time unit: one scale
    figure = new_figure("drawing a pipeline schedule", figsize=(width, 1.4 + 0.5 * pp))
    from matplotlib.patches import Patch

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
    axes.set_xlabel("time (units of --forward-time: one micro-batch's forward through a "
                    "rank's layers)")
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
    parser = HintingParser(prog="python -m megazoo.pipeline.show",
                           description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=4, help="pipeline ranks (default: %(default)s)")
    parser.add_argument("--vpp", type=int, default=1, help="model chunks per rank (default: %(default)s)")
    parser.add_argument("--microbatches", type=int, default=8, help="micro-batches, m (default: %(default)s)")
    parser.add_argument("--schedule", choices=("1f1b", "interleaved"), default=None,
                        help="default: interleaved when vpp > 1, else 1f1b")
    parser.add_argument("--forward-time", type=float, default=1.0,
                        help="one micro-batch's forward through all of a rank's layers; a "
                        "chunk takes this / vpp (default: %(default)s)")
    parser.add_argument("--backward-time", type=float, default=2.0,
                        help="the same for backward (default: %(default)s)")
    parser.add_argument("--p2p-time", type=float, default=0.0,
                        help="latency of one send (default: %(default)s)")
    parser.add_argument("--out", default="sched.png", help="PNG file to write (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.schedule is None:
        args.schedule = "interleaved" if args.vpp > 1 else "1f1b"
    if args.schedule == "1f1b" and args.vpp != 1:
        parser.error(f"--schedule 1f1b runs one chunk per rank; drop --vpp {args.vpp} "
                     "or use --schedule interleaved")
    return args


def simulate_flags(args: argparse.Namespace) -> SimulationResult:
    """The simulated schedule the flags describe, each chunk taking 1/vpp of the rank's
    forward / backward time (so 1F1B and interleaved share one time axis)."""
    pp, vpp, m = args.pp, args.vpp, args.microbatches
    build = interleaved_schedule if args.schedule == "interleaved" else build_schedule
    return simulate(build(pp, vpp, m), args.forward_time / vpp, args.backward_time / vpp,
                    args.p2p_time)


def main(argv: Sequence[str] | None = None) -> Path:
    """Build, simulate and draw a schedule from command-line flags; return the PNG path."""
    args = _parse(argv)
    pp, vpp, m = args.pp, args.vpp, args.microbatches
    result = simulate_flags(args)
    title = (f"{args.schedule} pp={pp} vpp={vpp} m={m} (per rank tf={args.forward_time:g}, "
             f"tb={args.backward_time:g}; per chunk /{vpp}; p2p={args.p2p_time:g})\nmakespan "
             f"{result.makespan:g}, bubble {result.bubble_fraction:.1%} of makespan "
             f"= {result.bubble_ratio:.3f} x ideal; peak in flight per rank "
             f"{result.peak_inflight}")
    try:
        path = draw_timeline(result, args.out, title)
    except ValueError as exc:
        raise SystemExit(report_error(str(exc))) from None
    print(f"wrote {path}: {title}")
    return path


if __name__ == "__main__":
    main()
