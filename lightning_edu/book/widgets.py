"""What an interactive figure shows where no kernel runs it.

A saved notebook opened without a running kernel (a static export, a notebook viewer, this book's website) has
no Python to redraw a widget: all it can show of one is its plain-text form. :func:`live_box` makes that form a
sentence saying so, instead of ipywidgets' ``VBox(children=(...))``. The chapters save no widget state either:
restored without a kernel it would draw sliders that move and redraw nothing.
"""

from __future__ import annotations

from functools import lru_cache

__all__ = ["live_box"]


@lru_cache(maxsize=1)
def _live_box_class():
    import ipywidgets as widgets

    class LiveBox(widgets.VBox):
        """An ipywidgets VBox whose plain-text form says that it needs a running kernel."""

        note = ""

        def __repr__(self) -> str:
            return self.note

    return LiveBox


def live_box(children, what: str):
    """A VBox of ``children`` for the interactive figure ``what`` (e.g. "The decay explorer"), whose text form,
    shown wherever the notebook is read without a kernel, tells the reader how to use it."""
    box = _live_box_class()(children)
    # ipywidgets cuts a widget's text form at 110 characters: one short sentence.
    box.note = f"{what} needs a running Jupyter kernel to redraw; the static figure shows one setting."
    if len(box.note) > 110:
        raise ValueError(f"what: at most {110 - len(box.note) + len(what)} characters, got {len(what)}: {what!r}")
    return box
