"""The chapter 04 explorer, driven from Python: controls, readout, figure."""

import math

import numpy as np
import pytest
from matplotlib.figure import Figure

from lightning_edu.book import explorer as ex
from lightning_edu.book.plots import png_bytes
from lightning_edu.costs import attention_cost


@pytest.fixture(scope="module")
def widget():
    return ex.explorer(block_size=64, decay=0.9, d=32, n=2048)


def test_every_control_redraws_on_release_only(widget):
    assert len(widget.controls) == 4
    for control in widget.controls:
        assert control.continuous_update is False, control.description


def test_block_size_choices_are_powers_of_two_16_to_1024(widget):
    assert [value for _, value in widget.block_size.options] == [16, 32, 64, 128, 256, 512, 1024]
    decays = [value for _, value in widget.decay.options]
    assert decays[0] == 0.001 and decays[-1] == 1.0 and decays == sorted(decays)


def test_changing_block_size_changes_readout_and_figure(widget):
    before_text, before_png = widget.readout.value, widget.image.value
    assert "B = 64" in before_text and before_png[:8] == b"\x89PNG\r\n\x1a\n"
    widget.block_size.value = 128
    assert "B = 128" in widget.readout.value and "B = 64," not in widget.readout.value
    assert widget.image.value != before_png
    # the readout shows the cost model's numbers for the new B: 2048 / 128 = 16 blocks
    assert widget.numbers.num_blocks == 16
    cost = attention_cost("blockwise", 2048, 32, 32, 128, **ex.COST_SETTING)
    assert widget.numbers.intra_flops == cost.intra_flops
    assert f"{cost.intra_flops / 1e9:.3g}" in widget.readout.value
    widget.block_size.value = 64
    assert widget.readout.value == before_text


def test_changing_decay_changes_the_figure(widget):
    before = widget.image.value
    widget.decay.value = 0.05
    assert "&lambda; = 0.05" in widget.readout.value
    assert widget.image.value != before
    widget.decay.value = 0.9


def test_error_readout_is_float64_small(widget):
    assert widget.numbers.relative_error < 1e-13
    assert widget.numbers.error_tokens == 2 * 64 + 37  # two blocks of B = 64 and 37 tokens, of the 2048
    assert "the first 165 of the 2048 tokens" in widget.readout.value and "d = 32)" in widget.readout.value


def test_render_explorer_is_a_standalone_figure_with_the_six_views():
    fig = ex.render_explorer(block_size=32, decay=0.05, d=16, n=1024)
    assert isinstance(fig, Figure) and len(fig.axes) == 7  # six panels and the mask's colour bar
    mask_image = fig.axes[0].images[0].get_array()
    assert mask_image.shape == (32, 32)
    # the mask panel draws log10 M exactly: M[31, 0] = 0.05^31, upper triangle blank
    assert mask_image[31, 0] == pytest.approx(31 * math.log10(0.05))
    assert np.ma.is_masked(mask_image[0, 1])
    # the current B is marked on the cost panel
    assert any(line.get_xdata()[0] == 32 for line in fig.axes[2].get_lines() if line.get_linestyle() == ":")


def test_render_changes_with_block_size():
    a = ex.render_explorer(block_size=16, decay=0.9, d=16, n=1024)
    b = ex.render_explorer(block_size=256, decay=0.9, d=16, n=1024)
    assert a.axes[0].images[0].get_array().shape == (16, 16)
    assert b.axes[0].images[0].get_array().shape == (256, 256)
    assert png_bytes(a) != png_bytes(b)


def test_non_power_of_two_block_renders_too():
    fig = ex.render_explorer(block_size=100, decay=0.5, d=8, n=1024)
    assert fig.axes[0].images[0].get_array().shape == (100, 100)


def test_numbers_for_the_literal_formula_setting_stay_finite():
    numbers = ex.explorer_numbers(block_size=1024, decay=0.001, d=16, n=2048)
    assert math.isfinite(numbers.relative_error) and numbers.relative_error < 1e-13


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(block_size=0), ValueError, "block_size must be a positive integer"),
        (dict(block_size=64.0), TypeError, "block_size must be a positive integer, got float"),
        (dict(decay=1.5), ValueError, r"decay must lie in \(0, 1\]"),
        (dict(decay=[0.5, 0.9]), TypeError, "decay must be one float"),
        (dict(d=-3), ValueError, "d must be a positive integer"),
    ],
)
def test_render_arguments_are_checked(kwargs, error, match):
    with pytest.raises(error, match=match):
        ex.render_explorer(**kwargs)


def test_widget_refuses_values_off_its_sliders():
    with pytest.raises(ValueError, match="block_size must be one of the explorer's choices"):
        ex.explorer(block_size=100)


def test_a_redraw_runs_the_cost_sweep_once(monkeypatch):
    # The readout and the figure share one sweep per setting (it used to be computed twice per redraw).
    calls = []
    real = ex.block_size_sweep
    monkeypatch.setattr(ex, "block_size_sweep", lambda *a, **k: calls.append(a) or real(*a, **k))
    ex._cost_sweep.cache_clear()
    widget = ex.explorer(block_size=32, decay=0.9, d=64, n=4096)  # the first draw
    assert len(calls) == 1
    widget.block_size.value = 128  # a new setting: one more sweep, not two
    assert len(calls) == 2


def test_the_error_readout_follows_the_sliders_and_names_its_caps():
    """The error view runs a capped problem; the readout says so, and it changes with B, n and d."""
    small = ex.explorer_numbers(block_size=16, decay=0.9, d=16, n=1024)
    assert (small.error_tokens, small.error_d) == (69, 16)
    assert "the first 69 of the 1024 tokens" in small.html() and "d = 16)" in small.html()
    big = ex.explorer_numbers(block_size=1024, decay=0.001, d=256, n=65536)
    assert (big.error_tokens, big.error_d) == (2085, 64)
    assert "the first 2085 of the 65536 tokens" in big.html() and "d = 64 (of 256)" in big.html()
    whole = ex.explorer_numbers(block_size=1024, decay=0.5, d=64, n=1024)
    assert whole.error_tokens == 1024 and "all 1024 tokens, d = 64)" in whole.html()


@pytest.mark.parametrize("setting", [dict(block_size=1024, decay=0.001, d=256, n=65536),
                                     dict(block_size=16, decay=1.0, d=16, n=1024)])
def test_no_panel_is_cut_at_the_figures_edges(setting):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = ex.render_explorer(**setting)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    for ax in fig.axes:
        box = ax.get_tightbbox(renderer)
        assert box.x0 >= 0 and box.x1 <= fig.bbox.width and box.y0 >= 0 and box.y1 <= fig.bbox.height, ax.get_title()
    # and no two panels of a row (the mask's colour bar included) overlap: labels would be drawn over each other
    boxes = [ax.get_tightbbox(renderer) for ax in fig.axes]
    for row in ([0, 6, 1, 2], [3, 4, 5]):
        for left, right in zip(row, row[1:]):
            assert boxes[left].x1 < boxes[right].x0, (fig.axes[left].get_title(), fig.axes[right].get_title())
