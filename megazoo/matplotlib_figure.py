"""matplotlib, an optional dependency, for every picture megazoo draws.

    figure = new_figure("the memory plan picture", figsize=(8, 4))
    ...; figure.savefig(path)

Figures are drawn off-screen on the Agg canvas, leaving matplotlib's global backend alone.
Without matplotlib the call raises a ValueError whose one line says what needed it and how
to install it (`pip install -e ".[plot]"`), which the command lines print as "error: ...".
"""
from __future__ import annotations

INSTALL = 'pip install -e ".[plot]" (or pip install matplotlib)'


def new_figure(what: str, **kwargs):
    """A matplotlib Figure on an Agg canvas (kwargs go to Figure); ValueError without
    matplotlib, naming `what` needed it."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ValueError(f"{what} needs matplotlib: {INSTALL}") from None
    figure = Figure(**kwargs)
    FigureCanvasAgg(figure)
    return figure
