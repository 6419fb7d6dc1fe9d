"""Chapter 03's view of the decay lambda: the mask M as an image and the weight profile lambda^(t-s).

:func:`render_decay_view` draws the view for one lambda (the static figure of the rendered book);
:func:`decay_explorer` wraps the same drawing in an ipywidgets slider for readers running the notebook.
"""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

from ..numpy_reference import decay_mask
from ..validation import validate_decay, validate_positive_int
from .plots import color, fixed_titles, png_bytes
from .widgets import live_box

__all__ = ["DECAY_CHOICES", "effective_context", "render_decay_view", "decay_explorer"]

# Horizons 1/(1-lambda) that double from 2 to 256 tokens, then lambda = 1 (no decay, chapter 02), and the
# 0.05 the tests use for "almost only the diagonal".
DECAY_CHOICES = (0.05, 0.5, 0.75, 0.875, 0.9375, 0.96875, 0.984375, 0.9921875, 0.99609375, 1.0)


def effective_context(decay) -> np.ndarray | float:
    """The horizon 1/(1-lambda): the total weight sum_{j>=0} lambda^j of all tokens, inf for lambda = 1. (Chapter 03.)

    Accepts one lambda (returns a float) or one per head (returns an array of shape (heads,)).
    """
    lam = validate_decay(decay, None)
    with np.errstate(divide="ignore"):
        horizon = np.where(lam < 1.0, 1.0 / np.where(lam < 1.0, 1.0 - lam, 1.0), np.inf)
    return float(horizon[0]) if np.ndim(decay) == 0 else horizon


def _draw(fig: Figure, decay: float, n: int) -> None:
    lam = float(validate_decay(decay, None)[0])
    mask = decay_mask(n, lam)
    # a fixed layout: a constrained one measures every label at each draw, most of a redraw's time
    ax_mask, ax_profile = fig.subplots(1, 2, gridspec_kw=dict(left=0.055, right=0.985, bottom=0.13, top=0.91,
                                                              wspace=0.22))
    image = ax_mask.imshow(mask, cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
    ax_mask.set_title(f"M for lambda = {lam:g}  (n = {n})")
    ax_mask.set_xlabel("key position s")
    ax_mask.set_ylabel("query position t")
    fig.colorbar(image, ax=ax_mask, label="weight lambda^(t-s)")

    distance = np.arange(n)
    ax_profile.bar(distance, mask[n - 1, ::-1], width=1.0, color=color("recurrent"), label="lambda^(t-s)")
    horizon = effective_context(lam)
    if np.isfinite(horizon) and horizon <= n:
        ax_profile.axvline(horizon, color=color("floor"), linestyle="--", label=f"1/(1-lambda) = {horizon:.3g}")
    ax_profile.set_ylim(0.0, 1.05)
    ax_profile.set_xlim(-0.5, n - 0.5)
    ax_profile.set_title("weight of the token t-s steps back (last row of M)")
    ax_profile.set_xlabel("distance t - s (tokens)")
    ax_profile.set_ylabel("weight")
    ax_profile.legend(loc="upper right")
    fixed_titles(fig)


def render_decay_view(decay: float = 0.9, n: int = 32) -> Figure:
    """The decay view for one lambda: M (n x n) as an image, and the last row of M against the distance t - s.

    Returns a matplotlib Figure (not managed by pyplot: display it, or it is not shown). Its first axes hold
    one image whose data is ``decay_mask(n, decay)``. (Chapter 03.)
    """
    n = validate_positive_int("n", n)
    fig = Figure(figsize=(11.0, 4.2))
    _draw(fig, decay, int(n))
    return fig


def decay_explorer(n: int = 32, decay: float = 0.875, choices=DECAY_CHOICES):
    """A slider over ``choices`` of lambda that redraws :func:`render_decay_view` when released. (Chapter 03.)

    Returns an ipywidgets VBox with extra attributes: ``slider`` (a SelectionSlider, continuous_update=False),
    ``figure`` (the matplotlib Figure it redraws) and ``output`` (the Output widget showing it as a PNG). CSS classes
    for the browser: lightning-decay-slider and lightning-decay-plot (the Output).
    """
    import ipywidgets as widgets
    from IPython.display import Image, clear_output, display

    choices = tuple(float(c) for c in validate_decay(list(choices), None))
    if float(decay) not in choices:
        raise ValueError(f"decay must be one of choices {choices}, got {decay!r}")
    slider = widgets.SelectionSlider(
        options=[(f"{c:g}", c) for c in choices],
        value=float(decay),
        description="lambda",
        continuous_update=False,  # redraw when released: each redraw renders a whole figure
        layout=widgets.Layout(width="60%"),
    )
    slider.add_class("lightning-decay-slider")
    output = widgets.Output()
    output.add_class("lightning-decay-plot")
    figure = render_decay_view(float(decay), n)

    def redraw(change=None):
        figure.clear()
        _draw(figure, slider.value, n)
        with output:
            clear_output(wait=True)
            display(Image(data=png_bytes(figure), format="png"))

    slider.observe(redraw, names="value")
    box = live_box([slider, output], "The decay explorer")
    box.slider, box.figure, box.output = slider, figure, output
    redraw()
    return box
