"""Figure conventions shared by every chapter: one colour per method across the whole book.

Use :func:`color` for a method's colour and :func:`new_figure` for a figure sized to read in the HTML
book. Sizes that double get log axes (:func:`log_axes`).
"""

from __future__ import annotations

import matplotlib.pyplot as plt

__all__ = ["BENCH_STYLES", "color", "bench_style", "new_figure", "log_axes", "legend_outside", "fixed_titles", "png_bytes"]

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


# The benchmarks' methods (chapters 07-10): each its own colour and marker, the same in every figure, so that ten
# series stay apart in print and for colour-blind readers. Ours are the warm colours, libraries the cool ones.
BENCH_STYLES = {  # method (as perf.bench names it) -> (label, colour, marker, line style)
    "triton": ("LA-2 fast (ours, the backend)", METHOD_COLORS["triton"], "o", "-"),
    "triton_user": ("LA-2 fast, called as a model calls it", "#BB5566", ">", "--"),
    "triton_pointers": ("LA-2 fast, tiles by pointer (no TMA)", "#994455", "d", "--"),
    "triton.la2_fast.one_segment": ("LA-2 fast without segments", "#EE7733", "s", ":"),
    "triton.la2_fast.no_state_reuse": ("LA-2 fast, backward without the saved states", "#CC3311", "p", ":"),
    "triton.la2_fast.fused_dkdv": ("LA-2 fast, fused dK/dV backward", "#EE3377", "<", ":"),
    "triton.la3": ("LA-3 backward (ours, chapter 09)", METHOD_COLORS["la3"], "v", "-"),
    "triton.la2_literal": ("LA-2 literal (Algorithms 1-2)", "#CC79A7", "^", "-"),
    "triton.la1": ("LA-1 (tiled left product)", METHOD_COLORS["left"], "D", "-"),
    "torch": ("torch backend (chapter 06)", "#AA4499", "P", ":"),
    "sdpa_flash": ("softmax, SDPA flash", METHOD_COLORS["softmax"], "x", "-"),
    "sdpa_cudnn": ("softmax, SDPA cuDNN", "#666666", "+", "--"),
    "fla_chunk": ("fla chunk_simple_gla", "#0072B2", "*", "-"),
    "fla_fused_chunk": ("fla fused_chunk_simple_gla", "#56B4E9", "X", "--"),
    "original": ("original lightning_attn_func", METHOD_COLORS["recurrent"], "h", "-"),
}


def bench_style(method: str) -> dict:
    """``ax.plot`` keywords (label, color, marker, linestyle) of a benchmarked method, named as ``benchmarks.bench``
    names it now or as an older recording did (``la2_literal`` for ``triton.la2_literal``); KeyError names the
    known ones."""
    from . import RECORDED_NAMES

    try:
        label, colour, marker, ls = BENCH_STYLES[RECORDED_NAMES.get(method, method)]
    except KeyError:
        raise KeyError(f"no style for method {method!r}; known: {sorted(BENCH_STYLES)}") from None
    return dict(label=label, color=colour, marker=marker, linestyle=ls)


def legend_outside(fig, ax, ncols: int = 3, fontsize: int = 8):
    """One legend for the whole figure, below the panels (never over the data), from ``ax``'s labelled lines."""
    handles, labels = ax.get_legend_handles_labels()
    return fig.legend(handles, labels, loc="outside lower center", ncols=ncols, fontsize=fontsize, frameon=False)


def fixed_titles(fig) -> None:
    """Every panel's title at the place matplotlib's automatic placement gives it when nothing is drawn above
    the panel (y = 1, the default pad), fixed there. The automatic placement measures the panel's tick labels at
    each draw to keep clear of any above it; for the widgets' figures, which have none above, that search was
    about a third of a redraw."""
    for ax in fig.axes:
        if ax.get_title():
            ax.set_title(ax.get_title(), y=1.0)


def png_bytes(fig) -> bytes:
    """``fig`` as PNG bytes at 100 dpi, drawn once: what the widgets show. (IPython's display of a Figure draws it
    twice, once to find a tight bounding box; the widgets' figures have a fixed layout that fits already.)"""
    import io

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)  # 9-point legends read at about 12 px
    return buffer.getvalue()


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
