"""Checks for the exercises of chapter 00 (how to read this book): sizes, one step of the recurrence, blocks."""

from __future__ import annotations

import math

import numpy as np

from ..numpy_blockwise import block_slices
from ..numpy_reference import causal_linear_recurrent
from ._core import ExerciseError, exercise, expect_array, expect_count, expect_shape, passed, seeded

__all__ = ["check_tensor_bytes", "check_state_step", "check_block_lengths"]


# ---------------------------------------------------------------- 0.1: bytes of a tensor


def _tensor_cases(seed: int = 0):
    import torch

    # (shape, dtype, bytes per element); the first is a realistic long-context activation.
    cases = [
        ((8, 32, 65536, 128), torch.bfloat16, 2),
        ((1, 2, 37, 5), torch.float32, 4),
        ((2, 3, 130, 7), torch.float16, 2),
        ((1, 1, 1, 1), torch.float64, 8),
        ((3, 5, 1000, 96), torch.bfloat16, 2),
    ]
    if seed:  # the same kinds of case, other sizes: a bf16 one first, then one of each dtype
        rng = seeded(seed)
        dtypes = [(torch.bfloat16, 2), (torch.float32, 4), (torch.float16, 2), (torch.float64, 8), (torch.bfloat16, 2)]
        cases = [(tuple(int(x) for x in rng.integers(1, [17, 65, 70000, 257])), dtype, size) for dtype, size in dtypes]
    return cases


@exercise("0.1")
def check_tensor_bytes(tensor_bytes, seed: int = 0) -> None:
    """``tensor_bytes(shape, dtype)``: bytes of a tensor of that shape and torch dtype (an int)."""
    for shape, dtype, itemsize in _tensor_cases(seed):
        elements = math.prod(shape)
        want = elements * itemsize
        got = tensor_bytes(shape, dtype)
        where = f"tensor_bytes({shape}, {dtype})"
        if got is None:
            raise ExerciseError(f"{where} returned None -- did you forget `return`?")
        if isinstance(got, (bool, np.bool_)) or not isinstance(got, (int, np.integer)):
            raise ExerciseError(f"{where} returned {got!r} of type {type(got).__name__}; a byte count is an int")
        got = int(got)
        if got == want:
            continue
        if got == elements:
            raise ExerciseError(f"{where} = {got} is the number of elements; multiply by the bytes per element ({itemsize} for {dtype})")
        if got == elements * itemsize * 8:
            raise ExerciseError(f"{where} = {got} counts bits; a byte is 8 bits, so divide by 8")
        if itemsize == 2 and got == elements * 4:
            raise ExerciseError(f"{where} = {got} uses 4 bytes per element; {dtype} is a 16-bit type: 2 bytes")
        raise ExerciseError(f"{where} = {got}, expected {want} ({elements} elements x {itemsize} bytes)")
    passed(f"byte counts right on {len(_tensor_cases())} shapes and dtypes; one bf16 (8, 32, 65536, 128) tensor is "
                  f"{8 * 32 * 65536 * 128 * 2 // 2**30} GiB")


# ---------------------------------------------------------------- 0.2: one step of the recurrence

# (batch, heads, d_k, d_v): d_k != d_v first, so a transposed outer product shows as a wrong shape.
_STEP_SHAPES = [(2, 3, 5, 3), (1, 3, 4, 4), (1, 1, 1, 6), (3, 2, 7, 2)]
_STEP_DECAYS = {3: np.array([1.0, 0.9, 0.05]), 2: np.array([0.5, 0.99]), 1: np.array([0.7])}


def _step_inputs(batch, heads, d_k, d_v, seed, offset=0):
    rng = np.random.default_rng(seed + offset)
    kv = rng.standard_normal((batch, heads, d_k, d_v))
    k_t = rng.standard_normal((batch, heads, d_k))
    v_t = rng.standard_normal((batch, heads, d_v))
    decay = _STEP_DECAYS[heads]
    if offset:  # fresh decays, lambda = 1 kept on the first head of three
        decay = np.concatenate([decay[:1] if heads == 3 else rng.uniform(0.05, 1.0, 1), rng.uniform(0.05, 1.0, heads - 1)])
    return kv, k_t, v_t, decay


def _reference_step(kv, k_t, v_t, decay):
    # One token through the package's recurrent scan, starting from kv: its final state is KV_t.
    q = np.zeros(k_t.shape[:2] + (1, k_t.shape[-1]))
    _, state = causal_linear_recurrent(q, k_t[:, :, None], v_t[:, :, None], decay, initial_state=kv, return_state=True)
    return state


@exercise("0.2", reveals=("causal_linear_recurrent",))
def check_state_step(state_step, seed: int = 0) -> None:
    """``state_step(kv, k_t, v_t, decay)``: KV_t = lambda KV_{t-1} + k_t^T v_t for every batch and head.

    kv: (batch, heads, d_k, d_v); k_t: (batch, heads, d_k); v_t: (batch, heads, d_v); decay: (heads,).
    """
    for i, (b, h, dk, dv) in enumerate(_STEP_SHAPES):
        kv, k_t, v_t, lam = _step_inputs(b, h, dk, dv, seed=100 + i, offset=seed)
        kv_before = kv.copy()
        ref = _reference_step(kv, k_t, v_t, lam)
        name = f"state_step with kv {kv.shape}"
        try:
            got = state_step(kv, k_t, v_t, lam)
        except ValueError as exc:
            raise ExerciseError(
                f"{name}, k_t {k_t.shape}, v_t {v_t.shape}, decay {lam.shape} raised ValueError: {exc}. Hint: the outer "
                "product is k_t[..., :, None] * v_t[..., None, :]; decay has one value per head: decay[:, None, None]"
            ) from exc
        if got is None:
            raise ExerciseError(f"{name} returned None -- did you forget `return`? (updating kv in place is not enough)")
        arr = expect_array(name, got)
        if arr.shape == (b, h, dv, dk) and dk != dv:
            raise ExerciseError(
                f"{name} returned shape {arr.shape}, expected {ref.shape} = (batch, heads, d_k, d_v): did you compute "
                "v_t^T k_t? k_t and v_t are row vectors, so k_t^T v_t is a (d_k x d_v) column-times-row outer product"
            )
        arr = expect_shape(name, arr, ref.shape)
        if not np.array_equal(kv, kv_before):
            raise ExerciseError(f"{name} modified its input kv in place; return a new array and leave KV_(t-1) unchanged")
        scale = float(np.max(np.abs(ref)))
        if not np.isfinite(arr).all():
            raise ExerciseError(f"{name} contains NaN or inf: with finite inputs and lambda in (0, 1] every entry of "
                                "lambda KV_(t-1) + k_t^T v_t is finite")

        def close(candidate):
            return float(np.max(np.abs(arr - candidate))) <= 1e-12 * scale

        if close(ref):
            continue
        outer = k_t[..., :, None] * v_t[..., None, :]  # k_t^T v_t: (batch, heads, d_k, d_v)
        per_head = lam[None, :, None, None]
        if close(kv + outer):
            raise ExerciseError(f"{name} equals KV_(t-1) + k_t^T v_t: the old state must be multiplied by lambda (decay) first")
        if close(per_head * (kv + outer)):
            raise ExerciseError(f"{name} equals lambda (KV_(t-1) + k_t^T v_t): only the old state decays; the new token enters with weight 1")
        if dk == dv and close(per_head * kv + np.swapaxes(outer, -1, -2)):
            raise ExerciseError(f"{name} adds v_t^T k_t: the outer product must be k_t^T v_t, rows indexed by d_k")
        if dv == h and close(lam * kv + outer):
            raise ExerciseError(
                f"{name}: decay was multiplied along the last axis (d_v = {dv} happens to equal heads = {h}); "
                "lambda has one value per head: decay[:, None, None] against (batch, heads, d_k, d_v)"
            )
        wrong = np.abs(arr - ref) > 1e-12 * scale
        heads = sorted({int(j) for j in np.argwhere(wrong)[:, 1]})
        raise ExerciseError(
            f"{name} differs from lambda KV_(t-1) + k_t^T v_t in heads {heads} of {h} (their decay: "
            f"{[float(lam[j]) for j in heads]}); max |difference| {float(np.max(np.abs(arr - ref))):.2g} vs max |reference| "
            f"{scale:.2g}. Hint: lambda has one value per head, decay[:, None, None] against (batch, heads, d_k, d_v)"
        )
    passed(f"state_step matches one step of causal_linear_recurrent on {len(_STEP_SHAPES)} shapes with per-head decay")


# ---------------------------------------------------------------- 0.3: the blocks of a sequence


@exercise("0.3", reveals=("block_slices",))
def check_block_lengths(block_lengths, seed: int = 0) -> None:
    """``block_lengths(n, B)``: the lengths of the T = ceil(n / B) blocks the package cuts a sequence of n into."""
    cases = [(130, 64), (128, 64), (1, 64), (37, 5), (7, 1), (1000, 256), (63, 64)]
    if seed:  # the same kinds: n not a multiple of B, a multiple, n < B, B = 1, ...
        rng = seeded(seed)
        b1, b2, b3 = (int(x) for x in rng.integers(2, 300, 3))
        cases = [(b1 * int(rng.integers(1, 9)) + int(rng.integers(1, b1)), b1), (b2 * int(rng.integers(1, 9)), b2),
                 (int(rng.integers(1, b3)), b3), (int(rng.integers(2, 60)), int(rng.integers(2, 9))),
                 (int(rng.integers(1, 20)), 1), (int(rng.integers(300, 5000)), 256), (b3 - 1, b3)]
    for n, block in cases:
        want = [s.stop - s.start for s in block_slices(n, block)]
        got = block_lengths(n, block)
        where = f"block_lengths({n}, {block})"
        if got is None:
            raise ExerciseError(f"{where} returned None -- did you forget `return`?")
        if isinstance(got, (str, bytes, dict)) or not hasattr(got, "__iter__"):
            raise ExerciseError(f"{where} must return a list of ints, got {got!r}")
        got = [expect_count(f"{where} (an entry)", x, what="a block length") for x in got]
        if got == want:
            continue
        if sum(got) != n and len(got) == n // block and n % block:
            raise ExerciseError(
                f"{where} = {got} covers {sum(got)} of {n} tokens: n is not a multiple of B, so there are "
                f"T = ceil(n/B) = {math.ceil(n / block)} blocks and the last one holds the remaining {n % block}"
            )
        if len(got) == len(want) and got[:-1] == want[:-1] and got[-1] == block:
            raise ExerciseError(
                f"{where} = {got}: the last block is shorter ({want[-1]} tokens); the book never pads the sequence"
            )
        raise ExerciseError(f"{where} = {got}, expected {want} (T = ceil({n}/{block}) = {len(want)} blocks)")
    passed(f"block lengths right on {len(cases)} (n, B) pairs, including n < B and n a multiple of B")
