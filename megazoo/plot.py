"""Training curves from `--log-json` files: one picture, several runs overlaid.

    python -m megazoo.plot RUN.jsonl [MORE.jsonl ...] --out curves.png [--labels a b]
    python -m megazoo.plot SAVE               # a --save folder: its metrics.jsonl, every segment

Panels (each drawn only when some run logged its key): training and validation loss against
tokens seen, learning rate, tokens/s, MFU, gradient norm, memory (GPU peak allocated, else
host RSS). Tokens seen are counted from the log itself: iteration x tokens per step, read from the
`{"tokens_per_step": N, ...}` record pretrain_gpt.py writes first; without one, the x axis is
the iteration. A run resumed from iteration N starts a new segment with a
`{"start_iteration": N, ...}` record; what an earlier segment logged after N (steps redone
after a kill) is replaced by the new segment's, so a resumed run draws as one. A --save folder
stands for the metrics.jsonl every training run keeps there, from which a run draws its
own curves when it ends (`draw_run_curves`). matplotlib is an optional dependency
(`pip install -e ".[plot]"`): without it the command says so in one line.
"""
from __future__ import annotations

import json
import os
import sys

from .cli_parser import HintingParser
from .errors import read_text, report_error
from .matplotlib_figure import INSTALL, new_figure

METRICS_FILE = "metrics.jsonl"  # what a training run keeps in its --save folder

PANELS = (  # (title, keys drawn in it, y scale)
    ("loss (nats/token)", ("loss", "valid_loss"), "linear"),
    ("learning rate", ("lr",), "linear"),
    ("tokens/s", ("tokens_per_s",), "linear"),
    ("MFU", ("mfu",), "linear"),
    ("gradient norm", ("grad_norm",), "log"),
    ("memory (GB)", ("gpu_max_allocated_gb", "host_rss_gb"), "linear"),
)


def read_log(path: str) -> tuple[list[dict], int | None]:
    """(records with an iteration, tokens per step or None) of one --log-json file or --save
    folder, later segments replacing what earlier ones logged past their start."""
    if os.path.isdir(path):  # a --save folder: its metrics.jsonl
        path = os.path.join(path, METRICS_FILE)
    records, tokens_per_step = [], None
    for n, line in enumerate(read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{path}:{n} is not a JSON line: is it a --log-json file?") from None
        if not isinstance(record, dict):
            continue
        if "tokens_per_step" in record:
            tokens_per_step = int(record["tokens_per_step"])
        if isinstance(record.get("start_iteration"), int):  # a segment starts: drop the redone
            records = [r for r in records if r["iteration"] <= record["start_iteration"]]
        if isinstance(record.get("iteration"), int):
            records.append(record)
    if not records:
        raise ValueError(f"{path} holds no logged iterations")
    return records, tokens_per_step


def series(records: list[dict], key: str, tokens_per_step: int | None) -> tuple[list, list]:
    """(x, y) of one key; x is tokens seen when known, else the iteration."""
    scale = tokens_per_step or 1
    points = [(r["iteration"] * scale, r[key]) for r in records
              if isinstance(r.get(key), (int, float))]
    return [p[0] for p in points], [p[1] for p in points]


def draw(runs: list[tuple[str, list[dict], int | None]], out: str) -> list[str]:
    """Write the picture to `out`; return the titles of the panels drawn."""
    panels = [p for p in PANELS
              if any(any(k in r for r in recs for k in p[1]) for _, recs, _ in runs)]
    if not panels:
        raise ValueError("the logs hold none of the plotted keys (loss, lr, tokens_per_s, ...)")
    cols = 2 if len(panels) > 1 else 1
    rows = (len(panels) + cols - 1) // cols
    fig = new_figure("plotting training curves", figsize=(6 * cols, 3.2 * rows),
                     layout="constrained")
    by_tokens = all(tps for _, _, tps in runs)
    for i, (title, keys, yscale) in enumerate(panels):
        ax = fig.add_subplot(rows, cols, i + 1)
        for j, (label, recs, tps) in enumerate(runs):
            color = f"C{j}"
            for key, style in zip(keys, ("-", "--")):
                x, y = series(recs, key, tps if by_tokens else None)
                if x:
                    ax.plot(x, y, style, color=color, marker="o" if len(x) < 3 else None,
                            label=f"{label} {key}" if len(keys) > 1 else label)
        ax.set_title(title)
        ax.set_yscale(yscale)
        ax.set_xlabel("tokens" if by_tokens else "iteration")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.savefig(out, dpi=110)
    return [p[0] for p in panels]


def draw_run_curves(run) -> None:
    """SAVE/curves.png from the whole run's SAVE/metrics.jsonl, every resumed segment included
    (`run`: what training.run.setup built; rank 0, with --save and --plot-curves). A missing
    matplotlib or a failed drawing is one line: the picture never fails the run."""
    a, say = run.args, run.logger.print
    metrics = run.logger.metrics_path
    if run.state.global_rank != 0 or not (metrics and a.logging.plot_curves) \
            or not run.logger.records:
        return
    out = os.path.join(a.checkpoint.save, "curves.png")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        say(f"no {out}: matplotlib is not installed: {INSTALL}")
        return
    try:
        draw([(os.path.basename(os.path.normpath(a.checkpoint.save)), *read_log(metrics))], out)
    except Exception as exc:  # a picture is a convenience, never a reason to fail a run
        say(f"no {out}: drawing the curves failed ({type(exc).__name__}: {exc})")
        return
    say(f"curves: {out} (the whole run; python -m megazoo.plot {a.checkpoint.save} draws it "
        f"again, and overlays runs)")


def main(argv=None) -> int:
    parser = HintingParser(prog="python -m megazoo.plot",
                           description="Plot training curves of --log-json files.")
    parser.add_argument("logs", nargs="+", help="--log-json files of pretrain_gpt.py runs, or "
                        "their --save folders (each keeps its metrics.jsonl)")
    parser.add_argument("--out", default="curves.png", help="picture to write (default: %(default)s)")
    parser.add_argument("--labels", nargs="+", help="legend names (default: the file names)")
    args = parser.parse_args(argv)
    labels = args.labels or [os.path.splitext(os.path.basename(os.path.normpath(p)))[0]
                             for p in args.logs]
    try:
        if len(labels) != len(args.logs):
            raise ValueError(f"--labels names {len(labels)} runs, {len(args.logs)} logs given")
        runs = [(label, *read_log(path)) for label, path in zip(labels, args.logs)]
        panels = draw(runs, args.out)
    except ValueError as exc:
        return report_error(str(exc))
    print(f"wrote {args.out}: {', '.join(panels)} for {len(runs)} run(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
