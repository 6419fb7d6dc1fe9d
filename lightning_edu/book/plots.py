"""Figure conventions shared by every chapter: one colour per method across the whole book.

Use :func:`color` for a method's colour and :func:`new_figure` for a figure sized to read in the HTML
book. Sizes that double get log axes (:func:`log_axes`).
"""

from __future__ import annotations

import matplotlib.pyplot as plt

__all__ = ["METHOD_COLORS", "color", "new_figure", "log_axes"]

# The same method keeps its colour in every chapter (Okabe-Ito palette: readable for colour-blind readers).
METHOD_COLORS = {
    "softmax": "#000000",
    "left": "#E69F00",  # (Q K^T) V, masked quadratic
    "masked": "#E69F00",
    "right": "#56B4E9",  # Q (K^T V)
    "recurrent": "#009E73",
    "cumsum": "#CC79A7",
    "blockwise": "#0072B2",
    "chunked": "#0072B2",
    "loop": "#56B4E9",
    "triton": "#D55E00",
    "fla": "#999999",
    "original": "#F0E442",
    "intra": "#E69F00",
    "inter": "#56B4E9",
    "floor": "#666666",
    "state": "#009E73",  # updating the carried KV state (the recurrence's colour: it is what the recurrence carries)
    "paper_literal": "#CC79A7",  # a printed formula run literally (chapter 04: lambda^B Lambda^-1)
    "la3": "#882255",  # the recompute-heavy backward of chapter 09
    "kahan": "#117733",  # a compensated float32 state (chapter 10)
    "float64": "#332288",
}


def color(method: str) -> str:
    """The book-wide colour of a method (KeyError names the known methods)."""
    try:
        return METHOD_COLORS[method]
    except KeyError:
        raise KeyError(f"no colour for method {method!r}; known: {sorted(METHOD_COLORS)}") from None


def new_figure(ncols: int = 1, nrows: int = 1, width: float = 6.4, height: float = 4.0):
    """A figure of ``ncols x nrows`` panels, each about ``width x height`` inches."""
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), constrained_layout=True, squeeze=False)
    return fig, (axes[0, 0] if ncols * nrows == 1 else axes)


def log_axes(ax, x: bool = True, y: bool = True, base: int = 2):
    """Log scales where sizes double; x in powers of ``base``."""
    if x:
        ax.set_xscale("log", base=base)
    if y:
        ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    return ax
