"""Chapter 03's decay view: the static figure shows decay_mask, and the slider redraws it."""

import math

import numpy as np
import pytest

from lightning_edu.book.decay_view import DECAY_CHOICES, decay_explorer, effective_context, render_decay_view
from lightning_edu.numpy_reference import decay_mask


def _image(fig):
    return np.asarray(fig.axes[0].images[0].get_array())


def _profile(fig):
    return np.array([bar.get_height() for bar in fig.axes[1].patches])


@pytest.mark.parametrize("decay, n", [(0.9, 32), (1.0, 7), (0.05, 37), (0.99609375, 1)])
def test_static_view_shows_decay_mask(decay, n):
    fig = render_decay_view(decay, n=n)
    assert np.array_equal(_image(fig), decay_mask(n, decay))
    # the profile is lambda^(distance) for distances 0 .. n-1, an independent closed form
    assert np.allclose(_profile(fig), decay ** np.arange(n), rtol=1e-12, atol=0)


def test_horizon_line_only_when_finite_and_inside():
    lines = lambda fig: [ln for ln in fig.axes[1].lines if ln.get_linestyle() == "--"]
    assert len(lines(render_decay_view(0.875, n=32))) == 1
    assert np.allclose(lines(render_decay_view(0.875, n=32))[0].get_xdata(), 8.0)
    assert lines(render_decay_view(1.0, n=32)) == []          # infinite horizon
    assert lines(render_decay_view(0.99609375, n=32)) == []   # horizon 256 lies beyond n


def test_slider_is_release_only_and_redraws():
    explorer = decay_explorer(n=16, decay=0.875)
    slider = explorer.slider
    assert slider.continuous_update is False
    assert [value for _, value in slider.options] == list(DECAY_CHOICES)
    before = _image(explorer.figure).copy()
    assert np.array_equal(before, decay_mask(16, 0.875))
    slider.value = 0.5
    after = _image(explorer.figure)
    assert not np.array_equal(before, after)
    assert np.array_equal(after, decay_mask(16, 0.5))
    assert np.allclose(_profile(explorer.figure), 0.5 ** np.arange(16))
    assert len(explorer.figure.axes) == 3                     # redraw replaced the panels instead of stacking new ones
    slider.value = 1.0
    assert np.array_equal(_image(explorer.figure), np.tril(np.ones((16, 16))))


def test_explorer_rejects_value_outside_choices():
    with pytest.raises(ValueError, match="decay must be one of choices"):
        decay_explorer(decay=0.3)


@pytest.mark.parametrize("bad", [0.0, 1.5, float("nan"), -0.2])
def test_render_rejects_bad_decay(bad):
    with pytest.raises(ValueError, match="decay must lie in"):
        render_decay_view(bad)


@pytest.mark.parametrize("bad", [0, -3])
def test_render_rejects_non_positive_n(bad):
    with pytest.raises(ValueError, match="n must be a positive integer"):
        render_decay_view(0.9, n=bad)


@pytest.mark.parametrize("bad", [2.5, True, "8"])
def test_render_rejects_n_of_the_wrong_type(bad):
    with pytest.raises(TypeError, match="n must be a positive integer"):
        render_decay_view(0.9, n=bad)


def test_effective_context():
    assert effective_context(0.5) == 2.0
    assert math.isclose(effective_context(0.9), 10.0, rel_tol=1e-12)
    assert effective_context(1.0) == math.inf
    assert np.allclose(effective_context(np.array([0.75, 0.96875])), [4.0, 32.0], rtol=1e-12)
    assert np.isinf(effective_context([1.0, 0.5])[0])
    # the horizon is the sum of the weights lambda^j (truncated far out)
    lam = 0.97
    assert math.isclose(effective_context(lam), float(np.sum(lam ** np.arange(5000))), rel_tol=1e-12)


@pytest.mark.parametrize("decay", [0.05, 0.99609375, 1.0])
def test_no_panel_is_cut_at_the_figures_edges_nor_overlaps_the_next(decay):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = render_decay_view(decay, 32)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    boxes = [ax.get_tightbbox(renderer) for ax in fig.axes]  # the mask, the profile, the mask's colour bar
    for box in boxes:
        assert box.x0 >= 0 and box.x1 <= fig.bbox.width and box.y0 >= 0 and box.y1 <= fig.bbox.height
    assert boxes[0].x1 < boxes[2].x0 and boxes[2].x1 < boxes[1].x0
