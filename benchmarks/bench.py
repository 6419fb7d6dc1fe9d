"""GPU benchmark harness: our kernels side by side with the libraries a user would otherwise call.

    python -m benchmarks.bench --out bench.json                   # the chapter 07-08 table
    python -m benchmarks.bench --tune --out tune.json             # tile sweep of the la2_fast kernels
    python -m benchmarks.bench --tiny --out tiny.json             # a tiny call's wall time, host included
    python -m benchmarks.bench --tiny --rounds 5 --out tiny.json  # the same, methods in interleaved rounds
    python -m benchmarks.bench --backward-on-caller --out b.json  # the table, backward on the calling thread

For every sequence length T and head dim D (H heads, bf16, T * batch = 32K tokens per call) and every
method, it reports the forward and forward+backward time (median of ``triton.testing.do_bench``; with
``--rounds R``, the median over R interleaved rounds, each round timing every method once in a rotated order,
so that a slow stretch of the host or a warming GPU lands on every method alike), tokens/s,
peak extra memory and the fraction of the HBM floor: the bytes that must move (q, k, v in and o out for the
forward; q, k, v, do in and dq, dk, dv out for the backward) over the device-to-device copy bandwidth
measured in the same run. It refuses to time under Triton's CPU interpreter: those numbers would mean nothing.

The methods are our kernels, one per Triton record of :mod:`lightning_edu.registry` with benchmark
defaults (named as in the registry; the backend's column is ``triton``), beside the torch backend and the
anchors: fla, the original Lightning Attention kernels and PyTorch's softmax attention. Files recorded
before the registry name our kernels as in :data:`RECORDED_NAMES`; :func:`with_current_names` reads them.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
from tqdm.auto import tqdm

from lightning_edu import registry
from lightning_edu.book import RECORDED_NAMES, method_name
from lightning_edu.costs import hbm_floor_bytes
from lightning_edu.environment import environment_record, save_record
from lightning_edu.measure import benchmark_inputs, copy_bandwidth
from lightning_edu.models.decay import head_decays

__all__ = ["backward_on_caller", "Method", "METHODS", "registry_methods", "interleaved", "main"]


def _refuse_without_gpu():
    import torch

    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        raise SystemExit("benchmarks.bench: refusing to time without CUDA or under TRITON_INTERPRET=1 "
                         "(the CPU interpreter's timings say nothing about a GPU).")


# ----------------------------------------------------------------------------------------------------
# Methods. Each method's ``make(q, k, v, decay, do)`` takes tensors in our (batch, heads, T, d) layout and
# the per-head lambdas, and returns a callable that runs the forward and one that runs forward + backward.
# Checks and layout changes happen in ``make``, outside the timed callables.


@dataclass(frozen=True)
class Method:
    """One column of the benchmark table.

    ``implementation`` is the registry name of the implementation it times (None for an anchor: a library
    a user would otherwise call); ``same_function`` is False for softmax attention, which computes another
    function, so there is no output to compare; ``max_T`` skips the longer sequences (from the registry's
    ``bench`` defaults, e.g. the quadratic LA-1).
    """

    name: str
    make: Callable
    implementation: str | None = None
    same_function: bool = True
    max_T: int | None = None


BENCH_KEYS = {"max_T"}  # what a registry record's ``bench`` defaults may say


def _registry_method(impl: registry.Implementation) -> Method:
    """A benchmark method built from one record of :mod:`lightning_edu.registry`.

    A rung's backend is named by its rung (``triton``, ``torch``: what ``lightning_attention(...,
    backend=...)`` takes, and the name every recorded file gives it); any other record by its registry name.
    The arguments are checked once in ``make`` (:func:`~lightning_edu.validation.validate_attention_args`,
    then :func:`~lightning_edu.registry.check_supports`), so the timed callables run the record's hooks
    and nothing else. The backend is timed the way training calls it: its forward is an autograd Function
    that keeps each segment's incoming state, and ``o.backward(do)`` hands those to the backward's dQ pass.
    Every other record runs its forward hook, then its backward hook.
    """
    unknown = set(impl.bench) - BENCH_KEYS
    if unknown:
        raise ValueError(f"{impl.name!r} has bench defaults {sorted(unknown)}; the benchmark knows "
                         f"{sorted(BENCH_KEYS)}")
    if impl.backend and not impl.differentiable:
        raise ValueError(f"the backend {impl.name!r} must be differentiable to be timed through autograd")

    def make(q, k, v, decay, do):
        import torch

        from lightning_edu.validation import validate_attention_args

        if impl.backend:
            q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
        args = validate_attention_args(q, k, v, decay, backend=impl.rung, do=do)
        registry.check_supports(impl, args, backward=True)

        def fwd():
            if impl.backend:
                with torch.no_grad():
                    return impl.forward(args)[0]
            return impl.forward(args)[0]

        def fwdbwd():
            if impl.backend:
                o, _ = impl.forward(args)
                o.backward(do)
                grads = tuple(x.grad for x in (q, k, v))
                for x in (q, k, v):
                    x.grad = None
                return grads
            impl.forward(args)
            return impl.backward(args)[:3]

        return fwd, fwdbwd

    name = impl.rung if impl.backend else impl.name
    return Method(name, make, implementation=impl.name, max_T=impl.bench.get("max_T"))


def registry_methods(implementations=None) -> dict[str, Method]:
    """A method for every Triton implementation whose ``bench`` defaults are not None, the backend first.

    ``implementations`` defaults to :data:`lightning_edu.registry.IMPLEMENTATIONS` (a name -> record dict).
    """
    records = (registry.IMPLEMENTATIONS if implementations is None else implementations).values()
    ours = [impl for impl in records if impl.rung == "triton" and impl.bench is not None]
    ours.sort(key=lambda impl: not impl.backend)  # stable: the rest keep the registry's order
    return {m.name: m for m in map(_registry_method, ours)}


def _autograd(fn):
    """Wrap fn(q, k, v) -> o (autograd) as (forward, forward+backward) callables."""
    import torch

    def make_calls(q, k, v, do, prep=lambda x: x):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]

        def fwd():
            with torch.no_grad():
                return fn(*leaves)

        def fwdbwd():
            o = fn(*leaves)
            o.backward(prep(do))
            for x in leaves:
                x.grad = None

        return fwd, fwdbwd

    return make_calls


def _sdpa(backend_name):
    def make(q, k, v, decay, do):
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)
        if q.shape[-1] != v.shape[-1]:
            raise RuntimeError("SDPA needs d_k == d_v")

        def fn(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        return _autograd(fn)(q, k, v, do)

    return make


def _fla(name):
    def make(q, k, v, decay, do):
        import torch
        from fla.ops import simple_gla

        fn = getattr(simple_gla, name)
        g_gamma = torch.tensor(np.log(decay), dtype=torch.float32, device=q.device)
        to_bthd = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731
        qt, kt, vt, dot = (to_bthd(x) for x in (q, k, v, do))
        return _autograd(lambda a, b, c: fn(a, b, c, g_gamma=g_gamma, scale=1.0)[0])(qt, kt, vt, dot)

    return make


def _original(q, k, v, decay, do):
    import torch
    from lightning_attn.ops import lightning_attn_func

    s = torch.tensor(-np.log(decay), dtype=torch.float32, device=q.device).view(-1, 1, 1).contiguous()
    return _autograd(lambda a, b, c: lightning_attn_func(a, b, c, s))(q, k, v, do)


def _user_call(q, k, v, decay, do):
    """``lightning_attention(..., backend="triton")`` as a model calls it: the per-head decay a float32 CUDA tensor
    made once (a buffer or parameter of the layer), validation and dispatch included in every call."""
    import torch

    from lightning_edu.api import lightning_attention

    decay_t = torch.tensor(np.asarray(decay), dtype=torch.float32, device=q.device)
    return _autograd(lambda a, b, c: lightning_attention(a, b, c, decay_t, backend="triton"))(q, k, v, do)


def _backend_on_pointers(q, k, v, decay, do):
    """The backend (``triton``) with its passes in time order on la2_fast's pointer kernel, not on descriptor tiles
    (``plan.override(tma=False)`` during each timed call): what the TMA's loads bring to the backend, measured in
    the same run."""
    from lightning_edu.triton_kernels import plan

    def pointers(fn):
        def run():
            with plan.override(tma=False):
                return fn()
        return run

    fwd, fwdbwd = _registry_method(registry.backend_for("triton")).make(q, k, v, decay, do)
    return pointers(fwd), pointers(fwdbwd)


METHODS: dict[str, Method] = {
    **registry_methods(),
    "triton_user": Method("triton_user", _user_call),
    "triton_pointers": Method("triton_pointers", _backend_on_pointers),
    "torch": _registry_method(registry.backend_for("torch")),
    "sdpa_flash": Method("sdpa_flash", _sdpa("FLASH_ATTENTION"), same_function=False),
    "sdpa_cudnn": Method("sdpa_cudnn", _sdpa("CUDNN_ATTENTION"), same_function=False),
    "fla_chunk": Method("fla_chunk", _fla("chunk_simple_gla")),
    "fla_fused_chunk": Method("fla_fused_chunk", _fla("fused_chunk_simple_gla")),
    "original": Method("original", _original),
}
LINEAR = {name for name, m in METHODS.items() if m.same_function}  # the methods that compute our function


def _correctness(method: Method, decay_fn, dtype):
    """Relative error of a method's forward against float64 numpy on one small case (same function?)."""
    from lightning_edu.checks import relative_error
    from lightning_edu.numpy_blockwise import blockwise_forward

    if not method.same_function:  # softmax attention: a different function, nothing to compare with
        return None
    q, k, v, do = benchmark_inputs(1, 4, 1000, 64, dtype, seed=7)
    decay = decay_fn(4)
    fwd, _ = method.make(q, k, v, decay, do)
    o = fwd()
    if o.shape != v.shape:  # fla returns (batch, T, heads, d)
        o = o.transpose(1, 2)
    ref = blockwise_forward(*(x.double().cpu().numpy() for x in (q, k, v)), decay, 64)[0]
    return relative_error(o, ref)


def _time_and_peak(fn, output_bytes: int) -> tuple[float, int]:
    """Median ms of ``fn`` (after one warm-up call) and its peak allocation beyond its own outputs."""
    import torch
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base - output_bytes
    del out
    return ms, peak


def _measure(make, q, k, v, decay, do, do_fwd=True, do_bwd=True):
    fwd, fwdbwd = make(q, k, v, decay, do)
    row = {}
    tensor_bytes = q.numel() * q.element_size()
    if do_fwd:
        row["fwd_ms"], row["fwd_peak_extra_bytes"] = _time_and_peak(fwd, tensor_bytes)  # minus o
    if do_bwd:
        row["fwdbwd_ms"], row["fwdbwd_peak_extra_bytes"] = _time_and_peak(fwdbwd, 3 * tensor_bytes)  # minus dq, dk, dv
    return row


def backward_on_caller(make):
    """``make`` with its forward + backward run inside ``torch.autograd.set_multithreading_enabled(False)``: autograd
    runs the backward on the thread that calls ``backward()`` instead of handing it to its CUDA device thread and
    waiting (``--backward-on-caller``, every method alike). The forward is unchanged."""

    def wrapped(q, k, v, decay, do):
        import torch

        fwd, fwdbwd = make(q, k, v, decay, do)

        def on_caller():
            with torch.autograd.set_multithreading_enabled(False):
                return fwdbwd()

        return fwd, on_caller

    return wrapped


def interleaved(measures: dict, rounds: int) -> dict:
    """{name: row} from ``measures`` ({name: a function returning a row of timings}) called ``rounds`` times each,
    in rounds: round r calls every method once, starting at the r-th (rotated), so no method always runs first
    or right after another. Each row holds the median of every ``*_ms`` over the rounds, the rounds' values in
    ``*_ms_rounds``, and the largest of every other number (the peak memory); a method that raises keeps its
    first error and is not called again."""
    names = list(measures)
    if not names:
        return {}
    runs: dict = {name: [] for name in names}
    errors: dict = {}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            if name in errors:
                continue
            try:
                runs[name].append(measures[name]())
            except Exception as exc:
                errors[name] = f"{type(exc).__name__}: {exc}"[:300]
    out = {}
    for name in names:
        if name in errors:
            out[name] = {"error": errors[name]}
            continue
        row = {}
        for key in runs[name][0]:
            values = [run[key] for run in runs[name]]
            if key.endswith("_ms"):
                row[key] = float(np.median(values))
                if rounds > 1:
                    row[key + "_rounds"] = values
            else:
                row[key] = max(values)
        out[name] = row
    return out


def run_table(args) -> dict:
    import torch

    data = environment_record("python -m benchmarks.bench " + " ".join(sys.argv[1:]))
    bw = copy_bandwidth()
    data["copy_bandwidth_bytes_per_s"] = bw
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    available, errors = {}, {}
    for name in args.methods:
        try:
            available[name] = METHODS[name]
            err = _correctness(METHODS[name], head_decays, dtype)
            data.setdefault("correctness_rel_err", {})[name] = err
        except Exception as exc:  # an anchor that does not import is reported, not fatal
            errors[name] = f"{type(exc).__name__}: {exc}"[:300]
            available.pop(name, None)
    data["unavailable"] = errors
    data["rounds"] = args.rounds
    if args.backward_on_caller:
        data["backward_on_caller"] = True
    wrap = backward_on_caller if args.backward_on_caller else (lambda make: make)
    results = []
    for d, T in (bar := tqdm([(d, T) for d in args.D for T in args.T], desc="bench", unit="shape")):
        bar.set_postfix_str(f"T={T} D={d}")
        batch = max(1, args.tokens // T)
        q, k, v, do = benchmark_inputs(batch, args.H, T, d, dtype)
        decay = head_decays(args.H)
        names = [name for name in available if available[name].max_T is None or T <= available[name].max_T]
        measures = {name: (lambda m=available[name]: _measure(wrap(m.make), q, k, v, decay, do)) for name in names}
        tokens = batch * T
        fwd_floor = hbm_floor_bytes(batch, T, args.H, d, q.element_size()) / bw * 1e3
        bwd_floor = hbm_floor_bytes(batch, T, args.H, d, q.element_size(), backward=True) / bw * 1e3
        for name, measured in interleaved(measures, args.rounds).items():
            row = {"method": name, "T": T, "D": d, "batch": batch, "heads": args.H, "dtype": args.dtype, **measured}
            row["input_bytes"] = 3 * q.numel() * q.element_size()
            if "fwd_ms" in row:
                row["fwd_floor_frac"] = fwd_floor / row["fwd_ms"]
                row["fwd_tokens_per_s"] = tokens / (row["fwd_ms"] * 1e-3)
            if "fwdbwd_ms" in row:
                row["fwdbwd_floor_frac"] = (fwd_floor + bwd_floor) / row["fwdbwd_ms"]
                row["fwdbwd_tokens_per_s"] = tokens / (row["fwdbwd_ms"] * 1e-3)
            results.append(row)
        data["results"] = results
        if args.out:  # written after every shape: a run cut short still leaves what it measured
            save_record(args.out, data)
        del q, k, v, do, measures
        torch.cuda.empty_cache()
    data["results"] = results
    return data


TUNE_TIMER = ("triton.testing.do_bench_cudagraph, median: each configuration's launches captured in a CUDA graph "
              "and replayed, so the time is the GPU's alone")


def run_tune(args) -> dict:
    """Sweep the la2_fast tiles: forward kernel (also used for dQ) and the fused dK/dV kernel, separately.

    Timed by :data:`TUNE_TIMER`. Tiles are a question about the GPU: the launchers are called directly here, their
    host code running on every call, and at d = 64 the kernels take only 0.1 to 0.15 ms; ``do_bench`` (which times
    the GPU's idle gaps too) timed one kernel at 0.112 and 0.182 ms on an H100, at T = 2K
    (notebooks/data/tune_h100_do_bench.json). The H200 sweep (notebooks/data/tune_h200.json) was timed by
    ``do_bench``."""
    import itertools

    import torch
    from triton.testing import do_bench_cudagraph

    from lightning_edu.triton_kernels import log2_decay_tensor
    from lightning_edu.triton_kernels.la2_fast import la2_fast_backward, la2_fast_forward

    data = environment_record("python -m benchmarks.bench " + " ".join(sys.argv[1:]))
    data["copy_bandwidth_bytes_per_s"] = copy_bandwidth()
    data["timer"] = TUNE_TIMER
    fwd_grid = [("fwd", d, T, dict(block=b, block_dv=bv, num_warps=w, num_stages=st))
                for d, T, b, bv, w, st in itertools.product(args.D, args.T, (32, 64, 128), (32, 64, 128), (4, 8),
                                                             (2, 3))]
    bwd_grid = [("dkdv", d, T, dict(dkdv_block=b, dkdv_warps=w, dkdv_stages=st))
                for d, T, b, w, st in itertools.product(args.D, args.T, (16, 32, 64), (4, 8), (1, 2))]
    results = []
    grid = fwd_grid + bwd_grid
    for kind, d, T, cfg in (bar := tqdm(grid, desc="tune", unit="config")):
        bar.set_postfix_str(f"{kind} D={d} T={T} {cfg}")
        batch = max(1, args.tokens // T)
        q, k, v, do = benchmark_inputs(batch, args.H, T, d, torch.bfloat16)
        l2 = log2_decay_tensor(head_decays(args.H), "cuda")
        row = {"kind": kind, "T": T, "D": d, **cfg}
        try:
            if kind == "fwd":
                fn = lambda: la2_fast_forward(q, k, v, l2, None, **cfg)  # noqa: E731
            else:
                fn = lambda: la2_fast_backward(q, k, v, do, l2, None, None, fused_dkdv=True, **cfg)  # noqa: E731
            fn()
            row["ms"] = do_bench_cudagraph(fn, rep=50, return_mode="median")
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:200]
        results.append(row)
    data["results"] = results
    for kind in ("fwd", "dkdv"):
        for d in args.D:
            for T in args.T:
                rows = [r for r in results if r["kind"] == kind and r["D"] == d and r["T"] == T and "ms" in r]
                if rows:
                    best = min(rows, key=lambda r: r["ms"])
                    print(f"best {kind} D={d} T={T}: {best['ms']:.3f} ms {best}")
    return data


def run_tiny(args, repeat: int = 200) -> dict:
    """Wall time of one small forward+backward (1 x 4 heads x 256 tokens), host included: what a call costs when the
    GPU work is too small to hide the Python, launches and allocations around it. Median of ``repeat`` calls, each
    timed from the call to its gradients on the host clock (synchronised after each).

    Such a call is bound by the host, whose pace drifts: single runs of this command on one H100 machine, minutes
    apart, moved each method by 15-82 % (notebooks/data/tiny_h100.json at commit 1fb5f4c). With ``--rounds R`` every method is timed
    R times, in :func:`interleaved` rounds (each round times every method once, in a rotated order), and its row holds
    the median over the rounds with the rounds' values: methods compared in one round met the same host."""
    import torch

    from lightning_edu.measure import median_time

    data = environment_record("python -m benchmarks.bench " + " ".join(sys.argv[1:]))
    data["rounds"] = args.rounds
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    results = []
    for d in args.D:
        q, k, v, do = benchmark_inputs(1, 4, 256, d, dtype)
        made: dict = {}  # each method's callables, made at its first round

        def measure(name):
            if name not in made:
                made[name] = METHODS[name].make(q, k, v, head_decays(4), do)[1]
            fwdbwd = made[name]
            synced = lambda: (fwdbwd(), torch.cuda.synchronize())  # noqa: E731
            return {"fwdbwd_wall_ms": median_time(synced, repeat=repeat, warmup=20) * 1e3}

        measured = interleaved({name: functools.partial(measure, name) for name in args.methods}, args.rounds)
        for name in args.methods:
            row = {"method": name, "T": 256, "D": d, "batch": 1, "heads": 4, "dtype": args.dtype, **measured[name]}
            print(f"tiny {name:<18} D={d}: {row.get('fwdbwd_wall_ms', math.nan):.3f} ms", flush=True)
            results.append(row)
    data["results"] = results
    return data


def _table(data) -> str:
    width = max([16] + [len(r["method"]) + 1 for r in data["results"] if "method" in r])
    lines = [f"{data['machine']}  copy bw {data['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s",
             f"{'method':<{width}}{'T':>7}{'D':>5}{'fwd ms':>9}{'frac':>6}{'f+b ms':>9}{'frac':>6}{'Mtok/s':>8}"
             f"{'extraMB':>9}"]
    for r in data["results"]:
        if "block" in r:
            continue
        lines.append(
            f"{r['method']:<{width}}{r['T']:>7}{r['D']:>5}{r.get('fwd_ms', math.nan):>9.3f}"
            f"{r.get('fwd_floor_frac', math.nan):>6.2f}"
            f"{r.get('fwdbwd_ms', math.nan):>9.3f}{r.get('fwdbwd_floor_frac', math.nan):>6.2f}"
            f"{r.get('fwdbwd_tokens_per_s', math.nan) / 1e6:>8.2f}"
            f"{r.get('fwdbwd_peak_extra_bytes', math.nan) / 2**20:>9.0f}"
            + (f"  {r['error'][:60]}" if "error" in r else "")
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--T", type=int, nargs="+", default=[2048, 8192, 32768, 131072])
    parser.add_argument("--D", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--H", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32768, help="batch * T per call (at least one sequence)")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), metavar="METHOD",
                        help=f"any of: {' '.join(METHODS)} (or a recorded file's name: {' '.join(RECORDED_NAMES)})")
    parser.add_argument("--rounds", type=int, default=1,
                        help="interleaved rounds per shape (with --tiny: per head dim): every method timed once per "
                             "round, in a rotated order")
    parser.add_argument("--backward-on-caller", action="store_true",
                        help="run every method's backward on the calling thread (autograd's multithreading off)")
    parser.add_argument("--tune", action="store_true", help="sweep la2_fast tile sizes instead")
    parser.add_argument("--tiny", action="store_true",
                        help="wall time of a 1 x 4 x 256 forward+backward, host included, instead")
    parser.add_argument("--out", default=None, help="write JSON here")
    args = parser.parse_args(argv)
    args.methods = [method_name(m) for m in args.methods]
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown method(s) {' '.join(unknown)}; choose from {' '.join(METHODS)}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    _refuse_without_gpu()
    start = time.time()
    data = run_tune(args) if args.tune else run_tiny(args) if args.tiny else run_table(args)
    data["wall_s"] = round(time.time() - start, 1)
    if args.out:
        save_record(args.out, data)
    if not (args.tune or args.tiny):
        print(_table(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
