"""Two ways of one backend setting, timed side by side on a GPU: what :mod:`.prepass` and :mod:`.redo` share.

Each measures the backend's calls (bf16, 16 heads) with a module switch off and on, in interleaved rounds (off,
on, off, on, ...: a drift of the machine hits both ways alike), every time with the launches planned afresh, and
reports per way the median of the rounds, the rounds themselves, and the fraction of the HBM floor.
"""

from __future__ import annotations

import statistics

from .common import gpu_record

__all__ = ["HEADS", "ROUNDS", "TIMER", "start_record", "inputs", "backend_calls", "floors_ms", "time_two_ways",
           "summary"]

HEADS = 16
ROUNDS = 5
TIMER = "triton.testing.do_bench (L2 emptied before each run) and do_bench_cudagraph, medians"


def start_record(argv: list[str], doc: str, module: str, rounds: int = ROUNDS) -> dict | int:
    """:func:`~.environment.gpu_record` with the fields both measurements hold (an int: the exit status)."""
    return gpu_record(argv, doc, module, heads=HEADS, dtype="bfloat16", rounds=rounds, timer=TIMER, results=[])


def inputs(batch: int, t: int, d: int):
    """q, k, v, dO: (batch, HEADS, t, d) bf16 on the GPU, N(0, 1/16), the same draws every run."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    return tuple(torch.randn(batch, HEADS, t, d, device="cuda", generator=gen).bfloat16() / 4 for _ in range(4))


def backend_calls(q, k, v, do, log2_decay):
    """(fwd, fwdbwd): the backend's forward with no backward to follow, and its forward (states saved) +
    backward, called through :func:`~lightning_edu.triton_kernels.ops.forward_impl` and ``backward_impl``;
    fwdbwd returns (o, dq, dk, dv)."""
    from lightning_edu.triton_kernels import ops

    def fwd():
        return ops.forward_impl(q, k, v, log2_decay, None, None, False)[0]

    def fwdbwd():
        o, _, incoming = ops.forward_impl(q, k, v, log2_decay, None, None, True)
        return (o, *ops.backward_impl(q, k, v, do, log2_decay, None, None, incoming, None, False)[:3])

    return fwd, fwdbwd


def floors_ms(batch: int, t: int, d: int, bandwidth: float) -> tuple[float, float]:
    """The HBM floors in ms of a forward (4 tensors) and of a forward + backward (4 + 7), at ``bandwidth``."""
    from lightning_edu.costs import hbm_floor_bytes

    fwd = hbm_floor_bytes(batch, t, HEADS, d)
    return fwd / bandwidth * 1e3, (fwd + hbm_floor_bytes(batch, t, HEADS, d, backward=True)) / bandwidth * 1e3


def time_two_ways(setting: str, timed: dict, first=None, rounds: int = ROUNDS) -> tuple[dict, dict]:
    """({way: {name: [ms, one per round]}}, {way: first()}) for way in (False, True): each round runs, under
    ``plan.override(setting=way)`` (the backend's :class:`~lightning_edu.triton_kernels.plan.Settings`, whose every
    value is part of the key its launch plans are filed under), ``first()`` when given (its last result is kept, say
    the outputs to compare), then every ``timed[name]()``, which returns milliseconds."""
    from lightning_edu.triton_kernels import plan

    times = {way: {name: [] for name in timed} for way in (False, True)}
    firsts = {}
    for _ in range(rounds):
        for way in (False, True):
            with plan.override(**{setting: way}):
                if first is not None:
                    firsts[way] = first()
                for name, measure in timed.items():
                    times[way][name].append(measure())
    return times, firsts


def summary(times: dict, fractions: dict) -> dict:
    """One way's entry of a record: each timing's median (``name``) and its rounds (``name_rounds``), in ms rounded
    to 5 decimals, and ``fractions[key] = (name, floor_ms)`` as ``key``: the floor over that median."""
    med = {name: statistics.median(xs) for name, xs in times.items()}
    return {**{name: round(x, 5) for name, x in med.items()},
            **{f"{name}_rounds": [round(x, 5) for x in xs] for name, xs in times.items()},
            **{key: floor / med[name] for key, (name, floor) in fractions.items()}}
