"""Interactive figures read without a kernel (lightning_edu.book.widgets): each says what it needs."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from lightning_edu.book.decay_view import decay_explorer  # noqa: E402
from lightning_edu.book.explorer import explorer  # noqa: E402
from lightning_edu.book.feature_view import feature_explorer  # noqa: E402


@pytest.mark.parametrize("make, what", [
    (lambda: decay_explorer(n=16), "The decay explorer"),
    (lambda: explorer(block_size=64, decay=0.9, d=16, n=1024), "The block-size explorer"),
    (lambda: feature_explorer(n=8, d=4), "The feature-map explorer"),
])
def test_the_plain_text_form_says_it_needs_a_kernel(make, what):
    bundle = make()._repr_mimebundle_()
    text = bundle["text/plain"]
    assert text.startswith(what) and "running Jupyter kernel" in text and text.endswith("shows one setting.")
    assert "application/vnd.jupyter.widget-view+json" in bundle  # still a live widget where a kernel runs
