"""Which way the segment pre-pass sweeps: the backend's forward and forward + backward with each segment's local
state summed from its start (the order Algorithm 1 walks) or from its end, on a GPU. (Chapter 14.)

    python -m benchmarks.prepass OUT.json

bf16, 16 heads, d in {64, 128}, B = max(1, 32768 / T) sequences of T in {8K, 32K, 128K} tokens (32K tokens per
call), the benchmark's per-head decays. The two orders, the backend's setting ``prepass_tail_first`` (``plan.override``)
False and True, are timed in interleaved rounds, each time with the backend's launches planned afresh:

- ``fwd_ms``: the forward with no backward to follow (:func:`~lightning_edu.triton_kernels.ops.forward_impl`),
  ``triton.testing.do_bench``'s median, which empties L2 before every run, as the benchmark times;
- ``fwd_graph_ms``: the same forward captured in a CUDA graph, ``do_bench_cudagraph``'s median (the GPU's time
  with no launch gaps; L2 is not emptied between runs);
- ``fwdbwd_ms``: forward with its states saved and the backend's backward
  (:func:`~lightning_edu.triton_kernels.ops.backward_impl`), ``do_bench``'s median.

``rel_diff``: the largest difference between the two orders' outputs (forward; and dq, dk, dv), relative to the
largest output, so the reader sees that only rounding moved. ``floor_frac``: the 4-tensor (forward) or
11-tensor (forward + backward: 4 + 7) HBM floor at the measured copy bandwidth over the time. One JSON record with the machine,
versions and commit.

Why the order can matter: the main pass reads each segment from its start. Summed from its end, the pre-pass
reads each segment's first rows last, and some of them are still in L2 when the main pass asks for them.
"""

from __future__ import annotations

import sys

from lightning_edu.environment import save_record
from lightning_edu.models.decay import head_decays

from .two_ways import HEADS, ROUNDS, backend_calls, floors_ms, inputs, start_record, summary, time_two_ways

__all__ = ["SHAPES", "ROUNDS", "main"]

SHAPES = tuple((d, t) for d in (128, 64) for t in (8192, 32768, 131072))


def _rel_diff(a, b) -> float:
    return max(float((x.float() - y.float()).abs().max() / y.float().abs().max()) for x, y in zip(a, b))


def main(argv=None) -> int:
    import numpy as np
    import torch
    from triton.testing import do_bench, do_bench_cudagraph

    from lightning_edu.triton_kernels import ops

    argv = sys.argv[1:] if argv is None else argv
    record = start_record(argv, __doc__, "prepass")
    if isinstance(record, int):
        return record
    log2_decay = torch.tensor(np.log2(head_decays(HEADS)), dtype=torch.float32, device="cuda")
    for d, t in SHAPES:
        batch = max(1, 32768 // t)
        q, k, v, do = inputs(batch, t, d)
        fwd, fwdbwd = backend_calls(q, k, v, do, log2_decay)
        times, outs = time_two_ways("prepass_tail_first", {"fwd_ms": lambda: do_bench(fwd, return_mode="median"),
                                          "fwd_graph_ms": lambda: do_bench_cudagraph(fwd, return_mode="median"),
                                          "fwdbwd_ms": lambda: do_bench(fwdbwd, return_mode="median")},
                                    first=lambda: (fwd(), *fwdbwd()[1:]))
        fwd_floor, fb_floor = floors_ms(batch, t, d, record["copy_bandwidth_bytes_per_s"])
        row = {"D": d, "T": t, "batch": batch, "segments": ops.launch_plan(q, v, None, False)[2],
               "rel_diff": _rel_diff(outs[True], outs[False])}
        for order, name in ((False, "start_first"), (True, "tail_first")):
            row[name] = summary(times[order], {"fwd_floor_frac": ("fwd_ms", fwd_floor),
                                               "fwd_graph_floor_frac": ("fwd_graph_ms", fwd_floor),
                                               "fwdbwd_floor_frac": ("fwdbwd_ms", fb_floor)})
        print(f"d={d} T={t}: fwd {row['start_first']['fwd_ms']:.4f} -> {row['tail_first']['fwd_ms']:.4f} ms "
              f"(graph {row['start_first']['fwd_graph_ms']:.4f} -> {row['tail_first']['fwd_graph_ms']:.4f}), "
              f"f+b {row['start_first']['fwdbwd_ms']:.4f} -> {row['tail_first']['fwdbwd_ms']:.4f}; "
              f"floor {row['start_first']['fwd_floor_frac']:.3f} -> {row['tail_first']['fwd_floor_frac']:.3f}; "
              f"rel diff {row['rel_diff']:.1e}", flush=True)
        record["results"].append(row)
        save_record(argv[0], record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
