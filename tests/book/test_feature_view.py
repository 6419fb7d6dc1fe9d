"""Chapter 11's feature view: the static figure shows attention_weights, and each control redraws it."""

import numpy as np
import pytest
import torch

from lightning_edu.book.feature_view import (
    D_FEATURE_CHOICES, FEATURE_DECAY_CHOICES, FEATURE_VIEW_MAPS, feature_explorer, feature_weights, render_feature_view,
)
from lightning_edu.feature_maps import LearnedReLU2, approximation_table, attention_weights


def _panels(fig):
    """The data of the three heatmaps (softmax, normalized, |difference|), unmasked."""
    return [np.ma.getdata(ax.images[0].get_array()) for ax in fig.axes[:3]]


def _qk(n=32, d=16, scale=1.0, seed=0):
    # the documented draw, written out independently of the module
    q, k = scale * np.random.default_rng(seed).standard_normal((2, n, d))
    return q, k


@pytest.mark.parametrize("feature_map, decay, n, d, scale", [
    ("elu+1", 1.0, 32, 16, 1.0), ("relu2", 0.5, 17, 5, 2.0), ("identity", 0.9, 9, 3, 0.5), ("elu+1", 0.99, 1, 4, 1.0),
])
def test_static_figure_shows_attention_weights(feature_map, decay, n, d, scale):
    fig = render_feature_view(feature_map, decay=decay, n=n, d=d, scale=scale, seed=3)
    q, k = _qk(n, d, scale, 3)
    softmax = attention_weights(q, k, "softmax", decay=decay)
    normalized = attention_weights(q, k, "normalized", feature_map=feature_map, decay=decay)
    shown_soft, shown_norm, shown_diff = _panels(fig)
    assert np.array_equal(shown_soft, softmax)
    assert np.array_equal(shown_norm, normalized)
    assert np.array_equal(shown_diff, np.abs(normalized - softmax))
    assert np.allclose(shown_soft.sum(axis=1), 1.0, rtol=0, atol=1e-12)
    # normalized rows sum to den / (den + eps), eps = 1e-6: 1 where phi(q_t) . z_t is not tiny; relu2 gives
    # den = 0 (weights 0) where phi(q_t) and z_t share no positive feature
    den = attention_weights(q, k, "linear", feature_map=feature_map, decay=decay).sum(axis=1)
    assert np.allclose(shown_norm.sum(axis=1), den / (den + 1e-6), rtol=1e-9, atol=1e-12)
    if feature_map == "elu+1":  # positive features: every row sums to 1
        assert np.allclose(shown_norm.sum(axis=1), 1.0, rtol=0, atol=1e-6)
    # above the diagonal the images are masked (blank), and the weights there are 0
    upper = np.triu(np.ones((n, n), dtype=bool), 1)
    assert np.array_equal(np.ma.getmaskarray(fig.axes[0].images[0].get_array()), upper)
    assert not softmax[upper].any() and not normalized[upper].any()
    assert fig.dpi >= 100


def test_learned_map_uses_seeded_learned_relu2():
    fig = render_feature_view("learned relu2", d_feature=8, decay=0.9, seed=5)
    q, k = _qk(seed=5)
    phi = LearnedReLU2(16, 8, generator=torch.Generator().manual_seed(5)).numpy()
    assert phi.W.shape == (16, 8)
    expected = attention_weights(q, k, "normalized", feature_map=phi, decay=0.9)
    assert np.array_equal(_panels(fig)[1], expected)
    assert "d' = 8" in fig.axes[1].get_title()
    # d' changes the map, hence the weights; the default d' is d
    assert not np.array_equal(_panels(render_feature_view("learned relu2", d_feature=32, decay=0.9, seed=5))[1], expected)
    assert feature_weights("learned relu2", n=8)["d_feature"] == 16


def test_titles_say_where_d_feature_applies_and_show_mean_tv():
    fixed = render_feature_view("relu2")
    assert "fixed by φ" in fixed.axes[1].get_title() and "d' = d = 16" in fixed.axes[1].get_title()
    data = feature_weights("elu+1")
    elu = render_feature_view("elu+1")
    assert f"mean TV (rows 1..31) = {data['mean_tv']:.3f}" in elu.axes[2].get_title()
    # identity is not positive: the title counts the rows whose denominator is <= 0
    assert "φ(q)·z ≤ 0 in" in render_feature_view("identity").axes[1].get_title()


def test_mean_tv_is_the_approximation_tables():
    # the same draw, n and d as feature_maps.approximation_table: the same mean TV (up to eps = 1e-6)
    table = {(r["map"], r["scale"]): r["mean_tv"] for r in approximation_table(scales=(0.5, 2.0), maps=("elu+1", "relu2"))}
    for name in ("elu+1", "relu2"):
        for scale in (0.5, 2.0):
            data = feature_weights(name, n=128, d=16, scale=scale)
            assert abs(data["mean_tv"] - table[name, scale]) < 1e-5
            tv = 0.5 * np.abs(data["normalized"] - data["softmax"]).sum(axis=1)[1:]
            assert np.allclose(data["tv"], tv)


def test_controls_are_release_only_and_each_redraws():
    box = feature_explorer(n=16)
    assert box.decay.continuous_update is False and box.d_feature.continuous_update is False
    assert [v for _, v in box.decay.options] == list(FEATURE_DECAY_CHOICES)
    assert [v for _, v in box.d_feature.options] == list(D_FEATURE_CHOICES)
    assert list(box.feature_map.options) == list(FEATURE_VIEW_MAPS)
    assert not hasattr(box.feature_map, "continuous_update")  # a Dropdown sends one change per choice
    for control, css in ((box.feature_map, "lightning-feature-map"), (box.d_feature, "lightning-feature-d-feature"),
                         (box.decay, "lightning-feature-decay"), (box.output, "lightning-feature-plot")):
        assert css in control._dom_classes
    q, k = _qk(16)
    soft, norm, _ = _panels(box.figure)
    assert np.array_equal(norm, attention_weights(q, k, "normalized", feature_map="elu+1"))
    assert box.d_feature.disabled

    box.decay.value = 0.5  # decay changes both panels
    soft2, norm2, _ = _panels(box.figure)
    assert np.array_equal(norm2, attention_weights(q, k, "normalized", feature_map="elu+1", decay=0.5))
    assert np.array_equal(soft2, attention_weights(q, k, "softmax", decay=0.5))
    assert not np.array_equal(norm2, norm) and not np.array_equal(soft2, soft)
    assert len(box.figure.axes) == 5  # three panels and two colour bars: the redraw replaced, not stacked

    box.feature_map.value = "relu2"  # the map changes the normalized panel only
    soft3, norm3, _ = _panels(box.figure)
    assert np.array_equal(soft3, soft2)
    assert np.array_equal(norm3, attention_weights(q, k, "normalized", feature_map="relu2", decay=0.5))
    assert box.d_feature.disabled

    box.feature_map.value = "learned relu2"  # d' comes alive with the learned map
    assert not box.d_feature.disabled
    assert box.data["d_feature"] == 16
    before = _panels(box.figure)[1].copy()
    box.d_feature.value = 4
    phi = LearnedReLU2(16, 4, generator=torch.Generator().manual_seed(0)).numpy()
    after = _panels(box.figure)[1]
    assert not np.array_equal(after, before)
    assert np.array_equal(after, attention_weights(q, k, "normalized", feature_map=phi, decay=0.5))

    box.feature_map.value = "identity"  # and goes dead again; identity's weights get a colour bar of their own
    assert box.d_feature.disabled and box.data["d_feature"] == 16
    assert len(box.figure.axes) == 6


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(feature_map="softmax"), ValueError, "feature_map must be one of"),
    (dict(feature_map=None), ValueError, "feature_map must be one of"),
    (dict(decay=0.0), ValueError, "decay must lie in"),
    (dict(decay=1.5), ValueError, "decay must lie in"),
    (dict(decay=[0.5, 0.9]), TypeError, "decay must be one float"),
    (dict(n=0), ValueError, "n must be a positive integer"),
    (dict(d=2.5), TypeError, "d must be a positive integer"),
    (dict(feature_map="learned relu2", d_feature=0), ValueError, "d_feature must be a positive integer"),
    (dict(feature_map="elu+1", d_feature=8), ValueError, "d_feature applies only to"),
    (dict(scale=0.0), ValueError, "scale must be a positive"),
    (dict(scale=float("nan")), ValueError, "scale must be a finite real number"),
    (dict(scale="0.5"), TypeError, "scale must be a finite real number, got str"),
    (dict(seed=-1), ValueError, "seed must be a non-negative integer"),
    (dict(seed=1.5), TypeError, "seed must be a non-negative integer"),
])
def test_render_refuses_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        render_feature_view(**kwargs)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(decay=0.3), ValueError, "decay must be one of choices"),
    (dict(d_feature=12), ValueError, "d_feature must be one of choices"),
    (dict(d_feature=None), TypeError, "d_feature must be a positive integer"),
    (dict(feature_map="elu"), ValueError, "feature_map must be one of"),
    (dict(n=-2), ValueError, "n must be a positive integer"),
    (dict(scale=-1.0), ValueError, "scale must be a positive"),
])
def test_explorer_refuses_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        feature_explorer(**kwargs)
