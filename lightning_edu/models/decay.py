"""Per-head decay schedules: which lambda_h each head of a lightning attention layer uses.

Lightning attention keeps one decay lambda in (0, 1] per head: ``KV_t = lambda KV_{t-1} + k_t^T v_t``. A head
with lambda close to 1 remembers far back; a small lambda forgets within a few tokens. Models fix these values
rather than learn them, spreading the heads geometrically from short to long memory in the manner of ALiBi's
slopes. Implementations spread them differently, and some change them with the layer's depth. Each schedule
below is one formula, named after the code it comes from; :func:`decay_schedule` picks one by name.

All return float64 numpy arrays of shape (heads,), with head h = 0, ..., heads - 1 and layer l = 0, ...,
layers - 1 counted from zero.
"""

from __future__ import annotations

import numpy as np

from ..validation import validate_int

__all__ = ["SCHEDULES", "decay_schedule", "alibi", "fla_lightning", "minimax01", "head_decays"]


def _check_layer(layer, layers) -> tuple[int, int]:
    layers = validate_int("layers", layers, 1)
    layer = validate_int("layer", layer, 0)
    if layer >= layers:
        raise ValueError(f"layer must be in [0, layers - 1] = [0, {layers - 1}], got layer={layer}")
    return layer, layers


def alibi(heads: int, layer: int = 0, layers: int = 1) -> np.ndarray:
    """lambda_h = exp(-2^(-8 (h + 1) / H)), the same for every layer.

    The slopes 2^(-8 (h + 1) / H) are ALiBi's ("Train Short, Test Long: Attention with Linear Biases Enables
    Input Length Extrapolation") for H a power of two; this is the schedule of the original Lightning
    Attention-2 tests and of this book's GPU benchmark (:func:`lightning_edu.models.decay.head_decays`, which
    this function calls). Every lambda_h is strictly below 1 and they grow with h: head 0 forgets fastest
    (lambda_0 = exp(-2^(-8/H))), the last head slowest (lambda_{H-1} = exp(-1/256)).
    ``layer`` and ``layers`` are checked and otherwise unused.
    """
    heads = validate_int("heads", heads, 1)
    _check_layer(layer, layers)
    return np.asarray(head_decays(heads), dtype=np.float64)


def fla_lightning(heads: int, layer: int = 0, layers: int = 1) -> np.ndarray:
    """log lambda_h = -(8 / H) (1 - l / L) h: as implemented in fla's lightning attention layer.

    This is the per-head log decay (``g_gamma``) of ``chunk_lightning_attn`` in flash-linear-attention (fla),
    with l = ``layer`` and L = ``layers``. It differs from :func:`alibi` in three ways: the log decay is linear
    in h (not geometric), so lambda_h *falls* with h; head 0 never decays (lambda_0 = 1 exactly, a plain
    running sum); and deeper layers decay less, all heads tending to 1 as l / L grows (the last layer,
    l = L - 1, has log lambda_h = -(8 / H) h / L).
    """
    heads = validate_int("heads", heads, 1)
    layer, layers = _check_layer(layer, layers)
    return np.exp(-(8.0 / heads) * (1.0 - layer / layers) * np.arange(heads, dtype=np.float64))


def minimax01(heads: int, layer: int = 0, layers: int = 1) -> np.ndarray:
    """lambda_h = exp(-2^(-8 (h + 1) / H) (1 - l / (L - 1))): as in MiniMax-01's code, without its 1e-5.

    The ALiBi slopes of :func:`alibi` scaled by a factor that falls linearly with depth, from 1 at the first
    layer (l = 0, lambda_h the same as :func:`alibi`) to 0 at the last (l = L - 1), where every lambda_h is
    exactly 1: the last layer is a plain running sum with no decay. A single layer (L = 1, where
    l / (L - 1) is undefined) takes the factor 1.

    Two differences from the MiniMax-Text-01 model code: that code adds 1e-5 to the factor (so its last layer
    keeps lambda_h = exp(-1e-5 * slope), just below 1), and for H not a power of two its ALiBi slopes interleave
    those of the nearest powers of two instead of using 2^(-8 (h + 1) / H). Both are left out here so that
    the formula above is the whole story.
    """
    heads = validate_int("heads", heads, 1)
    layer, layers = _check_layer(layer, layers)
    factor = 1.0 if layers == 1 else 1.0 - layer / (layers - 1)
    slopes = 2.0 ** (-8.0 * (np.arange(heads, dtype=np.float64) + 1) / heads)
    return np.exp(-slopes * factor)


SCHEDULES = {"alibi": alibi, "fla_lightning": fla_lightning, "minimax01": minimax01}
"""The schedules by name, for :func:`decay_schedule`."""


def decay_schedule(name: str, heads: int, layer: int = 0, layers: int = 1) -> np.ndarray:
    """The decays lambda_h of layer ``layer`` (of ``layers``) under the named schedule: float64, shape (heads,).

    ``name`` is one of :data:`SCHEDULES`: "alibi" (:func:`alibi`), "fla_lightning" (:func:`fla_lightning`) or
    "minimax01" (:func:`minimax01`); their docstrings give each formula. Every value lies in (0, 1].
    An unknown name, or heads < 1, layers < 1, or layer outside [0, layers - 1], is a ValueError; a non-integer
    heads, layer or layers is a TypeError.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, one of {sorted(SCHEDULES)}; got {type(name).__name__}")
    if name not in SCHEDULES:
        raise ValueError(f"unknown decay schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    return SCHEDULES[name](heads, layer, layers)


def head_decays(heads: int) -> np.ndarray:
    """Per-head lambda_h = exp(-2^(-8 (h+1) / heads)): the ALiBi-style slopes of the original LA-2 tests."""
    slopes = 2.0 ** (-8.0 * (np.arange(heads) + 1) / heads)
    return np.exp(-slopes)
