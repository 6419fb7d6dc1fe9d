"""Measuring on the reader's own machine: median wall time and peak extra memory of one call.

Timings are machine-dependent, so notebooks print them under ``# NBVAL_IGNORE_OUTPUT`` and assert only
claims with wide margins (a 64x gap, not a 10 % one). GPU timings live in :mod:`benchmarks.bench`.
"""

from __future__ import annotations

import gc
import statistics
import time
import tracemalloc
import weakref
from typing import Callable

__all__ = ["time_samples", "median_time", "peak_memory_numpy", "peak_memory_torch", "pin_blas_threads", "copy_bandwidth", "benchmark_inputs"]


def time_samples(fn: Callable[[], object], repeat: int = 5, warmup: int = 1, min_time: float = 0.0) -> list[float]:
    """Wall times of ``fn()`` in seconds, ``repeat`` samples after ``warmup`` runs.

    With ``min_time`` > 0, fast calls are batched so that each sample lasts at least that long (the sample
    is then the mean of its batch). This is what ``torch.utils.benchmark.Timer.blocked_autorange`` does too;
    the book keeps these few lines instead so that the same timer serves numpy and torch code alike, with
    the number of samples fixed by the caller and nothing else (threads, warm-up rules) changed behind it.
    """
    for _ in range(warmup):
        fn()
    inner = 1
    if min_time > 0:
        start = time.perf_counter()
        fn()
        once = max(time.perf_counter() - start, 1e-9)
        inner = max(1, int(min_time / once))
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - start) / inner)
    return samples


def median_time(fn: Callable[[], object], repeat: int = 5, warmup: int = 1, min_time: float = 0.0) -> float:
    """Median wall time of ``fn()`` in seconds over ``repeat`` samples (see :func:`time_samples`)."""
    return statistics.median(time_samples(fn, repeat, warmup, min_time))


def peak_memory_numpy(fn: Callable[[], object]) -> int:
    """Peak bytes allocated while ``fn()`` runs, above what was live before (numpy reports to tracemalloc)."""
    gc.collect()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return max(0, peak - base)


def peak_memory_torch(fn: Callable[[], object]) -> int:
    """Peak bytes of tensor storage created by ``fn()`` and alive at the same time (CPU or CUDA).

    Torch's CPU allocator reports to no profiler we can read cheaply, so this counts storages itself: a
    dispatch mode sees every op's outputs, adds the bytes of each new storage and subtracts them when
    the storage is freed. Views share storage and are counted once. Inputs are not counted.
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    live = {"now": 0, "peak": 0}
    owners: dict[int, list[int]] = {}  # storage address -> [bytes, number of live tensors using it]

    def release(key: int) -> None:
        entry = owners[key]
        entry[1] -= 1
        if entry[1] == 0:
            live["now"] -= entry[0]
            del owners[key]

    def track(t) -> None:
        if not isinstance(t, torch.Tensor):
            return
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0:
            return
        if key not in owners:
            owners[key] = [storage.nbytes(), 0]
            live["now"] += storage.nbytes()
            live["peak"] = max(live["peak"], live["now"])
        owners[key][1] += 1
        weakref.finalize(t, release, key)  # tensors are weak-referenceable; storage objects are transient

    class _Tracker(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                track(t)
            return out

    gc.collect()
    with _Tracker():
        result = fn()
    del result
    gc.collect()
    return live["peak"]



def pin_blas_threads(threads: int = 1) -> list[str]:
    """Limit every BLAS loaded in this process to ``threads`` threads; returns the libraries changed.

    On a small shared machine a multi-threaded BLAS stalls whenever another process is busy, so that one call
    can take many times its usual time; chapters 01-02 therefore time with one thread. threadpoolctl finds
    the loaded BLAS libraries (OpenBLAS, MKL, BLIS) and sets their thread counts.
    """
    from threadpoolctl import threadpool_info, threadpool_limits

    threadpool_limits(limits=int(threads), user_api="blas")
    return [info["filepath"].rsplit("/", 1)[-1] for info in threadpool_info() if info["user_api"] == "blas"]


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    import torch
    from triton.testing import do_bench

    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=25, rep=200, return_mode="median")
    return 2 * nbytes / (ms * 1e-3)


def benchmark_inputs(batch, heads, T, d, dtype, seed=0):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    # Scaled so that T = 128K with lambda near 1 stays well inside bf16's range; random, never zeros, so that no
    # kernel's masking or shortcut is skipped by accident.
    mk = lambda: (torch.randn(batch, heads, T, d, device="cuda", generator=g) * d**-0.5).to(dtype)  # noqa: E731
    return mk(), mk(), mk(), mk()
