"""Where the exact pass runs: in a launch of its own after the fast kernel, or in the fast kernel's own program
right after its sweep, on a GPU. (Chapter 14.)

    python -m benchmarks.redo OUT.json

bf16, 16 heads, d = 64 (the head dim whose kernels redo in place:
:func:`~lightning_edu.triton_kernels._tiles.redo_in_place`), B = max(1, 32768 / T) sequences of T in {2K, 8K, 32K}
tokens (32K tokens per call; 16 x 2K), the benchmark's per-head decays. The two ways,
the backend's setting ``exact_in_place`` False and True (``plan.override``), are timed in interleaved rounds
(:mod:`.two_ways`), nine of each (:data:`ROUNDS`), each time with the backend's launches planned afresh:

- ``fwd_ms`` / ``fwd_graph_ms``: the forward with no backward to follow
  (:func:`~lightning_edu.triton_kernels.ops.forward_impl`), by ``triton.testing.do_bench`` (which empties L2 before
  every run, as the benchmark times) and captured in a CUDA graph (``do_bench_cudagraph``: the GPU's time alone);
- ``fwdbwd_ms`` / ``fwdbwd_graph_ms``: forward with its states saved and the backend's backward
  (:func:`~lightning_edu.triton_kernels.ops.backward_impl`), the same two ways;
- ``user_ms``: what a user's training step pays, ``lightning_attention(q, k, v, decay, backend="triton")`` on
  leaves that require grad, ``.backward(do)`` through autograd (its device thread, as by default), the
  gradients set to None; decay a CUDA tensor; ``do_bench``'s median. A short call is bound by the host here.

``launches``: the kernels one forward + backward launches (from the launch plans the backend records).
``same_bits``: whether the two ways gave the same o, dq, dk and dv. ``*_floor_frac``: the 4-tensor (forward) or
11-tensor (forward + backward) HBM floor at the measured copy bandwidth over the time. One JSON record with the
machine, versions and commit.
"""

from __future__ import annotations

import sys

from lightning_edu.environment import save_record
from lightning_edu.models.decay import head_decays

from .two_ways import HEADS, backend_calls, floors_ms, inputs, start_record, summary, time_two_ways

__all__ = ["SHAPES", "ROUNDS", "main"]

SHAPES = ((64, 2048, 16), (64, 8192, 4), (64, 32768, 1))  # (d, T, batch)
ROUNDS = 9
"""Rounds of each way. Through autograd a call of these shapes is bound by the host, and a slow stretch of the
host's can span several rounds in a row (in a first run with five rounds, at 32K, five of the last six timings of
the two ways together took 1.3 to 1.9 times the others): with nine the median of each way stands on five rounds."""


def main(argv=None) -> int:
    import numpy as np
    import torch
    from triton.testing import do_bench, do_bench_cudagraph

    from lightning_edu import lightning_attention
    from lightning_edu.triton_kernels import ops

    argv = sys.argv[1:] if argv is None else argv
    record = start_record(argv, __doc__, "redo", ROUNDS)
    if isinstance(record, int):
        return record
    decay = torch.tensor(head_decays(HEADS), dtype=torch.float32, device="cuda")
    log2_decay = torch.tensor(np.log2(head_decays(HEADS)), dtype=torch.float32, device="cuda")
    for d, t, batch in SHAPES:
        q, k, v, do = inputs(batch, t, d)
        fwd, fwdbwd = backend_calls(q, k, v, do, log2_decay)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]

        def user():
            lightning_attention(*leaves, decay, backend="triton").backward(do)
            for x in leaves:
                x.grad = None

        times, firsts = time_two_ways("exact_in_place", {
            "fwd_ms": lambda: do_bench(fwd, return_mode="median"),
            "fwd_graph_ms": lambda: do_bench_cudagraph(fwd, return_mode="median"),
            "fwdbwd_ms": lambda: do_bench(fwdbwd, return_mode="median"),
            "fwdbwd_graph_ms": lambda: do_bench_cudagraph(fwdbwd, return_mode="median"),
            "user_ms": lambda: do_bench(user, return_mode="median"),
        }, first=lambda: (fwdbwd(), ops.recorded_launches()), rounds=ROUNDS)
        fwd_floor, fb_floor = floors_ms(batch, t, d, record["copy_bandwidth_bytes_per_s"])
        row = {"D": d, "T": t, "batch": batch,
               "same_bits": all(torch.equal(a, b) for a, b in zip(firsts[False][0], firsts[True][0]))}
        for way, name in ((False, "own_launch"), (True, "in_place")):
            row[name] = {**summary(times[way], {"fwd_floor_frac": ("fwd_ms", fwd_floor),
                                                "fwdbwd_floor_frac": ("fwdbwd_ms", fb_floor),
                                                "user_floor_frac": ("user_ms", fb_floor)}),
                         "launches": firsts[way][1]}
        a, b = row["own_launch"], row["in_place"]
        print(f"d={d} T={t}: launches {a['launches']} -> {b['launches']}; fwd {a['fwd_ms']:.4f} -> "
              f"{b['fwd_ms']:.4f} ms, f+b {a['fwdbwd_ms']:.4f} -> {b['fwdbwd_ms']:.4f} (graph "
              f"{a['fwdbwd_graph_ms']:.4f} -> {b['fwdbwd_graph_ms']:.4f}), user {a['user_ms']:.4f} -> "
              f"{b['user_ms']:.4f}; same bits {row['same_bits']}", flush=True)
        record["results"].append(row)
        save_record(argv[0], record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
