"""The block-size / decay explorer of chapter 04: sliders for B, lambda, d and n, and what they change.

Six views, redrawn together (:func:`render_explorer` draws them for one fixed setting, for the
rendered book; :class:`BlockExplorer` wires them to ipywidgets sliders):

1. the intra-block decay mask M (log10 of its entries: lambda^(r-s) spans hundreds of decades);
2. the diagonal factors: Lambda = lambda^(r+1) on q, lambda^(b-1-r) on k, and the paper's literal
   Lambda^-1 = lambda^-(r+1), against float64's range (where the literal formula overflows);
3. FLOPs against B, split into intra, inter and state update (:mod:`lightning_edu.costs`);
4. memory against B: on-chip bytes per block against the chip's capacity, and HBM bytes;
5. the modelled time against B, with its optimum;
6. the error of the numpy blockwise result against the recurrent scan, token by token.

All exponents are worked in log10 (exponent times log10 lambda), so the plots never underflow to 0 or
overflow to inf, whatever lambda and B are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from matplotlib.figure import Figure

from ..checks import random_qkv
from ..costs import POWERS_OF_TWO, Hardware, attention_cost, block_size_sweep, modelled_time
from ..validation import validate_decay, validate_positive_int
from .plots import color, fixed_titles, png_bytes
from .widgets import live_box

__all__ = ["BLOCK_SIZES", "DECAYS", "SEQ_LENS", "explorer_numbers", "render_explorer", "explorer"]

BLOCK_SIZES = POWERS_OF_TWO  # 16 .. 1024
# log-spaced in lambda below 0.1 and in 1 - lambda above 0.9: both ends matter
DECAYS = (0.001, 0.01, 0.05, 0.1, 0.5, 0.9, 0.99, 0.999, 1.0)
DIMS = (16, 32, 64, 128, 256)
SEQ_LENS = tuple(2**p for p in range(10, 17))  # 1K .. 64K
COST_SETTING = dict(batch=1, heads=16, dtype_bytes=2)  # bf16, 16 heads: the setting the cost views model
ERROR_EXTRA_TOKENS = 37  # the error view runs two blocks and this many tokens more (n if smaller): two block edges
ERROR_MAX_D = 64  # ... with d_k = d_v = min(d, 64), so that a redraw stays well under a second
FLOAT64_MAX_LOG10 = math.log10(np.finfo(np.float64).max)  # 308.25
FLOAT64_TINY_LOG10 = math.log10(np.finfo(np.float64).smallest_subnormal)  # -323.3


def error_size(block_size: int, d: int, n: int) -> tuple[int, int]:
    """(tokens, d) of the error view's problem for a setting: the first two blocks and 37 tokens of the sequence
    (every kind of row the blockwise pass has: inside the first block, after one and after two block edges, and a
    short last block), and d capped at 64. The error depends on lambda, B and d, not on how many more blocks
    follow; the caps keep a redraw well under a second, and the readout names them."""
    return min(n, 2 * block_size + ERROR_EXTRA_TOKENS), min(d, ERROR_MAX_D)


def _check(block_size, decay, d, n):
    block_size = validate_positive_int("block_size", block_size)
    lam = float(validate_decay(decay, None)[0]) if np.ndim(decay) == 0 else None
    if lam is None:
        raise TypeError(f"decay must be one float in (0, 1] for the explorer, got {type(decay).__name__}")
    return block_size, lam, validate_positive_int("d", d), validate_positive_int("n", n)


@lru_cache(maxsize=16)
def _recurrent_reference(decay: float, d: int, n: int):
    """Seeded q, k, v of one head and the recurrent scan's output (cached: redraws reuse it)."""
    from ..numpy_reference import causal_linear_recurrent

    q, k, v = random_qkv(1, 1, n, d, d, seed=4)
    return q, k, v, causal_linear_recurrent(q, k, v, decay)


@lru_cache(maxsize=64)
def _blockwise_error(block_size: int, decay: float, d: int, n: int) -> tuple[np.ndarray, float]:
    """Per-token error max_j |o_blockwise - o_recurrent| / max |o_recurrent|, and the relative error."""
    from .. import lightning_attention
    from ..checks import relative_error

    q, k, v, ref = _recurrent_reference(decay, d, n)
    out = lightning_attention(q, k, v, decay, backend="numpy", block_size=block_size)
    per_token = np.abs(out - ref)[0, 0].max(axis=-1) / max(float(np.abs(ref).max()), 1e-300)
    return per_token, relative_error(out, ref)


@dataclass(frozen=True)
class ExplorerNumbers:
    """What the readout prints for one setting."""

    block_size: int
    decay: float
    d: int
    n: int
    num_blocks: int
    intra_flops: int
    inter_flops: int
    state_flops: int
    hbm_bytes: int
    sram_bytes_per_block: int
    sram_capacity: int
    modelled_time: float
    best_block_size: int
    error_tokens: int
    error_d: int
    relative_error: float

    def _error_problem(self) -> str:
        tokens = f"all {self.n} tokens" if self.error_tokens == self.n else \
            f"the first {self.error_tokens} of the {self.n} tokens (two blocks and {ERROR_EXTRA_TOKENS})"
        d = f"d = {self.error_d}" if self.error_d == self.d else f"d = {self.error_d} (of {self.d})"
        return f"{tokens}, {d}"

    def html(self) -> str:
        fits = "fits" if self.sram_bytes_per_block <= self.sram_capacity else "does NOT fit"
        t = "inf (block does not fit on chip)" if math.isinf(self.modelled_time) else f"{self.modelled_time * 1e6:.1f} &micro;s"
        rows = [
            ("setting", f"B = {self.block_size}, &lambda; = {self.decay:g}, d<sub>k</sub> = d<sub>v</sub> = {self.d}, n = {self.n}"),
            ("blocks (sequential steps)", f"{self.num_blocks}"),
            ("FLOPs intra / inter / state", f"{self.intra_flops / 1e9:.3g} / {self.inter_flops / 1e9:.3g} / {self.state_flops / 1e9:.3g} GFLOP"),
            ("HBM traffic", f"{self.hbm_bytes / 2**20:.3g} MiB"),
            ("on chip per block", f"{self.sram_bytes_per_block / 1024:.4g} KiB ({fits} in {self.sram_capacity // 1024} KiB)"),
            ("modelled time", f"{t}; best B = {self.best_block_size}"),
            ("blockwise vs recurrent", f"relative error {self.relative_error:.1e} (float64, on {self._error_problem()})"),
        ]
        body = "".join(f"<tr><td style='padding-right:1em'><b>{k}</b></td><td>{v}</td></tr>" for k, v in rows)
        return f"<table class='lightning-explorer-readout'>{body}</table>"


@lru_cache(maxsize=64)
def _cost_sweep(block_size: int, d: int, n: int, hw: Hardware):
    """The cost model over the block sizes shown, for one setting: (sizes, costs, times, times if any B fit).

    Cached, so that a redraw computes it once for the readout and the figure together."""
    sizes = tuple(sorted(set(BLOCK_SIZES) | {block_size}))
    sweep = tuple(block_size_sweep(n, d, d, list(sizes), **COST_SETTING))
    times = np.array([modelled_time(c, hw) for c in sweep])
    unconstrained = np.array([modelled_time(c, hw, check_sram=False) for c in sweep])
    return sizes, sweep, times, unconstrained


def explorer_numbers(block_size: int = 64, decay: float = 0.9, d: int = 64, n: int = 4096, hardware: Hardware | None = None) -> ExplorerNumbers:
    """The numbers behind the views for one setting (cost model: bf16, 16 heads, batch 1). (Chapter 04.)"""
    block_size, lam, d, n = _check(block_size, decay, d, n)
    hw = Hardware() if hardware is None else hardware
    cost = attention_cost("blockwise", n, d, d, block_size, **COST_SETTING)
    _, sweep, times, _ = _cost_sweep(block_size, d, n, hw)
    best = min(range(len(sweep)), key=lambda i: (times[i], sweep[i].block_size))
    tokens, error_d = error_size(block_size, d, n)
    _, rel = _blockwise_error(block_size, lam, error_d, tokens)
    return ExplorerNumbers(
        block_size, lam, d, n, cost.num_blocks, cost.intra_flops, cost.inter_flops, cost.state_flops,
        cost.hbm_bytes, cost.sram_bytes_per_block, hw.sram_bytes, modelled_time(cost, hw), sweep[best].block_size,
        tokens, error_d, rel,
    )


def render_explorer(block_size: int = 64, decay: float = 0.9, d: int = 64, n: int = 4096, hardware: Hardware | None = None) -> Figure:
    """The explorer's six views for one fixed setting, as a matplotlib Figure (not registered with pyplot,
    so it is shown once, where it is displayed). (Chapter 04.)"""
    block_size, lam, d, n = _check(block_size, decay, d, n)
    hw = Hardware() if hardware is None else hardware
    log_lam = math.log10(lam)
    # a fixed layout: constrained layout measures every tick label and triples the redraw time
    fig = Figure(figsize=(12.0, 7.2))  # at 100 dpi: 1200 x 720 px, the width of a notebook cell and of a site page
    axes = fig.subplots(2, 3, gridspec_kw=dict(left=0.068, right=0.985, bottom=0.07, top=0.9, wspace=0.36, hspace=0.32))
    fig.suptitle(f"Block size B = {block_size}, decay λ = {lam:g}, d_k = d_v = {d}, n = {n}")  # plain text: mathtext parsing slows redraws

    # 1. the mask M, as exponents: log10 M[r, s] = (r - s) log10 lambda below the diagonal
    ax = axes[0, 0]
    r = np.arange(block_size)
    gap = r[:, None] - r[None, :]
    exponent = np.where(gap >= 0, gap * log_lam, np.nan)
    low = min(-1.0, (block_size - 1) * log_lam)
    image = ax.imshow(exponent, cmap="viridis", vmin=low, vmax=0.0, interpolation="nearest")
    fig.colorbar(image, ax=ax)  # unlabelled (the title says it): a label there meets the next panel's at large B
    ax.set(title="mask M (colour: log10 M)", xlabel="key row s in the block", ylabel="query row r in the block")

    # 2. the diagonal factors, and the literal Lambda^-1 against float64's range
    ax = axes[0, 1]
    ax.plot(r, (r + 1) * log_lam, color=color("inter"), label="Λ: λ^(r+1) on q_r")
    ax.plot(r, (block_size - 1 - r) * log_lam, color=color("state"), label="λ^(b-1-r) on k_r (formed directly)")
    ax.plot(r, -(r + 1) * log_lam, color=color("paper_literal"), ls="--", label="literal Λ^-1: λ^-(r+1)")
    span = max(abs(block_size * log_lam), 1.0) * 1.15
    if span > 200:  # show float64's range once the factors come near it
        span = max(span, 360.0)
        ax.axhline(FLOAT64_MAX_LOG10, color=color("floor"), lw=0.8)
        ax.axhline(FLOAT64_TINY_LOG10, color=color("floor"), lw=0.8)
        ax.text(0, FLOAT64_MAX_LOG10, " float64 overflows above", va="bottom", fontsize=9)
        ax.text(0, FLOAT64_TINY_LOG10, " float64 holds 0 below", va="top", fontsize=9)
    ax.set_ylim(-span, span)
    ax.set(title="decay factors of one block", xlabel="row r in the block (0-based)", ylabel="log10 of the factor")
    ax.legend(fontsize=9, loc="best")

    # 3-5. the cost model against B, current B marked
    sizes, sweep, times, unconstrained = _cost_sweep(block_size, d, n, hw)
    ax = axes[0, 2]
    ax.plot(sizes, [c.intra_flops for c in sweep], "o-", color=color("intra"), label="intra (masked products)")
    ax.plot(sizes, [c.inter_flops for c in sweep], "o-", color=color("inter"), label="inter (Q with the state)")
    ax.plot(sizes, [c.state_flops for c in sweep], "o-", color=color("state"), label="state update")
    ax.axvline(block_size, color=color("floor"), ls=":", label=f"B = {block_size}")
    _log2_axes(ax, sizes)
    ax.set(title=f"FLOPs, {COST_SETTING['heads']} heads", xlabel="block size B (rows)", ylabel="FLOPs")
    ax.legend(fontsize=9)

    ax = axes[1, 0]
    ax.plot(sizes, [c.sram_bytes_per_block for c in sweep], "o-", color=color("blockwise"), label="on chip per block")
    ax.plot(sizes, [c.hbm_bytes for c in sweep], "s-", color=color("floor"), label="HBM traffic (whole call)")
    ax.axhline(hw.sram_bytes, color=color("triton"), ls="--", label=f"on-chip capacity {hw.sram_bytes // 1024} KiB")
    ax.axvline(block_size, color=color("floor"), ls=":")
    _log2_axes(ax, sizes)
    ax.set(title="memory, bf16", xlabel="block size B (rows)", ylabel="bytes")
    ax.legend(fontsize=9)

    ax = axes[1, 1]
    fits = np.isfinite(times)
    ax.plot(sizes, unconstrained * 1e6, ":", color=color("blockwise"), label="if any block fit on chip")
    ax.plot(np.array(sizes)[fits], times[fits] * 1e6, "o-", color=color("blockwise"), label="blocks that fit")
    if fits.any():
        best = min(np.flatnonzero(fits), key=lambda i: (times[i], sizes[i]))
        ax.plot([sizes[best]], [times[best] * 1e6], "*", ms=16, color=color("triton"), label=f"optimum B = {sizes[best]}")
    ax.axvline(block_size, color=color("floor"), ls=":")
    _log2_axes(ax, sizes)
    ax.set_yscale("linear")  # the times span about one decade: a linear axis keeps its labels
    ax.set_ylim(0, None)
    ax.set(title="modelled time (toy A100-like model)", xlabel="block size B (rows)", ylabel="time (microseconds)")
    ax.legend(fontsize=9)

    # 6. the error of the numpy blockwise result against the recurrent scan
    ax = axes[1, 2]
    tokens, error_d = error_size(block_size, d, n)
    per_token, rel = _blockwise_error(block_size, lam, error_d, tokens)
    floor = 1e-19  # exact tokens (error 0) are drawn on this floor
    ax.semilogy(np.arange(tokens), np.maximum(per_token, floor), ".", ms=2, color=color("blockwise"))
    for start in range(block_size, tokens, block_size):
        ax.axvline(start, color=color("floor"), lw=0.5, alpha=0.5, label="block edge" if start == block_size else None)
    ax.axhline(np.finfo(np.float64).eps, color=color("floor"), ls="--", lw=0.8, label="float64 epsilon")
    ax.set_ylim(floor / 2, 1e-10)
    ax.set(title=f"blockwise vs recurrent: error {rel:.1e}",
           xlabel=f"token t (the first {tokens}), d = {error_d}",
           ylabel="max |difference| / max |o|")
    ax.legend(fontsize=9, loc="upper right")
    fixed_titles(fig)
    return fig


def _log2_axes(ax, sizes):
    from matplotlib.ticker import LogLocator, NullFormatter, NullLocator

    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_locator(LogLocator(base=10, numticks=6))
    ax.yaxis.set_minor_formatter(NullFormatter())  # unlabelled minor ticks: fewer texts to lay out
    ax.grid(True, which="major", alpha=0.3)


class BlockExplorer:
    """Sliders for B, lambda, d and n (``continuous_update=False``: redraw on release), a readout and the
    six views as one image. Display it in a notebook; ``.widget`` is the ipywidgets box. (Chapter 04.)"""

    def __init__(self, block_size: int = 64, decay: float = 0.9, d: int = 64, n: int = 4096):
        import ipywidgets as widgets

        block_size, decay, d, n = _check(block_size, decay, d, n)
        for name, value, options in (("block_size", block_size, BLOCK_SIZES), ("decay", decay, DECAYS), ("d", d, DIMS), ("n", n, SEQ_LENS)):
            if value not in options:
                raise ValueError(f"{name} must be one of the explorer's choices {options}, got {value}")
        style = {"description_width": "9em"}
        layout = widgets.Layout(width="26em")

        def slider(description, options, value):
            return widgets.SelectionSlider(
                options=[(f"{o:g}", o) for o in options], value=value, description=description,
                continuous_update=False, style=style, layout=layout,
            )

        self.block_size = slider("block size B", BLOCK_SIZES, block_size)
        self.decay = slider("decay λ", DECAYS, decay)
        self.d = slider("d_k = d_v", DIMS, d)
        self.n = slider("sequence n", SEQ_LENS, n)
        self.controls = (self.block_size, self.decay, self.d, self.n)
        self.readout = widgets.HTML()
        self.image = widgets.Image(format="png")
        self.image.add_class("lightning-explorer-plot")
        self.readout.add_class("lightning-explorer-readout")
        self.block_size.add_class("lightning-explorer-block-size")
        for control in self.controls:
            control.observe(self._on_change, names="value")
        self.widget = live_box([widgets.HBox([widgets.VBox(self.controls[:2]), widgets.VBox(self.controls[2:])]), self.readout, self.image],
                               "The block-size explorer")
        self.redraw()

    def setting(self) -> dict:
        return {"block_size": self.block_size.value, "decay": self.decay.value, "d": self.d.value, "n": self.n.value}

    def redraw(self) -> None:
        setting = self.setting()
        self.numbers = explorer_numbers(**setting)
        self.readout.value = self.numbers.html()
        self.image.value = png_bytes(render_explorer(**setting))

    def _on_change(self, change) -> None:
        self.redraw()

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)


def explorer(block_size: int = 64, decay: float = 0.9, d: int = 64, n: int = 4096) -> BlockExplorer:
    """The interactive explorer, starting at the given setting (each must be one of the slider choices)."""
    return BlockExplorer(block_size, decay, d, n)
