"""The precision table: every (backend, dtype) pair against float64 at n in {1K, 16K, 64K} and lambda in
{1, 0.999, 0.9999, 1e-3}, held to the bounds of lightning_edu.precision.ERROR_BOUNDS (which the chapters quote).

Each error is measured once per session. Without a GPU the Triton rows run in the CPU interpreter, one Python
thread per kernel: there Triton's 64K rows are left to a machine with a GPU (the GPU check runs them), and its 16K
rows are measured in a second process, started when the tests are collected and run at the lowest priority, while
the other tests run.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
from concurrent.futures import Future, ProcessPoolExecutor

import numpy as np
import pytest
import torch

from lightning_edu.precision import DECAYS, ERROR_BOUNDS, SIZES, factor_rounding_error, measure_error


# Rows measured in a second process, without a GPU: Triton's 16K rows, most of the interpreter's time here. The
# interpreter runs a kernel in one Python thread, and most of a test run keeps one of CI's two cores busy and the
# other idle: the worker starts as soon as the tests are
# collected (conftest.py's pytest_collection_finish calls start_alongside), at the lowest priority (nice 19), so that
# it takes the idle core's time rather than the tests', and its rows are in by the time this file's tests read them.
# Run alone, the file starts it at its first test. The worker calls the same measure_error with the same arguments
# (fixed inputs and seed), so every number is the one this process would have measured: each row is still measured
# and held to its bound.
ELSEWHERE = {("triton", dtype, 16384) for dtype in ("bfloat16", "float16", "float32")}
_pending: dict[tuple[str, str, int], Future] = {}
_pool: list[ProcessPoolExecutor] = []  # the worker, while it runs


@functools.cache
def errors(backend: str, dtype: str, n: int) -> np.ndarray:
    pending = _pending.get((backend, dtype, n))
    return pending.result() if pending is not None else measure_error(backend, dtype, n)


def _rows_needed(items) -> list[tuple[str, str, int]]:
    """The (backend, dtype, n) rows the selected tests of this file read, in the order they first read them, less
    the row they leave to a GPU (:func:`_left_to_the_gpu`)."""
    rows = {}
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "n" not in params or getattr(getattr(item, "module", None), "__name__", None) != __name__:
            continue
        if "backend" in params:
            rows[params["backend"], params["dtype"], params["n"]] = None
        else:  # test_torch_float32_is_as_precise_as_the_kernels
            rows.update(dict.fromkeys([("torch", "float32", params["n"]), ("triton", "float32", params["n"])]))
    return [row for row in rows if not _left_to_the_gpu(*row)]


def _left_to_the_gpu(backend: str, dtype: str, n: int) -> bool:
    """Triton's rows at the longest n, without a GPU: in the interpreter they take about a minute of CI's time
    (30 s for float16 alone) for the same kernels and arithmetic the 16K rows check, and its bfloat16 row would
    repeat the float32 one (the interpreter computes bfloat16 inputs in float32, its bf16 arithmetic being wrong).
    With CUDA every Triton row runs on the GPU, in the GPU suite that the GPU check (.ci/gpu-check) runs."""
    return backend == "triton" and n == max(SIZES) and not torch.cuda.is_available()


def _lowest_priority() -> None:
    if hasattr(os, "nice"):
        os.nice(19)


def start_alongside(items) -> None:
    """Without a GPU, start the worker on the ELSEWHERE rows that the selected tests in ``items`` read (none when
    this file's tests are not selected), once per session."""
    wanted = [row for row in _rows_needed(items) if row in ELSEWHERE]
    if torch.cuda.is_available() or not wanted or _pool:
        return
    # spawn: a fresh interpreter (forking a process that holds torch's threads can deadlock); it inherits
    # TRITON_INTERPRET=1 from the environment conftest.py set
    _pool.append(ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                     initializer=_lowest_priority))
    for row in wanted:  # in the order the tests read them
        _pending[row] = _pool[0].submit(measure_error, *row)


def stop_alongside() -> None:
    """Stop the worker: the rows it has not finished are dropped, its process ended (a session that stops early
    does not wait for it)."""
    if _pool:
        pool = _pool.pop()
        processes = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            if process.is_alive():
                process.terminate()
    _pending.clear()


@pytest.fixture(scope="module", autouse=True)
def _measure_rows_alongside(request):
    """The worker's rows are read by this file's tests; it stops after the last of them."""
    start_alongside(request.session.items)
    try:
        yield
    finally:
        stop_alongside()


# On a machine with CUDA the Triton rows run on the GPU and belong to the GPU suite (`pytest -m gpu`, the GPU check).
_ON_GPU = [pytest.mark.gpu] if torch.cuda.is_available() else []


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("backend, dtype", [pytest.param(b, d, marks=_ON_GPU if b == "triton" else [])
                                            for b, d in sorted(ERROR_BOUNDS)])
def test_error_against_float64_within_the_stated_bound(backend, dtype, n):
    if _left_to_the_gpu(backend, dtype, n):
        pytest.skip("Triton at the longest n is left to a machine with a GPU (the interpreter's row takes a minute)")
    err = errors(backend, dtype, n)
    bound = ERROR_BOUNDS[(backend, dtype)]
    worst = int(np.argmax(err))
    assert err[worst] <= bound, f"{backend}/{dtype} at n={n}, lambda={DECAYS[worst]}: {err[worst]:.2e} > {bound:.0e}"


@pytest.mark.parametrize("n", [pytest.param(n, marks=_ON_GPU) for n in SIZES])
def test_torch_float32_is_as_precise_as_the_kernels(n):
    # The torch backend once rounded lambda to float32 before taking powers: 3e-5 at lambda = 0.9999,
    # n = 4096, where the kernels got 2.6e-7. Its factors now come from float64: within 2x of Triton's.
    if _left_to_the_gpu("triton", "float32", n):
        pytest.skip("Triton at the longest n is left to a machine with a GPU (the interpreter's row takes a minute)")
    torch_err, triton_err = errors("torch", "float32", n), errors("triton", "float32", n)
    for lam, mine, theirs in zip(DECAYS, torch_err, triton_err):
        assert mine <= 2 * theirs, f"lambda={lam}, n={n}: torch {mine:.2e} vs triton {theirs:.2e}"


def test_every_dtype_of_every_backend_has_a_bound():
    # Every pair a user can call has a row; float64 on Triton is refused (tl.dot has no float64).
    assert {b for b, _ in ERROR_BOUNDS} == {"numpy", "torch", "triton"}
    assert {d for b, d in ERROR_BOUNDS if b == "torch"} == {"float64", "float32", "float16", "bfloat16"}
    assert {d for b, d in ERROR_BOUNDS if b == "triton"} == {"float32", "float16", "bfloat16"}


def test_rounding_lambda_first_multiplies_its_error():
    # lambda^64 from a float32 lambda: its 6e-8 rounding error, 64 times over. From float64: one rounding.
    for lam in (0.999, 0.9999):
        e = factor_rounding_error(lam, 64)
        assert e["from_float64"] <= 2**-24  # half an ulp of float32
        assert e["rounded_first"] > 10 * e["from_float64"]
