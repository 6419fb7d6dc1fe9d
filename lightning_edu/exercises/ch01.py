"""Checks for the exercises of chapter 01 (linear attention and the kernel trick)."""

from __future__ import annotations

import sys
import time

import numpy as np

from ..checks import random_qkv, relative_error, to_numpy
from ..measure import peak_memory_numpy
from ..numpy_reference import elu_plus_one, linear_attention_right
from ._core import ExerciseError, exercise, expect_close, expect_shape, passed, seeded

__all__ = ["check_right_product", "check_flop_counts", "check_normalized_linear_attention"]

# Odd shapes on purpose: n not a power of two, d_k != d_v, several heads, and n = 1.
_SHAPES = [(1, 2, 37, 5, 3), (2, 3, 7, 4, 6), (1, 1, 1, 3, 2), (1, 2, 130, 8, 8)]


def _best_seconds(fn, *args, repeat: int = 3, patient: bool = False) -> float:
    """The least CPU time of the calling thread over ``repeat`` calls (``time.thread_time``), with BLAS and torch
    held to one thread so that all of a call's work is done in it; unless ``patient``, the first call that takes
    over 0.1 s ends the timing (spare the reader a second wait). CPU time, not wall time, because graders share
    machines: another process's load stretches a call's wall time by any factor, never the work the call does.
    The calling thread's, not the process's: the check's own threads (each call's time limit has one) do work
    of their own while the reader's function runs."""
    from threadpoolctl import threadpool_limits

    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None
    best = float("inf")
    try:
        if torch is not None:
            torch.set_num_threads(1)
        with threadpool_limits(limits=1, user_api="blas"):
            for _ in range(repeat):
                start = time.thread_time()
                fn(*args)
                best = min(best, time.thread_time() - start)
                if best > 0.1 and not patient:
                    break
    finally:
        if torch is not None:
            torch.set_num_threads(threads)
    return best


# Work, not memory: a loop over the rows (or blocks of rows) of Q, each multiplied by all of K, never holds an
# n x n matrix but still does n^2 work. Timed at two lengths 64 times apart: Q (K^T V) takes at most ~64 times
# longer (less, as fixed costs dominate at the short one), n^2 work ~4096 times, less the loop's fixed cost per
# row. d = 16 makes each row's work at the long length outweigh that fixed cost. The line sits between the
# ratios row loops (of the left product, of the normalised weights) and linear answers measure in a check's
# process, loaded or not, with room on both sides; a linear answer also stays under _TIME_FLOOR at the long
# length. tests/exercises/test_exercise_messages.py holds both sides.
_TIME_LENGTHS = (256, 16384)
_TIME_D = 16
_TIME_RATIO = 200.0
_TIME_FLOOR = 0.02  # seconds at the long length below which nothing is called quadratic
# Calls timed at the short length, the least kept. There a call costs a few milliseconds and the ratio is most
# sensitive to it: a call slowed by another process (a cache it emptied) lowers the ratio, the least of many
# is the call's floor.
_SHORT_REPEATS = 30


_MEMORY_N, _MEMORY_D = 2048, 4  # the shape (n, d) at which the memory checks of 1.1 and 1.3 look for an n x n matrix


def _no_n_by_n(name: str, fn, seed: int, hint: str) -> tuple[int, int]:
    """Refuse an answer with the right values whose peak memory shows an n x n matrix: at n = 2048 a float64 one
    is 32 MiB, while the right product's intermediates are d_k x d_v and the output n x d_v. Returns (n, the
    limit in bytes: a quarter of that matrix)."""
    n, d = _MEMORY_N, _MEMORY_D
    q, k, v = random_qkv(1, 1, n, d, seed=seed)
    peak = peak_memory_numpy(lambda: fn(q, k, v))
    limit = 8 * n * n // 4
    if peak > limit:
        raise ExerciseError(
            f"{name} gives the right numbers but allocated {peak / 2**20:.1f} MiB at n = {n}, d = {d}: that is an "
            f"n x n matrix ({n * n * 8 / 2**20:.0f} MiB in float64). {hint}"
        )
    return n, limit


def _linear_time(name: str, fn, seed: int, hint: str) -> None:
    """Refuse ``fn`` whose time grows like n^2: a loop over the rows of Q, each against all of K, needs no n x n
    matrix (so the memory check passes) and still does the left product's work."""
    short, long = (random_qkv(1, 1, length, _TIME_D, seed=seed) for length in _TIME_LENGTHS)
    t_short, t_long = _best_seconds(fn, *short, repeat=_SHORT_REPEATS), _best_seconds(fn, *long)

    def quadratic(t_long):
        return t_long > _TIME_FLOOR and t_long / max(t_short, 1e-6) > _TIME_RATIO

    if quadratic(t_long):
        # CPU time is not stretched by another process's load, but one call can still cost more than its work
        # (its first touch of memory, a cache another process emptied). Before calling it quadratic, the best
        # of three more calls (a quadratic answer keeps its ratio in every one of them).
        t_long = min(t_long, _best_seconds(fn, *long, repeat=3, patient=True))
    if quadratic(t_long):
        ratio = t_long / max(t_short, 1e-6)
        n_short, n_long = _TIME_LENGTHS
        raise ExerciseError(
            f"{name} gives the right numbers in little memory, but its time grows like n^2: {t_short * 1e3:.2g} ms "
            f"at n = {n_short} and {t_long * 1e3:.3g} ms at n = {n_long} ({n_long // n_short} times the tokens, "
            f"{ratio:.0f} times the time). A loop over the rows (or blocks of rows) of Q that multiplies each by all of K "
            f"is the left product done piece by piece: n^2 work even without the n x n matrix. {hint}"
        )


@exercise("1.1", reveals=("linear_attention_right",))
def check_right_product(right_product, seed: int = 0) -> None:
    """``right_product(q, k, v)`` must compute Q (K^T V) for (batch, heads, n, d) arrays without an n x n matrix."""
    for i, (b, h, n, dk, dv) in enumerate(_SHAPES):
        q, k, v = random_qkv(b, h, n, dk, dv, seed=10 + i + seed)
        try:
            got = right_product(q, k, v)
        except ValueError as exc:
            raise ExerciseError(
                f"right_product raised ValueError on q {q.shape}, v {v.shape}: {exc}. Hint: transpose only the "
                "last two axes, k.swapaxes(-1, -2); k.T reverses all four axes of a (batch, heads, n, d_k) array"
            ) from exc
        expect_close(
            f"right_product on q {q.shape}, v {v.shape}",
            got,
            linear_attention_right(q, k, v),
            rtol=1e-9,
            hint="o = q (k^T v): contract k and v over the sequence axis first, giving a (d_k, d_v) matrix per head",
        )
    # Same output as the left product, so only memory can tell the two orders apart
    n, limit = _no_n_by_n("right_product", right_product, 99 + seed,
                          "You computed (Q K^T) V; bracket it as Q (K^T V) so the only intermediate is d_k x d_v")
    _linear_time("right_product", right_product, 98 + seed, "Form K^T V once (d_k x d_v), then Q (K^T V)")
    # The exact peak varies by a KiB with numpy's allocator; the message states the bound it met.
    passed(f"right_product matches linear_attention_right on {len(_SHAPES)} shapes and needs under "
                  f"{limit / 2**20:.0f} MiB at n = {n} (an n x n matrix would take {n * n * 8 / 2**20:.0f} MiB)")


def _reference_flops(n: int, d_k: int, d_v: int) -> tuple[int, int]:
    # A (a x b) @ (b x c) product costs a*c dot products of length b: 2*a*b*c FLOPs (one multiply + one add each).
    left = 2 * n * d_k * n + 2 * n * n * d_v  # Q K^T, then (n x n) V
    right = 2 * d_k * n * d_v + 2 * n * d_k * d_v  # K^T V, then Q (d_k x d_v)
    return left, right


@exercise("1.2")
def check_flop_counts(flop_counts, seed: int = 0) -> None:
    """``flop_counts(n, d_k, d_v)`` must return (left_flops, right_flops), counting a multiply-add as 2 FLOPs."""
    cases = [(37, 5, 3), (1, 4, 4), (4096, 64, 64), (130, 16, 24), (1000, 128, 64)]
    if seed:  # other sizes of the same kinds: d_k != d_v, n = 1, d_k = d_v
        rng = seeded(seed)
        n1, n2, n3, n4 = (int(x) for x in rng.integers(2, 8192, 4))
        d = [int(x) for x in rng.integers(2, 257, 6)]
        cases = [(n1, d[0], d[0] + 1 + d[1] % 7), (1, d[2], d[2]), (n2, d[3], d[3]), (n3, d[4], d[4] + 8),
                 (n4, d[5] + 16, d[5])]
    for n, dk, dv in cases:
        got = flop_counts(n, dk, dv)
        if got is None:
            raise ExerciseError("flop_counts returned None -- did you forget `return left, right`?")
        try:
            left, right = (int(round(float(x))) for x in got)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ExerciseError(f"flop_counts must return two finite numbers (left, right), got {got!r}") from exc
        want_left, want_right = _reference_flops(n, dk, dv)
        where = f"at n = {n}, d_k = {dk}, d_v = {dv}"
        if (left, right) == (want_left, want_right):
            continue
        if (left, right) == (want_right, want_left):
            raise ExerciseError(f"the two counts are swapped {where}: the LEFT product (Q K^T) V is the one with n^2")
        if left == want_left // 2 or right == want_right // 2:
            raise ExerciseError(
                f"a count is half the expected value {where} (got left {left}, right {right}): count a "
                "multiply-add as 2 FLOPs, so (a x b) @ (b x c) costs 2*a*b*c"
            )
        if dk != dv and (left == 4 * n * n * dk or left == 4 * n * n * dv or right in (4 * n * dk * dk, 4 * n * dv * dv)):
            raise ExerciseError(
                f"wrong count {where} (got left {left}, right {right}): d_k and d_v differ here; Q K^T contracts "
                "over d_k, (Q K^T) V produces d_v columns, K^T V is d_k x d_v"
            )
        if left != want_left:
            raise ExerciseError(
                f"left count {left} {where}, expected {want_left}: (Q K^T) costs 2 n^2 d_k, then (n x n) @ (n x d_v) "
                "costs 2 n^2 d_v"
            )
        raise ExerciseError(
            f"right count {right} {where}, expected {want_right}: K^T V costs 2 n d_k d_v, then "
            "Q @ (d_k x d_v) costs another 2 n d_k d_v"
        )
    passed(f"flop counts right on {len(cases)} sizes (left 2n^2(d_k+d_v), right 4n d_k d_v)")


@exercise("1.3", allowed=("lightning_edu.numpy_reference.elu_plus_one",))
def check_normalized_linear_attention(normalized_linear_attention, seed: int = 0) -> None:
    """``normalized_linear_attention(q, k, v)``: phi(q_i) S / (phi(q_i) z) with phi = elu + 1, S = phi(K)^T V, z = sum phi(k_j)."""
    for i, (b, h, n, dk, dv) in enumerate(_SHAPES):
        q, k, v = random_qkv(b, h, n, dk, dv, seed=20 + i + seed)
        pq, pk = elu_plus_one(q), elu_plus_one(k)
        numerator = linear_attention_right(pq, pk, v)
        denominator = linear_attention_right(pq, pk, np.ones(v.shape[:-1] + (1,)))
        ref = numerator / denominator
        name = f"normalized_linear_attention on q {q.shape}, v {v.shape}"
        got = expect_shape(name, normalized_linear_attention(q, k, v), ref.shape)
        if relative_error(got, ref) <= 1e-9:
            continue
        if n > 1 and relative_error(got, numerator) <= 1e-9:
            raise ExerciseError(f"{name} equals the numerator phi(Q)(phi(K)^T V) alone: divide each row i by phi(q_i) . z, z = sum_j phi(k_j)")
        plain = linear_attention_right(q, k, v) / linear_attention_right(q, k, np.ones(v.shape[:-1] + (1,)))
        if relative_error(got, plain) <= 1e-9:
            raise ExerciseError(f"{name} matches the formula without the feature map: apply phi = elu_plus_one to q and k first")
        expect_close(name, to_numpy(got), ref, rtol=1e-9,
                     hint="the denominator of row i is phi(q_i) . sum_j phi(k_j), one number per row, broadcast over d_v")
    # The exercise asks for the right product: no n x n matrix. As in 1.1, memory tells the orders apart.
    n, limit = _no_n_by_n("normalized_linear_attention", normalized_linear_attention, 97 + seed,
                          "The n x n matrix is the weights phi(Q) phi(K)^T. Form S = phi(K)^T V and z = sum_j phi(k_j) "
                          "first; then row i is phi(q_i) S / (phi(q_i) . z)")
    _linear_time("normalized_linear_attention", normalized_linear_attention, 96 + seed,
                 "Form S = phi(K)^T V and z = sum_j phi(k_j) once, then divide phi(Q) S row by row by phi(Q) z")
    passed(f"normalized linear attention matches on {len(_SHAPES)} shapes, needs under {limit / 2**20:.0f} MiB at "
           f"n = {n} and linear time; its rows are convex combinations of v")

