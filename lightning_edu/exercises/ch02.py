"""Checks for the exercises of chapter 02 (causal linear attention and the cumsum bottleneck)."""

from __future__ import annotations

import numpy as np

from ..checks import random_qkv, relative_error
from ..numpy_reference import causal_linear_recurrent, linear_attention_right
from ._core import ExerciseError, exercise, expect_close, expect_count, expect_shape, passed, reader_lines, seeded

__all__ = ["check_causal_recurrent", "check_doubling_scan", "check_cumsum_bytes"]

_SHAPES = [(1, 2, 37, 5, 3), (2, 1, 7, 4, 6), (1, 1, 1, 3, 2), (1, 2, 130, 6, 6)]


def _shifted_by_one(q, k, v, decay=1.0):
    # The "exclusive" variant: o_t reads KV_{t-1}, the state before token t was added.
    o = np.zeros(q.shape[:-1] + (v.shape[-1],))
    lam = np.broadcast_to(np.asarray(decay, dtype=np.float64), (q.shape[1],))
    if q.shape[2] > 1:
        prev = causal_linear_recurrent(q[:, :, 1:], k[:, :, :-1], v[:, :, :-1], lam)
        o[:, :, 1:] = prev * lam[None, :, None, None]
    return o


@exercise("2.1", reveals=("causal_linear_recurrent",))
def check_causal_recurrent(causal_recurrent, seed: int = 0) -> None:
    """``causal_recurrent(q, k, v)``: o_t = q_t KV_t with KV_t = KV_{t-1} + k_t^T v_t, for (batch, heads, n, d) arrays."""
    for i, (b, h, n, dk, dv) in enumerate(_SHAPES):
        q, k, v = random_qkv(b, h, n, dk, dv, seed=30 + i + seed)
        ref = causal_linear_recurrent(q, k, v)
        name = f"causal_recurrent on q {q.shape}, v {v.shape}"
        got = expect_shape(name, causal_recurrent(q, k, v), ref.shape)
        if relative_error(got, ref) <= 1e-9:
            continue
        if n > 1 and relative_error(got, linear_attention_right(q, k, v)) <= 1e-9:
            raise ExerciseError(
                f"{name} equals NON-causal attention Q (K^T V): every o_t saw all n tokens. The state KV_t may "
                "only hold k_s^T v_s for s <= t: accumulate it inside the loop over t"
            )
        if n > 1 and relative_error(got, _shifted_by_one(q, k, v)) <= 1e-9:
            raise ExerciseError(
                f"{name} reads the state before adding token t: o_t = q_t KV_t includes k_t^T v_t itself "
                "(the mask keeps the diagonal). Update KV first, then read it"
            )
        expect_close(name, got, ref, rtol=1e-9, hint="KV_t = KV_{t-1} + outer(k_t, v_t), a (d_k, d_v) matrix per head; o_t = q_t KV_t")
    passed(f"causal_recurrent matches causal_linear_recurrent on {len(_SHAPES)} shapes, n = 1 included")


@exercise("2.2", reveals=("causal_linear_cumsum",))
def check_doubling_scan(doubling_scan, seed: int = 0) -> None:
    """``doubling_scan(q, k, v, decay)``: causal linear attention with decay by the doubling (Hillis-Steele) scan.

    decay is one float per head, shape (heads,). The result must equal the recurrence KV_t = lambda KV_{t-1} + k_t^T v_t.
    """
    cases = [((1, 2, 37, 5, 3), [1.0, 0.9]), ((2, 3, 7, 4, 6), [0.5, 0.05, 1.0]), ((1, 1, 1, 3, 2), [0.7]), ((1, 2, 130, 4, 4), [0.99, 0.8])]
    if seed:  # fresh decays; a head with lambda = 1 stays in the first two cases
        rng = seeded(seed)
        cases = [(shape, [1.0 if (i < 2 and j == 0) else float(np.round(rng.uniform(0.05, 1.0), 3)) for j in range(len(d))])
                 for i, (shape, d) in enumerate(cases)]
    for i, (shape, decay) in enumerate(cases):
        b, h, n, dk, dv = shape
        q, k, v = random_qkv(b, h, n, dk, dv, seed=40 + i + seed)
        lam = np.array(decay)
        ref = causal_linear_recurrent(q, k, v, lam)
        name = f"doubling_scan on q {q.shape}, decay {decay}"
        got = expect_shape(name, doubling_scan(q, k, v, lam), ref.shape)
        if not np.all(np.isfinite(got)):
            raise ExerciseError(f"{name} has inf or NaN: form lambda**step (a non-negative power), never lambda**-step")
        if relative_error(got, ref) <= 1e-9:
            continue
        if n > 1 and relative_error(got, causal_linear_recurrent(q, k, v)) <= 1e-9:
            raise ExerciseError(f"{name} ignores the decay: in the step of stride s, the state from s tokens back is scaled by lambda**s")
        per_head = [relative_error(got[:, j], ref[:, j]) for j in range(h)]
        bad = [f"head {j} (lambda = {decay[j]})" for j in range(h) if per_head[j] > 1e-9]
        good = [f"head {j} (lambda = {decay[j]})" for j in range(h) if per_head[j] <= 1e-9]
        if good and bad:
            raise ExerciseError(
                f"{name}: {', '.join(good)} right, {', '.join(bad)} wrong. If the heads with lambda = 1 pass, scale the "
                "shifted states by lambda**stride (not lambda); broadcast decay over the head axis as decay[None, :, None, None, None]"
            )
        expect_close(name, got, ref, rtol=1e-9,
                     hint="read the shifted states BEFORE updating (copy them), or the step adds already-updated states")
    # The values are right; now the steps. At n = 1024 the scan takes ceil(log2 n) = 10 steps, a few lines each; a
    # loop over the tokens runs at least one line per token.
    n = 1024
    q, k, v = random_qkv(1, 1, n, 2, 2, seed=45 + seed)
    got, lines = reader_lines(lambda: doubling_scan(q, k, v, np.array([0.9])))
    expect_close(f"doubling_scan on q {q.shape}", expect_shape(f"doubling_scan on q {q.shape}", got, (1, 1, n, 2)),
                 causal_linear_recurrent(q, k, v, np.array([0.9])), rtol=1e-9)
    if lines > 400:
        raise ExerciseError(
            f"doubling_scan gives the right values, but at n = {n} your code ran {lines} lines of Python: a loop over "
            f"the tokens (or over pairs of them), not the doubling scan's ceil(log2 n) = 10 steps. In each step, "
            "update every position at once: states[:, :, s:] += lambda**s * states[:, :, :-s] (copied first), then s *= 2"
        )
    passed(f"doubling scan matches the recurrence on {len(cases) + 1} shapes with per-head decay, in a few steps at "
           f"n = {n}, not one per token")


@exercise("2.3")
def check_cumsum_bytes(cumsum_bytes, seed: int = 0) -> None:
    """``cumsum_bytes(n, d_k, d_v, heads, bytes_per_element)``: bytes of the materialised prefix states (all n of them)."""
    cases = [(65536, 128, 128, 1, 8), (65536, 128, 128, 32, 2), (37, 5, 3, 2, 4), (4096, 64, 32, 8, 4)]
    if seed:  # other sizes of the same kinds: one head, many heads, d_k != d_v
        rng = seeded(seed)
        n = [int(x) for x in rng.integers(1, 2**17, 4)]
        d = [int(x) for x in rng.integers(2, 257, 6)]
        cases = [(n[0], d[0], d[0], 1, 8), (n[1], d[1], d[1], int(rng.integers(2, 65)), 2),
                 (n[2], d[2], d[3], int(rng.integers(2, 9)), 4), (n[3], d[4], d[5], int(rng.integers(2, 33)), 4)]
    for n, dk, dv, h, e in cases:
        want = n * dk * dv * h * e
        where = f"n = {n}, d_k = {dk}, d_v = {dv}, heads = {h}, {e} bytes per element"
        got = expect_count(f"cumsum_bytes for {where}", cumsum_bytes(n, dk, dv, h, e), what="a byte count")
        if got == want:
            continue
        if h > 1 and got == want // h:
            raise ExerciseError(f"{got} bytes for {where}: every head keeps its own n prefix states; multiply by heads")
        if e > 1 and got == want // e:
            raise ExerciseError(f"{got} for {where}: that counts elements; multiply by bytes_per_element to get bytes")
        if got == n * dk * h * e or got == n * dv * h * e:
            raise ExerciseError(f"{got} bytes for {where}: each prefix state KV_t is a d_k x d_v MATRIX, not a vector")
        raise ExerciseError(f"{got} bytes for {where}, expected {want}: n states of d_k x d_v elements per head")
    passed("cumsum memory right: n * d_k * d_v * heads * bytes (8 GiB for one head at n = 64K, d = 128, float64)")
