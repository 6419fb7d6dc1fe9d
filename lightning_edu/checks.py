"""Comparisons a reader can trust: relative errors, the ``cmp`` table, float64 ground truth on demand."""

from __future__ import annotations

import numpy as np

__all__ = ["to_numpy", "relative_error", "cmp", "random_qkv"]


def to_numpy(x) -> np.ndarray:
    """float64 numpy copy of a numpy array or torch tensor (any device, any float dtype)."""
    if hasattr(x, "detach"):
        import torch

        return x.detach().to("cpu", dtype=torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def relative_error(mine, ref) -> float:
    """||mine - ref|| / ||ref|| in float64 (Frobenius over all elements); NaN anywhere gives NaN."""
    a, b = to_numpy(mine), to_numpy(ref)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: mine {a.shape}, ref {b.shape}")
    denom = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / (denom if denom > 0 else 1.0))


def max_abs_difference(mine, ref) -> float:
    a, b = to_numpy(mine), to_numpy(ref)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: mine {a.shape}, ref {b.shape}")
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def cmp(name: str, mine, ref, rtol: float = 1e-10) -> dict:
    """Karpathy's one-liner: print whether ``mine`` equals ``ref`` exactly, closely, and the max difference.

    Returns the row as a dict (name, exact, close, max_diff, rel_err) so notebooks can also assert on it.
    ``close`` means relative error <= ``rtol``. The printed max difference is rounded to 2 significant digits.
    """
    a, b = to_numpy(mine), to_numpy(ref)
    exact = bool(a.shape == b.shape and np.array_equal(a, b))
    rel = relative_error(a, b)
    row = {"name": name, "exact": exact, "close": bool(rel <= rtol), "max_diff": max_abs_difference(a, b), "rel_err": rel}
    print(f"{name:<16s} | exact: {str(exact):5s} | close: {str(row['close']):5s} | max diff: {row['max_diff']:.1e}")
    return row


def random_qkv(batch=1, heads=2, n=37, d_k=8, d_v=None, seed=0, dtype=np.float64, state=False):
    """Seeded standard-normal q, k, v (and an initial state with ``state=True``) as numpy arrays."""
    d_v = d_k if d_v is None else d_v
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, heads, n, d_k)).astype(dtype)
    k = rng.standard_normal((batch, heads, n, d_k)).astype(dtype)
    v = rng.standard_normal((batch, heads, n, d_v)).astype(dtype)
    if state:
        return q, k, v, rng.standard_normal((batch, heads, d_k, d_v)).astype(dtype)
    return q, k, v
