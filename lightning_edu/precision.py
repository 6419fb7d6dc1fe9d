"""How close each backend and dtype comes to float64: the error bounds the book states. (Chapter 06.)

One table, :data:`ERROR_BOUNDS`, holds the largest relative error of ``o`` against the float64 answer that
each (backend, dtype) pair may show at sequence lengths up to 64K and decays from 1e-3 to 1; the tests
(``tests/test_precision.py``) measure every pair at every size and decay below and hold it to its bound,
and the chapters quote the table. The error is measured on the same inputs, already rounded to the dtype,
so it counts the arithmetic only: the final rounding of o to 16 bits (about 4e-3 in bf16, 5e-4 in fp16)
is the floor of the 16-bit rows.

The float32 rows are largest at lambda = 0.9999 and 64K tokens: lambda^B is rounded once to float32 and
then applied n / B times, and with an effective context of 1 / (1 - lambda^B) blocks its rounding error
is felt about that many times over.

Why the float32 rows are as small as they are: every decay factor is formed from lambda in float64 (torch)
or from log2(lambda) times an integer exponent (the kernels) and rounded once. Rounding lambda = 0.9999 to
float32 first moves it by up to 6e-8 relative, and lambda^64 formed from that by 64 times as much:
:func:`factor_rounding_error` shows it, chapter 06 teaches it.
"""

from __future__ import annotations

import numpy as np

from .checks import relative_error, to_numpy

__all__ = ["SIZES", "DECAYS", "ERROR_BOUNDS", "measure_error", "factor_rounding_error"]

SIZES = (1024, 16384, 65536)
DECAYS = (1.0, 0.999, 0.9999, 1e-3)

# (backend, dtype) -> the largest relative error of o against float64, per head, over SIZES x DECAYS.
# Measured on a CPU (the Triton rows in its interpreter, where bf16 is computed in fp32 and rounded), d = 16:
# float64 1.3e-15; float32 2.1e-6 (lambda = 0.9999 at 64K, torch and Triton alike, else <= 5e-7); float16
# 2.1e-4 (torch) and 3.6e-4 (Triton); bfloat16 1.7e-3, the rounding of o itself.
ERROR_BOUNDS: dict[tuple[str, str], float] = {
    ("numpy", "float64"): 1e-13,
    ("torch", "float64"): 1e-13,
    ("torch", "float32"): 5e-6,
    ("torch", "float16"): 1e-3,
    ("torch", "bfloat16"): 5e-3,
    ("triton", "float32"): 5e-6,
    ("triton", "float16"): 1e-3,
    ("triton", "bfloat16"): 5e-3,
}


def _inputs(n: int, heads: int, d: int, seed: int):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, heads, n, d)) for _ in range(3)]


def measure_error(backend: str, dtype: str, n: int, decays=DECAYS, *, d: int = 16, block_size: int | None = None,
                  seed: int = 0) -> np.ndarray:
    """Relative error of ``lightning_attention`` in (backend, dtype) against float64, one value per decay.

    One head per decay, q, k, v standard normal of shape (1, heads, n, d), rounded to ``dtype`` first; the
    reference is the float64 numpy backend on the rounded inputs. Returns an array of len(decays).
    """
    import torch

    from .api import lightning_attention

    decays = [float(x) for x in decays]
    q, k, v = _inputs(n, len(decays), d, seed)
    if backend == "numpy":
        if dtype != "float64":
            raise ValueError(f"the numpy backend computes in float64 only, got dtype {dtype!r}")
        o = lightning_attention(q, k, v, decays, backend="numpy", block_size=block_size)
        rounded = (q, k, v)
    else:
        tdtype = getattr(torch, dtype)
        t = [torch.from_numpy(x).to(tdtype) for x in (q, k, v)]
        if backend == "triton" and torch.cuda.is_available():
            t = [x.cuda() for x in t]
        with torch.no_grad():
            o = lightning_attention(*t, decays, backend=backend, block_size=block_size)
        rounded = [x.cpu().double().numpy() for x in t]
    ref = lightning_attention(*rounded, decays, backend="numpy")
    return np.array([relative_error(to_numpy(o)[:, h], ref[:, h]) for h in range(len(decays))])


def factor_rounding_error(decay: float, power: int) -> dict:
    """Relative error of lambda^power in float32, formed two ways. (Chapter 06.)

    ``"rounded_first"``: lambda rounded to float32, then raised to the power in float32 (the error of the
    rounded lambda grows ``power``-fold). ``"from_float64"``: the power taken in float64, rounded once.
    """
    exact = float(decay) ** power
    rounded_first = float(np.float32(decay) ** np.float32(power))
    from_float64 = float(np.float32(exact))
    return {"rounded_first": abs(rounded_first - exact) / exact, "from_float64": abs(from_float64 - exact) / exact}
