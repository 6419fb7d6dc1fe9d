"""Multi-query associative recall (MQAR): can the model look a value up by its key?

The task of the Zoology paper ("Zoology: Measuring and Improving Recall in Efficient Language Models"),
used again in "Simple linear attention language models balance the recall-throughput tradeoff" (Based).
Each sequence opens with ``pairs`` key-value pairs; later, each key comes back once as a query, and the
model must predict, at the query's position, the value that followed that key. Softmax attention can look
back exactly; a linear attention must fit every pair into its fixed-size state, so its accuracy shows how
much it can recall.

The layout used here, for ``vocab`` tokens::

    token 0                         filler (between the queries)
    tokens 1 .. K                   keys,   K = (vocab - 1) // 2
    tokens K + 1 .. vocab - 1       values

    inputs:   k1 v1 k2 v2 ... kp vp | 0 0 k3 0 k1 0 0 k2 ... (each key once, at random places, random order)
    targets: -100 everywhere except at the query positions, which hold the key's value

Keys are distinct within a sequence (drawn without replacement); values are drawn with replacement.
Targets sit at the query itself (not the next position): a causal language model's logits at position t
predict token t + 1, and the value is what should come after the query.
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
    n_keys = (vocab - 1) // 2
    if n_keys < pairs or vocab - 1 - n_keys < 1:
        raise ValueError(f"vocab={vocab} is too small for {pairs} distinct keys: keys are tokens 1..(vocab-1)//2, "
                         f"so vocab must be >= {2 * pairs + 1}")
    if seq_len < 3 * pairs:
        raise ValueError(f"seq_len={seq_len} is too short: {pairs} pairs and {pairs} queries need at least "
                         f"{3 * pairs} tokens")
    return batch, seq_len, pairs, vocab


def _sample(rng: np.random.Generator, batch: int, seq_len: int, pairs: int, vocab: int):
    n_keys = (vocab - 1) // 2
    keys = np.stack([rng.choice(n_keys, size=pairs, replace=False) for _ in range(batch)]) + 1
    values = rng.integers(n_keys + 1, vocab, size=(batch, pairs))
    inputs = np.zeros((batch, seq_len), dtype=np.int64)
    targets = np.full((batch, seq_len), IGNORE_INDEX, dtype=np.int64)
    inputs[:, 0:2 * pairs:2], inputs[:, 1:2 * pairs:2] = keys, values
    for b in range(batch):
        where = 2 * pairs + np.sort(rng.choice(seq_len - 2 * pairs, size=pairs, replace=False))
        order = rng.permutation(pairs)
        inputs[b, where], targets[b, where] = keys[b, order], values[b, order]
    return torch.from_numpy(inputs), torch.from_numpy(targets)


def mqar_batch(batch: int, seq_len: int, pairs: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One MQAR batch: (inputs, targets), int64 tensors of shape (batch, seq_len); the same for the same seed.

    See the module's docstring for the layout. Needs vocab >= 2 pairs + 1 (enough distinct keys and at least
    one value) and seq_len >= 3 pairs (the pairs, then one query per key); otherwise a ValueError.
    """
    batch, seq_len, pairs, vocab = _check(batch, seq_len, pairs, vocab)
    return _sample(np.random.default_rng(validate_int("seed", seed, 0)), batch, seq_len, pairs, vocab)


def mqar_batches(batch: int, seq_len: int, pairs: int, vocab: int, seed: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """An endless stream of fresh MQAR batches from one generator seeded with ``seed`` (for training)."""
    batch, seq_len, pairs, vocab = _check(batch, seq_len, pairs, vocab)
    rng = np.random.default_rng(validate_int("seed", seed, 0))
    while True:
        yield _sample(rng, batch, seq_len, pairs, vocab)
