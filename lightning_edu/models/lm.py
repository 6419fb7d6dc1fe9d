"""A byte-level language-modelling task on text every Python installation carries: no download, no network.

The corpus is the Python reference documentation that CPython ships as ``pydoc_data.topics`` (the text
``help("with")`` prints): about 80 topics, about half a million bytes of English prose with code examples.
Each Python version ships its own edition (3.11's holds 466 thousand bytes, 3.12's 500 thousand), so the
corpus is that of the Python running the code; recorded runs name their Python version.
Each byte is a token (vocabulary 256), so no tokenizer is needed and every model sees the same tokens.

The topics are sorted by name and joined with blank lines; the first 90 % of the bytes are for training, the
last 10 % (whole topics, never seen in training) for validation. Loss is in nats per byte; perplexity is
e^loss per byte (bits per byte = loss / ln 2).
"""

from __future__ import annotations

import math
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..validation import validate_int

__all__ = ["VOCAB", "corpus_bytes", "split_corpus", "lm_batches", "evaluate_lm", "perplexity"]

VOCAB = 256
"""One token per byte."""


def corpus_bytes() -> np.ndarray:
    """The corpus as uint8: every topic of ``pydoc_data.topics``, sorted by name, joined by blank lines (UTF-8)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[name].strip() for name in sorted(topics))
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()


def split_corpus(data: np.ndarray | None = None, valid_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """(train, valid): the first ``1 - valid_fraction`` of the bytes and the rest. ``data`` defaults to the corpus."""
    data = corpus_bytes() if data is None else np.asarray(data, dtype=np.uint8)
    if not 0 < valid_fraction < 1:
        raise ValueError(f"valid_fraction must lie in (0, 1), got {valid_fraction!r}")
    cut = int(round(len(data) * (1 - valid_fraction)))
    return data[:cut], data[cut:]


def lm_batches(data: np.ndarray, batch: int, seq_len: int, seed: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (inputs, targets) pairs, int64 (batch, seq_len): windows at random offsets, targets shifted by one."""
    batch, seq_len = validate_int("batch", batch, 1), validate_int("seq_len", seq_len, 1)
    if len(data) < seq_len + 1:
        raise ValueError(f"data holds {len(data)} bytes, too few for windows of seq_len + 1 = {seq_len + 1}")
    rng = np.random.default_rng(validate_int("seed", seed, 0))
    while True:
        starts = rng.integers(0, len(data) - seq_len, size=batch)  # every window of seq_len + 1 bytes
        window = np.stack([data[s:s + seq_len + 1] for s in starts]).astype(np.int64)
        yield torch.from_numpy(window[:, :-1]), torch.from_numpy(window[:, 1:])


@torch.no_grad()
def evaluate_lm(model: nn.Module, data: np.ndarray, seq_len: int, batch: int = 16, max_windows: int | None = None,
                autocast_dtype: torch.dtype | None = None) -> float:
    """Mean cross-entropy (nats per byte) of ``model`` over ``data`` cut into consecutive windows of ``seq_len``.

    Windows do not overlap, so each byte is predicted once (from at most ``seq_len - 1`` bytes of context);
    ``max_windows`` caps their number (the first ones). The model runs in eval mode and is left in the mode it
    was in.
    """
    seq_len, batch = validate_int("seq_len", seq_len, 2), validate_int("batch", batch, 1)
    n_windows = (len(data) - 1) // seq_len
    if max_windows is not None:
        n_windows = min(n_windows, validate_int("max_windows", max_windows, 1))
    if n_windows < 1:
        raise ValueError(f"data holds {len(data)} bytes, too few for one window of {seq_len} + 1")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    windows = np.stack([data[i * seq_len:(i + 1) * seq_len + 1] for i in range(n_windows)]).astype(np.int64)
    for i in range(0, n_windows, batch):
        chunk = torch.from_numpy(windows[i:i + batch]).to(device)
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            logits = model(chunk[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), chunk[:, 1:].flatten(), reduction="sum")
        total, count = total + float(loss), count + chunk[:, 1:].numel()
    model.train(was_training)
    return total / count


def perplexity(loss: float) -> float:
    """e^loss: the perplexity per byte of a loss in nats per byte."""
    return math.exp(loss)
