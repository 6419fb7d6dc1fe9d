"""Chapter 11's view of feature maps: one head's causal softmax weights beside normalized phi-attention's.

:func:`render_feature_view` draws the view for one setting (the static figure of the rendered book):
three heatmaps of (n, n) weight matrices W (o = W v), query t down, key s across,

1. causal softmax, ``attention_weights(q, k, "softmax", decay=...)``;
2. normalized phi-attention, ``attention_weights(q, k, "normalized", feature_map=phi, decay=...)``;
3. their absolute difference, with the mean total-variation distance between the rows in its title.

:func:`feature_explorer` wraps the same drawing in ipywidgets controls (the map, d' of the learned map,
the decay) for readers running the notebook. :func:`feature_weights` returns the numbers drawn.

The inputs follow :func:`lightning_edu.feature_maps.approximation_table`: q, k of shape (n, d) with entries
N(0, sigma^2), ``sigma = scale``, drawn as ``scale * default_rng(seed).standard_normal((2, n, d))``, and the
softmax scale d^-1/2, so softmax's logits q . k / sqrt(d) have standard deviation sigma^2 (nearly flat rows
at sigma = 0.5, sharp ones at sigma = 2). At n = 128, d = 16, lambda = 1 the title's mean TV is the table's.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
from matplotlib.colors import PowerNorm, SymLogNorm
from matplotlib.figure import Figure

from ..feature_maps import LearnedReLU2, attention_weights
from ..validation import check_finite_scalar, validate_choice, validate_decay, validate_positive_int

from .plots import png_bytes
from .widgets import live_box

__all__ = [
    "FEATURE_VIEW_MAPS", "D_FEATURE_CHOICES", "FEATURE_DECAY_CHOICES", "feature_weights", "render_feature_view",
    "feature_explorer",
]

#: The maps the view offers: the three named maps of lightning_edu.feature_maps, and "learned relu2", a
#: LearnedReLU2(d, d') with W drawn from ``seed`` (its numpy twin, untrained): the only one whose d' is free.
FEATURE_VIEW_MAPS = ("identity", "elu+1", "relu2", "learned relu2")
LEARNED = "learned relu2"
#: d' of the learned map offered by the explorer's slider.
D_FEATURE_CHOICES = (4, 8, 16, 32, 64)
#: lambda offered by the explorer's slider: horizons 1/(1 - lambda) of 2, 4, 10, 20 and 100 tokens, and none.
FEATURE_DECAY_CHOICES = (0.5, 0.75, 0.9, 0.95, 0.99, 1.0)
EPS = 1e-6  # normalized_attention's default: a query whose features are all 0 gets weights 0, not NaN

_FORMULA = {
    "identity": "φ(x) = x",
    "elu+1": "φ(x) = elu(x)+1",
    "relu2": "φ(x) = ReLU(x)²",
    LEARNED: "φ(x) = ReLU(xW)²",
}
# Sizes in points at 100 dpi: the 1050 px image reads at full size in JupyterLab and still at about 9 pt
# (ticks) once the book scales it to its 750 px column.
_TICK_PT, _LABEL_PT, _TITLE_PT = 11, 12, 12
_FIGSIZE = (10.5, 5.2)


def _check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be a non-negative integer, got {type(seed).__name__} {seed!r}")
    if seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed}")
    return int(seed)


def _check(feature_map, d_feature, decay, n, d, scale, seed):
    feature_map = validate_choice("feature_map", feature_map, FEATURE_VIEW_MAPS)
    if np.ndim(decay) != 0:
        raise TypeError(f"decay must be one float in (0, 1] for the view (one head), got {type(decay).__name__}")
    lam = float(validate_decay(decay, None)[0])
    n, d = validate_positive_int("n", n), validate_positive_int("d", d)
    if feature_map == LEARNED:
        d_feature = d if d_feature is None else validate_positive_int("d_feature", d_feature)
    elif d_feature is not None:
        raise ValueError(f"d_feature applies only to feature_map={LEARNED!r} (the named maps keep d' = d), "
                         f"got d_feature={d_feature!r} with feature_map={feature_map!r}")
    scale = check_finite_scalar("scale", scale)
    if scale <= 0:
        raise ValueError(f"scale must be a positive finite number (the inputs' standard deviation), got {scale}")
    return feature_map, d_feature, lam, n, d, scale, _check_seed(seed)


def feature_weights(feature_map: str = "elu+1", d_feature: int | None = None, decay: float = 1.0, *, n: int = 32,
                    d: int = 16, scale: float = 1.0, seed: int = 0) -> dict:
    """The numbers :func:`render_feature_view` draws, for one head. (Chapter 11.)

    Returns a dict: ``softmax`` and ``normalized`` (the (n, n) weight matrices, float64; normalized with
    eps = 1e-6, normalized_attention's default), ``tv`` (the total-variation distance 1/2 sum_s |W_ts - P_ts|
    of each row t = 1 .. n-1; row 0 is left out, both put weight 1 on key 0, as in approximation_table),
    ``mean_tv``, ``denominator`` (phi(q_t) . z_t per row, z_t = sum_{s<=t} lambda^(t-s) phi(k_s)),
    ``d_feature`` (d'), ``q``, ``k`` and the checked setting (``feature_map``, ``decay``, ``n``, ``d``,
    ``scale``, ``seed``). ``d_feature`` must be None unless ``feature_map`` is "learned relu2" (None: d' = d).
    """
    feature_map, d_feature, lam, n, d, scale, seed = _check(feature_map, d_feature, decay, n, d, scale, seed)
    q, k = scale * np.random.default_rng(seed).standard_normal((2, n, d))
    if feature_map == LEARNED:
        import torch

        phi = LearnedReLU2(d, d_feature, generator=torch.Generator().manual_seed(seed)).numpy()
    else:
        phi, d_feature = feature_map, d
    softmax = attention_weights(q, k, "softmax", decay=lam)
    normalized = attention_weights(q, k, "normalized", feature_map=phi, decay=lam, eps=EPS)
    denominator = attention_weights(q, k, "linear", feature_map=phi, decay=lam).sum(axis=1)
    tv = 0.5 * np.abs(normalized - softmax).sum(axis=1)[1:]
    return {
        "softmax": softmax, "normalized": normalized, "tv": tv, "mean_tv": float(tv.mean()) if tv.size else 0.0,
        "denominator": denominator, "d_feature": int(d_feature), "q": q, "k": k, "feature_map": feature_map,
        "decay": lam, "n": n, "d": d, "scale": scale, "seed": seed,
    }


def _heatmap(ax, weights, norm, cmap):
    upper = np.triu(np.ones(weights.shape, dtype=bool), 1)  # blank above the diagonal: causal, not "small"
    image = ax.imshow(np.ma.masked_array(weights, mask=upper), cmap=cmap, norm=norm, interpolation="nearest")
    ax.set_xlabel("key position s", fontsize=_LABEL_PT)
    ax.set_ylabel("query position t", fontsize=_LABEL_PT)
    ax.tick_params(labelsize=_TICK_PT)
    return image


def _colorbar(fig, image, ax, label, ticks):
    bar = fig.colorbar(image, ax=ax, location="bottom", shrink=0.8, aspect=30, pad=0.02, ticks=ticks)
    bar.ax.set_xticklabels([f"{t:.2g}" for t in ticks])
    bar.set_label(label, fontsize=_LABEL_PT)
    bar.ax.tick_params(labelsize=_TICK_PT)
    return bar


_SQRT_TICKS = (0.0, 0.05, 0.2, 0.5, 1.0)  # evenly spread on a sqrt scale


def _draw(fig: Figure, data: dict) -> None:
    softmax, normalized, n = data["softmax"], data["normalized"], data["n"]
    name, lam, d, d_feature = data["feature_map"], data["decay"], data["d"], data["d_feature"]
    ax_soft, ax_norm, ax_diff = fig.subplots(1, 3)
    fig.suptitle(f"One head: q, k of shape ({n}, {d}), entries N(0, {data['scale']:g}²), seed {data['seed']}; "
                 f"decay λ = {lam:g}", fontsize=_TITLE_PT + 1)

    # Weights in [0, 1] share one colour scale; sqrt spacing, so that the small weights of late rows show.
    # A map that is not positive (identity) gives weights outside [0, 1]: a diverging scale of their own.
    is_distribution = bool(np.all(normalized >= -1e-12) and np.all(normalized <= 1 + 1e-9))
    shared = PowerNorm(0.5, vmin=0.0, vmax=1.0)
    image = _heatmap(ax_soft, softmax, shared, "viridis")
    ax_soft.set_title("causal softmax\n∝ λ^(t-s) exp(q·k/√d)", fontsize=_TITLE_PT)
    negative, zero = int(np.sum(data["denominator"] < 0)), int(np.sum(data["denominator"] == 0))
    second = f"learned W (seeded), d' = {d_feature}" if name == LEARNED else f"d' = d = {d}, fixed by φ"
    title = f"normalized, {_FORMULA[name]}\n{second}"
    if negative:
        title += f"\nφ(q)·z ≤ 0 in {negative + zero} of {n} rows"
    elif zero:
        title += f"\nφ(q)·z = 0 in {zero} of {n} rows"
    if is_distribution:
        _heatmap(ax_norm, normalized, shared, "viridis")
        _colorbar(fig, image, [ax_soft, ax_norm], "weight W[t, s] (sqrt scale)", _SQRT_TICKS)
    else:
        limit = float(np.nanmax(np.abs(normalized))) or 1.0
        diverging = _heatmap(ax_norm, normalized, SymLogNorm(1e-2, vmin=-limit, vmax=limit), "RdBu_r")
        _colorbar(fig, image, ax_soft, "weight (sqrt scale)", _SQRT_TICKS)
        big = 10.0 ** math.floor(math.log10(max(limit, 1.0)))
        ticks = sorted({0.0, 1.0, -1.0, big, -big})
        _colorbar(fig, diverging, ax_norm, "weight (symlog): not a distribution", ticks)
    ax_norm.set_title(title, fontsize=_TITLE_PT)

    difference = np.abs(normalized - softmax)
    top = _ceil_one_digit(float(np.nanmax(difference)))
    diff_image = _heatmap(ax_diff, difference, PowerNorm(0.5, vmin=0.0, vmax=top), "magma")
    ax_diff.set_title(f"|normalized − softmax|\nmean TV (rows 1..{n - 1}) = {data['mean_tv']:.3f}", fontsize=_TITLE_PT)
    _colorbar(fig, diff_image, ax_diff, "|difference| (sqrt scale)", [f * top for f in _SQRT_TICKS])
    for ax in (ax_soft, ax_norm, ax_diff):
        ax.set_xticks(_ticks(n))
        ax.set_yticks(_ticks(n))


def _ceil_one_digit(x: float) -> float:
    """x rounded up to one significant digit (0.36 -> 0.4), so that the colour bar's ticks are round; 1e-12 for 0."""
    if not x > 0 or not math.isfinite(x):
        return 1e-12 if not x > 0 else x
    unit = 10.0 ** math.floor(math.log10(x))
    return math.ceil(x / unit * (1 - 1e-12)) * unit


def _ticks(n: int) -> list[int]:
    step = max(1, 2 ** math.ceil(math.log2(max(n, 2) / 4)))
    return list(range(0, n, step))


def render_feature_view(feature_map: str = "elu+1", d_feature: int | None = None, decay: float = 1.0, *, n: int = 32,
                        d: int = 16, scale: float = 1.0, seed: int = 0) -> Figure:
    """Softmax's weights, normalized phi-attention's and their difference, for one head. (Chapter 11.)

    ``feature_map``: one of :data:`FEATURE_VIEW_MAPS` ("identity", "elu+1", "relu2", "learned relu2");
    ``d_feature`` (d') applies to "learned relu2" only (None: d' = d; the named maps have d' = d, and refuse a
    d_feature); ``decay``: one lambda in (0, 1]; q, k: (n, d), entries N(0, scale^2), from ``seed`` (see the
    module's docstring). Returns a matplotlib Figure at 100 dpi, not managed by pyplot (display it, or it is not
    shown). Its first three axes (the colour bars follow) hold one image each, whose data are
    ``feature_weights(...)["softmax"]``, ``["normalized"]`` and their absolute difference, masked above the
    diagonal (where every weight is 0: blank, not "small").
    """
    data = feature_weights(feature_map, d_feature, decay, n=n, d=d, scale=scale, seed=seed)
    fig = Figure(figsize=_FIGSIZE, dpi=100, layout="constrained")
    _draw(fig, data)
    return fig


def feature_explorer(feature_map: str = "elu+1", d_feature: int = 16, decay: float = 1.0, *, n: int = 32, d: int = 16,
                     scale: float = 1.0, seed: int = 0):
    """Controls for the map, d' and lambda that redraw :func:`render_feature_view`. (Chapter 11.)

    A Dropdown over :data:`FEATURE_VIEW_MAPS` (a Dropdown sends one change per choice: it has no dragging
    state), a SelectionSlider over :data:`D_FEATURE_CHOICES` for d' (disabled unless "learned relu2" is
    chosen) and one over :data:`FEATURE_DECAY_CHOICES` for lambda, both ``continuous_update=False`` (redraw on
    release: each redraw renders a whole figure). Returns an ipywidgets VBox with extra attributes:
    ``feature_map``, ``d_feature``, ``decay`` (the controls), ``figure`` (the matplotlib Figure it redraws),
    ``output`` (the Output widget showing it as a PNG) and ``data`` (the latest :func:`feature_weights`).
    CSS classes for the browser: lightning-feature-map, lightning-feature-d-feature, lightning-feature-decay and
    lightning-feature-plot (the Output).
    """
    import ipywidgets as widgets
    from IPython.display import Image, clear_output, display

    feature_map = validate_choice("feature_map", feature_map, FEATURE_VIEW_MAPS)
    d_feature = validate_positive_int("d_feature", d_feature)
    if d_feature not in D_FEATURE_CHOICES:
        raise ValueError(f"d_feature must be one of choices {D_FEATURE_CHOICES}, got {d_feature!r}")
    if np.ndim(decay) != 0:
        raise TypeError(f"decay must be one float in (0, 1], got {type(decay).__name__}")
    decay = float(validate_decay(decay, None)[0])
    if decay not in FEATURE_DECAY_CHOICES:
        raise ValueError(f"decay must be one of choices {FEATURE_DECAY_CHOICES}, got {decay!r}")
    setting = dict(n=n, d=d, scale=scale, seed=seed)
    _check(feature_map, None, decay, n, d, scale, seed)  # n, d, scale, seed refused here, before any widget

    style = {"description_width": "8em"}
    layout = widgets.Layout(width="32em")
    map_control = widgets.Dropdown(options=list(FEATURE_VIEW_MAPS), value=feature_map, description="feature map φ",
                                   style=style, layout=layout)
    d_control = widgets.SelectionSlider(
        options=[(str(c), c) for c in D_FEATURE_CHOICES], value=d_feature, description="d' (learned)",
        continuous_update=False, disabled=feature_map != LEARNED, style=style, layout=layout,
    )
    decay_control = widgets.SelectionSlider(
        options=[(f"{c:g}", c) for c in FEATURE_DECAY_CHOICES], value=decay, description="decay λ",
        continuous_update=False, style=style, layout=layout,
    )
    map_control.add_class("lightning-feature-map")
    d_control.add_class("lightning-feature-d-feature")
    decay_control.add_class("lightning-feature-decay")
    output = widgets.Output()
    output.add_class("lightning-feature-plot")
    figure = Figure(figsize=_FIGSIZE, dpi=100, layout="constrained")
    box = live_box([widgets.HBox([map_control, d_control]), decay_control, output], "The feature-map explorer")

    def redraw(change=None):
        learned = map_control.value == LEARNED
        d_control.disabled = not learned
        box.data = feature_weights(map_control.value, d_control.value if learned else None, decay_control.value,
                                   **setting)
        figure.clear()
        _draw(figure, box.data)
        with output:
            clear_output(wait=True)
            display(Image(data=png_bytes(figure), format="png"))

    for control in (map_control, d_control, decay_control):
        control.observe(redraw, names="value")
    box.feature_map, box.d_feature, box.decay = map_control, d_control, decay_control
    box.figure, box.output = figure, output
    redraw()
    return box
