"""The book's figure conventions (lightning_edu.book.plots): every benchmarked method its own colour and marker."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from lightning_edu.book.plots import BENCH_STYLES, bench_style, legend_outside, new_figure  # noqa: E402
from benchmarks.bench import METHODS  # noqa: E402


def test_every_benchmarked_method_has_its_own_colour_and_marker():
    colours = [style[1] for style in BENCH_STYLES.values()]
    markers = [style[2] for style in BENCH_STYLES.values()]
    assert len(set(colours)) == len(colours), colours
    assert len(set(markers)) == len(markers), markers


def test_the_styles_cover_the_benchmarks_methods():
    missing = set(METHODS) - set(BENCH_STYLES)
    assert not missing, f"methods of perf.bench without a figure style: {sorted(missing)}"


def test_a_recorded_name_gets_its_methods_style():
    assert bench_style("la2_fast_noseg") == bench_style("triton.la2_fast.one_segment")


def test_unknown_method_names_the_known_ones():
    with pytest.raises(KeyError, match="fla_chunk"):
        bench_style("fla_chunkk")


def test_the_legend_sits_outside_every_panel():
    fig, axes = new_figure(ncols=2)
    for ax in axes.flat:
        ax.plot([1, 2], [1, 2], **bench_style("triton"))
        ax.plot([1, 2], [2, 1], **bench_style("fla_chunk"))
    legend = legend_outside(fig, axes[0, 0])
    fig.canvas.draw()
    box = legend.get_window_extent()
    for ax in axes.flat:
        assert not box.overlaps(ax.get_window_extent()), "the legend overlaps a panel"
    assert [t.get_text() for t in legend.get_texts()] == [BENCH_STYLES["triton"][0], BENCH_STYLES["fla_chunk"][0]]


def test_a_record_line_names_its_commit_and_says_when_none_was_recorded():
    from lightning_edu.book import describe_recorded

    base = {"machine": "NVIDIA H100 80GB HBM3", "date": "2026-11-25", "command": "python -m benchmarks.bench"}
    assert "commit 0123456789ab)" in describe_recorded({**base, "commit": "0123456789abcdef"})
    assert "commit 8dac551 + local changes)" in describe_recorded({**base, "commit": "8dac551+local changes"})
    assert "commit not recorded)" in describe_recorded(base)
