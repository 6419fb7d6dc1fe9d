"""Time and peak memory of the torch forms against n, on CPU or CUDA. (Chapter 06.)

``python -m benchmarks.torch_sweep --out FILE [--device cuda]`` measures, for each sequence length n:
the masked quadratic form, torch's ``scaled_dot_product_attention`` (softmax, causal), the block loop
(Algorithm 1 as written), the chunk-parallel form and the per-token recurrent scan; then a block-size
sweep at one n, and the headline benchmark (chunk-parallel vs recurrent vs loop at n = 16K). It writes a
JSON file in the book's recorded-data format (machine, command, date, versions, results) that chapter 06
plots. The quadratic forms stop at ``--max-quadratic-n`` (their n x n scores grow as n^2), the recurrent
scan at ``--max-recurrent-n`` (its n Python steps make it slow): those limits are part of the record.

Times are forward passes under ``torch.no_grad()``: the median of several runs after a warm-up, with
CUDA events on a GPU. Peak memory is the extra memory a call allocates beyond its inputs
(:func:`lightning_edu.measure.peak_memory_torch` on CPU, the caching allocator's peak on CUDA).
"""

from __future__ import annotations

import statistics

import numpy as np
import torch

from . import torch_chunked as tc
from .measure import peak_memory_torch, time_samples

__all__ = ["METHODS", "sweep_inputs", "sweep_forms", "sweep_block_sizes", "headline_benchmark"]

METHODS = ("masked", "softmax", "loop", "chunked", "recurrent")


def sweep_inputs(n: int, batch: int, heads: int, d: int, dtype: torch.dtype, device: str, seed: int = 0):
    """Seeded standard-normal q, k, v of shape (batch, heads, n, d), scaled by d^-1/2 to keep o of order 1."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, n, d, generator=gen) for _ in range(3))
    return [(x * d**-0.5).to(device=device, dtype=dtype) for x in (q, k, v)]


def run_form(method: str, q, k, v, decay, block_size: int | None = None):
    """One forward pass of ``method`` (one of :data:`METHODS`); returns o."""
    if method == "masked":
        return tc.masked_forward(q, k, v, decay)
    if method == "softmax":
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    if method == "loop":
        return tc.loop_forward(q, k, v, decay, block_size)[0]
    if method == "chunked":
        return tc.chunked_forward(q, k, v, decay, block_size)[0]
    if method == "chunked_log":
        return tc.chunked_forward(q, k, v, decay, block_size, scan="log")[0]
    if method == "recurrent":
        return tc.recurrent_forward(q, k, v, decay)[0]
    raise ValueError(f"method must be one of {METHODS + ('chunked_log',)}, got {method!r}")


def _time_call(fn, device: str, budget_s: float = 1.0, max_repeat: int = 7) -> tuple[float, float]:
    """(median, min) seconds of ``fn()``: one warm-up, then 3 to ``max_repeat`` runs within about ``budget_s``.

    The median is what the chapter plots; the minimum is kept too because on a shared machine other
    processes only ever add time, so the minimum is the better estimate of the call's own cost.
    """
    if device == "cuda":
        fn()
        torch.cuda.synchronize()
        samples = []
        spent = 0.0
        while len(samples) < max_repeat and (spent < budget_s or len(samples) < 3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
            spent += samples[-1]
        return statistics.median(samples), min(samples)
    (once,) = time_samples(fn, repeat=1, warmup=0)  # warm-up, and a first estimate of the cost
    samples = time_samples(fn, repeat=int(max(3, min(max_repeat, budget_s / max(once, 1e-9)))), warmup=0)
    return statistics.median(samples), min(samples)


def _peak_memory(fn, device: str) -> int:
    """Extra bytes at the peak of ``fn()`` beyond what was allocated before it."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated() - base)
    return int(peak_memory_torch(fn))


def sweep_forms(sizes, methods=METHODS, *, batch=1, heads=2, d=64, dtype=torch.float32, device="cpu", decay=None,
          block_size=64, max_quadratic_n=8192, max_recurrent_n=16384, memory=True, budget_s=1.0, log=print):
    """Time (and peak memory) of each method at each n. Returns a list of dicts (method, n, time_s, peak_bytes)."""
    decay = _decay(decay, heads)
    rows = []
    for n in sizes:
        q, k, v = sweep_inputs(n, batch, heads, d, dtype, device)
        for method in methods:
            if method in ("masked", "softmax") and n > max_quadratic_n:
                continue
            if method == "recurrent" and n > max_recurrent_n:
                continue
            row = {"method": method, "n": int(n)}
            try:
                with torch.no_grad():
                    call = lambda: run_form(method, q, k, v, decay, block_size)  # noqa: E731
                    row["time_s"], row["min_s"] = _time_call(call, device, budget_s)
                    if memory and not (method == "recurrent" and device == "cpu" and n > 4096):
                        row["peak_bytes"] = _peak_memory(call, device)
            except Exception as exc:  # a failure (out of memory, say) is part of the record, not the end of it
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(row)
            log(_fmt(row))
        del q, k, v
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def sweep_block_sizes(n, block_sizes, methods=("chunked", "loop"), *, batch=1, heads=2, d=64, dtype=torch.float32,
                     device="cpu", decay=None, budget_s=1.0, log=print):
    """Time of the chunk-parallel and loop forms at one n for each block size B."""
    decay = _decay(decay, heads)
    q, k, v = sweep_inputs(n, batch, heads, d, dtype, device)
    rows = []
    for block in block_sizes:
        for method in methods:
            with torch.no_grad():
                t, t_min = _time_call(lambda: run_form(method, q, k, v, decay, block), device, budget_s)
            rows.append({"method": method, "n": int(n), "block_size": int(block), "time_s": t, "min_s": t_min})
            log(_fmt(rows[-1]))
    return rows


def headline_benchmark(n=16384, *, batch=1, heads=2, d=64, dtype=torch.float32, device="cpu", decay=None, block_size=64, log=print):
    """The chapter's headline figures at one n: chunk-parallel (both scans) vs per-token recurrent vs loop."""
    decay = _decay(decay, heads)
    q, k, v = sweep_inputs(n, batch, heads, d, dtype, device)
    times, mins = {}, {}
    with torch.no_grad():
        for method, budget in (("chunked", 2.0), ("chunked_log", 2.0), ("loop", 3.0), ("recurrent", 6.0)):
            times[method], mins[method] = _time_call(lambda: run_form(method, q, k, v, decay, block_size), device, budget, max_repeat=7)
            log(f"benchmark n={n} threads={torch.get_num_threads()}: {method:<12s} median {times[method] * 1e3:10.2f} ms, min {mins[method] * 1e3:10.2f} ms")
        o_fast = run_form("chunked", q, k, v, decay, block_size)
        o_rec = run_form("recurrent", q, k, v, decay, block_size)
    rel = float((o_fast.double() - o_rec.double()).norm() / o_rec.double().norm())
    result = {
        "n": int(n), "block_size": block_size, "batch": batch, "heads": heads, "threads": torch.get_num_threads() if device == "cpu" else None,
        "time_s": times, "min_s": mins,
        "speedup_vs_recurrent": times["recurrent"] / times["chunked"],
        "speedup_vs_loop": times["loop"] / times["chunked"],
        "speedup_vs_recurrent_min": mins["recurrent"] / mins["chunked"],
        "speedup_vs_loop_min": mins["loop"] / mins["chunked"],
        "relative_difference_chunked_vs_recurrent": rel,
    }
    log(f"benchmark n={n}: chunked is {result['speedup_vs_recurrent']:.1f}x faster than recurrent, "
        f"{result['speedup_vs_loop']:.2f}x faster than loop, by medians (by minima {result['speedup_vs_recurrent_min']:.1f}x, "
        f"{result['speedup_vs_loop_min']:.2f}x); outputs agree to {rel:.1e}")
    return result


def _decay(decay, heads):
    # Per-head decays spread as in the paper's heads (slow to fast forgetting); lambda = 1 would hide decay bugs.
    return np.linspace(0.999, 0.9, heads) if decay is None else decay


def _fmt(row) -> str:
    t = row.get("min_s", row.get("time_s"))
    mem = row.get("peak_bytes")
    extra = f" B={row['block_size']:4d}" if "block_size" in row else ""
    return (f"{row['method']:<10s} n={row['n']:6d}{extra} " + (f"{t * 1e3:10.2f} ms (min)" if t is not None else "")
            + (f" {mem / 2**20:9.1f} MiB" if mem is not None else "") + (f" {row['error']}" if "error" in row else ""))
