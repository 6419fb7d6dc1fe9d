"""Multi-query associative recall (MQAR): can the model look a value up by its key?

The task of the Zoology paper ("Zoology: Measuring and Improving Recall in Efficient Language Models", Arora
et al. 2023), used again in "Simple linear attention language models balance the recall-throughput tradeoff"
(Based). Each sequence opens with ``pairs`` key-value pairs; later, each key comes back once as a query, and the
model must predict, at the query's position, the value that followed that key. Softmax attention can look
back exactly; a linear attention must fit every pair into its fixed-size state, so its accuracy shows how
much it can recall.

The layout used here, for ``vocab`` tokens (Zoology's, but for the filler)::

    token 0                         filler (between the queries)
    tokens 1 .. K                   keys,   K = (vocab - 1) // 2
    tokens K + 1 .. vocab - 1       values

    inputs:   k1 v1 k2 v2 ... kp vp | 0 0 k3 0 k1 0 0 k2 ... (each key once, at random places, random order)
    targets: -100 everywhere except at the query positions, which hold the key's value

Why this way:

* **Keys and values from disjoint halves of the vocabulary.** A token's identity alone then says whether it
  is a key or a value, so the model need not work that out from its position.
* **Distinct keys and distinct values** within a sequence (drawn without replacement, as Zoology does). Each
  query then has one answer, and "guess one of the values in the sequence" scores exactly 1/pairs: the
  plateau a model sits on before it learns recall.
* **The loss only at the queries.** Everything else in the sequence is random (the pairs) or filler, and
  cannot be predicted; training on it would only add noise. The targets sit at the query itself, not the
  next position: a causal language model's logits at position t predict token t + 1, and the value is what
  should come after the query.
* **Queries spread uniformly** over the rest of the sequence (Zoology draws the gaps from a power law that
  puts most queries just after the pairs; uniform gaps ask for recall over the whole context).

Solving it takes two steps, which is why the models have two layers: one layer copies each key into the
position of the value that follows it (a "previous-token" head: softmax can find the previous token through
RoPE, lightning through the decay of its heads), and the next layer lets the query attend to the position
whose copied key matches and read the value there (an induction head). Zoology's models get the first step
for free from a short convolution in every layer; ours must learn it, which makes the training recipe matter
(:func:`lightning_edu.models.quality.mqar_run` and the notes under :data:`lightning_edu.models.quality.PRESETS`).
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from ..validation import validate_int

__all__ = ["IGNORE_INDEX", "mqar_batch", "mqar_batches"]

IGNORE_INDEX = -100
"""The target of positions that carry no question (``torch.nn.functional.cross_entropy`` skips it)."""


def _check(batch, seq_len, pairs, vocab) -> tuple[int, int, int, int]:
    batch, seq_len, pairs, vocab = (validate_int(n, v, 1) for n, v in
                                    (("batch", batch), ("seq_len", seq_len), ("pairs", pairs), ("vocab", vocab)))
    n_keys = (vocab - 1) // 2  # the values, vocab - 1 - n_keys of them, are at least as many
    if n_keys < pairs:
        raise ValueError(f"vocab={vocab} is too small for {pairs} distinct keys: keys are tokens 1..(vocab-1)//2, "
                         f"so vocab must be >= {2 * pairs + 1}")
    if seq_len < 3 * pairs:
        raise ValueError(f"seq_len={seq_len} is too short: {pairs} pairs and {pairs} queries need at least "
                         f"{3 * pairs} tokens")
    return batch, seq_len, pairs, vocab


def _distinct(rng: np.random.Generator, batch: int, n: int, k: int) -> np.ndarray:
    """(batch, k): in each row, k distinct integers of 0..n-1 in random order.

    For a small n, the first k of a random permutation of each row (one vectorised argsort); for a large n (a
    vocabulary of thousands), numpy's choice without replacement row by row, which draws only k numbers a row
    and is then several times faster.
    """
    if n <= 1024:
        return rng.random((batch, n)).argsort(axis=1)[:, :k]
    return np.stack([rng.choice(n, size=k, replace=False) for _ in range(batch)])


def _sample(rng: np.random.Generator, batch: int, seq_len: int, pairs: int, vocab: int):
    n_keys = (vocab - 1) // 2
    keys = 1 + _distinct(rng, batch, n_keys, pairs)
    values = 1 + n_keys + _distinct(rng, batch, vocab - 1 - n_keys, pairs)
    inputs = np.zeros((batch, seq_len), dtype=np.int64)
    targets = np.full((batch, seq_len), IGNORE_INDEX, dtype=np.int64)
    inputs[:, 0:2 * pairs:2], inputs[:, 1:2 * pairs:2] = keys, values
    # the queries: `pairs` distinct places after the pairs (increasing), each asking one key (in random order)
    where = 2 * pairs + np.sort(_distinct(rng, batch, seq_len - 2 * pairs, pairs), axis=1)
    order = _distinct(rng, batch, pairs, pairs)
    rows = np.arange(batch)[:, None]
    inputs[rows, where] = np.take_along_axis(keys, order, axis=1)
    targets[rows, where] = np.take_along_axis(values, order, axis=1)
    return torch.from_numpy(inputs), torch.from_numpy(targets)


def mqar_batch(batch: int, seq_len: int, pairs: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One MQAR batch: (inputs, targets), int64 tensors of shape (batch, seq_len); the same for the same seed.

    See the module's docstring for the layout. Needs vocab >= 2 pairs + 1 (enough distinct keys and values)
    and seq_len >= 3 pairs (the pairs, then one query per key); otherwise a ValueError.
    """
    batch, seq_len, pairs, vocab = _check(batch, seq_len, pairs, vocab)
    return _sample(np.random.default_rng(validate_int("seed", seed, 0)), batch, seq_len, pairs, vocab)


def mqar_batches(batch: int, seq_len: int, pairs: int, vocab: int, seed: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """An endless stream of fresh MQAR batches from one generator seeded with ``seed`` (for training).

    Every batch is new: the model never sees a sequence twice, so what it learns is the lookup, not the data.
    The arguments are checked by this call, as :func:`mqar_batch` checks them, not at the first ``next()``.
    """
    batch, seq_len, pairs, vocab = _check(batch, seq_len, pairs, vocab)
    rng = np.random.default_rng(validate_int("seed", seed, 0))
    return _stream(rng, batch, seq_len, pairs, vocab)


def _stream(rng: np.random.Generator, batch: int, seq_len: int, pairs: int, vocab: int):
    while True:
        yield _sample(rng, batch, seq_len, pairs, vocab)
