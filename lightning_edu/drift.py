"""How far a float32 state drifts over a million tokens, and what a compensated or float64 state changes.
(Chapter 10.)

    python -m benchmarks.drift OUT.json [TOKENS]       # TOKENS defaults to 2**20

records one :func:`state_drift` run (under ``results``) for every distribution, decay (1 and 0.999), input
dtype, update and state, with the machine, versions and commit.

The state S_t = lambda S_{t-1} + k_t^T v_t is a running sum: every update rounds it, and at lambda = 1 nothing
ever forgets those roundings. :func:`state_drift` runs the recurrence in a chosen precision and measures its
relative error against float64 as the sequence grows:

* ``update="token"``: one update per token, as a decode loop does (:func:`lightning_attention_step`);
* ``update="block"``: one update per block of ``block`` tokens, S = lambda^B S + (Lambda K)^T V with the block's
  sum formed by a matrix product, as the chunked forward kernels do. n / B roundings of S instead of n.

``state`` is ``"float32"``, ``"kahan"`` (float32 with a compensation term: Kahan summation, twice the bytes)
or ``"float64"``. The inputs are drawn in float64 and rounded to ``inputs`` ("float32" or "bfloat16") first;
the float64 reference runs on the same rounded inputs (and the same float32 lambda), in blocks of twice
``block``, so the error counts the state's arithmetic only. Inputs come in pieces of :data:`PIECE` tokens, each
from its own seeded generator: a shorter run sees exactly the first tokens of a longer one.
"""

from __future__ import annotations

import math
import time

import numpy as np

__all__ = ["PIECE", "DISTRIBUTIONS", "STATES", "UPDATES", "state_drift"]

PIECE = 8192
DISTRIBUTIONS = ("zero-mean", "positive")
STATES = ("float32", "kahan", "float64")
UPDATES = ("token", "block")
_QUERIES = 16


def _round(x: np.ndarray, dtype: str) -> np.ndarray:
    """x rounded to ``dtype`` and returned as float32 (bfloat16 values are float32 values)."""
    if dtype == "float32":
        return x.astype(np.float32)
    if dtype == "bfloat16":
        import torch

        return torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16).to(torch.float32).numpy()
    raise ValueError(f"inputs must be 'float32' or 'bfloat16', got {dtype!r}")


def _piece(index: int, d: int, distribution: str, inputs: str, seed: int):
    """k, v of PIECE tokens: "zero-mean" standard normal / sqrt(d); "positive" keys through elu + 1 (a
    feature map's positive keys, chapter 11) and values with mean 1, so that the state grows like n."""
    rng = np.random.default_rng([seed, index])
    k, v = rng.standard_normal((2, PIECE, d))
    if distribution == "positive":
        k = np.where(k > 0, k + 1.0, np.exp(k))
        v = v + 1.0
    return _round(k / math.sqrt(d), inputs), _round(v / math.sqrt(d), inputs)


def _check(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


class _Kahan:
    """S + C in float32: C carries what rounding took from S (Kahan summation; C is subtracted)."""

    def __init__(self, shape):
        self.s = np.zeros(shape, np.float32)
        self.c = np.zeros(shape, np.float32)

    def decay(self, lam):
        self.s *= lam
        self.c *= lam

    def add(self, x):
        y = x - self.c
        t = self.s + y
        self.c = (t - self.s) - y
        self.s = t

    def value(self):
        return self.s.astype(np.float64) - self.c.astype(np.float64)


def state_drift(n_tokens: int, decay: float = 1.0, *, inputs: str = "float32", state: str = "float32",
                update: str = "token", block: int = 64, d: int = 16, distribution: str = "zero-mean",
                points: int = 40, seed: int = 0) -> dict:
    """Relative error of the state (and of q S for 16 fixed queries) against float64, at ``points`` positions
    spaced geometrically up to ``n_tokens`` (multiples of 2 * block).

    Returns {"positions", "state_error", "output_error", "state_norm", "seconds", and the arguments}:
    errors are Frobenius-norm relative errors, state_norm the float64 state's Frobenius norm, seconds the
    time the recurrence under test took (the reference excluded).
    """
    _check("inputs", inputs, ("float32", "bfloat16"))
    _check("state", state, STATES)
    _check("update", update, UPDATES)
    _check("distribution", distribution, DISTRIBUTIONS)
    if not (0.0 < decay <= 1.0):
        raise ValueError(f"decay must be in (0, 1], got {decay}")
    if block < 1 or PIECE % (2 * block):
        raise ValueError(f"block must divide {PIECE // 2}, got {block}")
    n_tokens = int(n_tokens)
    if n_tokens < 2 * block:
        raise ValueError(f"n_tokens must be at least 2 * block = {2 * block}, got {n_tokens}")
    step = 2 * block
    positions = np.unique(np.geomspace(step, n_tokens, points).astype(np.int64) // step * step)
    lam32 = np.float32(decay)
    lam = float(lam32)  # the reference uses the float32 lambda: only the state's arithmetic is measured
    queries = np.random.default_rng([seed, 1 << 30]).standard_normal((_QUERIES, d))

    work_dtype = np.float64 if state == "float64" else np.float32
    kahan = _Kahan((d, d)) if state == "kahan" else None
    s = np.zeros((d, d), work_dtype)
    ref = np.zeros((d, d))

    def weights(length, dtype):
        """lambda^(B-1-j) for the rows of a block, and lambda^B, formed in float64 and rounded once."""
        w = lam ** np.arange(length - 1, -1, -1, dtype=np.float64)
        return w.astype(dtype)[:, None], dtype(lam ** length)

    ref_w, ref_decay = weights(step, np.float64)
    blk_w, blk_decay = weights(block, work_dtype)
    out = {"positions": [], "state_error": [], "output_error": [], "state_norm": []}
    seconds = 0.0
    done = 0
    next_point = 0
    for index in range(math.ceil(n_tokens / PIECE)):
        k, v = _piece(index, d, distribution, inputs, seed)
        length = min(PIECE, n_tokens - done)
        k, v = k[:length], v[:length]
        marks = [p - done for p in positions[next_point:] if p <= done + length]  # checkpoints in this piece
        start = time.perf_counter()
        snaps = {}
        if update == "block":
            kb, vb = k.astype(work_dtype), v.astype(work_dtype)
            for a in range(0, length, block):
                delta = (kb[a:a + block] * blk_w).T @ vb[a:a + block]
                if kahan is not None:
                    kahan.decay(blk_decay)
                    kahan.add(delta)
                else:
                    s = blk_decay * s + delta
                if a + block in marks:
                    snaps[a + block] = kahan.value() if kahan is not None else s.astype(np.float64)
        else:
            outer = k.astype(work_dtype)[:, :, None] * v.astype(work_dtype)[:, None, :]
            if kahan is None and lam == 1.0:  # a running sum: numpy's cumsum adds in order, one rounding per token
                run = np.cumsum(np.concatenate([s[None], outer]), axis=0, dtype=work_dtype)[1:]
                snaps = {m: run[m - 1].astype(np.float64) for m in marks}
                s = run[-1].copy()
            else:
                lam_w = work_dtype(lam)
                for t in range(length):
                    if kahan is not None:
                        kahan.decay(lam_w)
                        kahan.add(outer[t])
                    else:
                        s *= lam_w
                        s += outer[t]
                    if t + 1 in marks:
                        snaps[t + 1] = kahan.value() if kahan is not None else s.astype(np.float64)
        seconds += time.perf_counter() - start
        k64, v64 = k.astype(np.float64), v.astype(np.float64)
        for a in range(0, length, step):
            ref = ref_decay * ref + (k64[a:a + step] * ref_w).T @ v64[a:a + step]
            if a + step in snaps:
                got = snaps[a + step]
                norm = float(np.linalg.norm(ref))
                out["positions"].append(done + a + step)
                out["state_error"].append(float(np.linalg.norm(got - ref)) / norm)
                want = queries @ ref
                out["output_error"].append(float(np.linalg.norm(queries @ got - want) / np.linalg.norm(want)))
                out["state_norm"].append(norm)
        next_point += len(marks)
        done += length
    return {**out, "seconds": seconds, "n_tokens": n_tokens, "decay": decay, "inputs": inputs, "state": state,
            "update": update, "block": block, "d": d, "distribution": distribution, "seed": seed}
