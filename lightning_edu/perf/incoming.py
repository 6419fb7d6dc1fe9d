"""How a forward's program builds its segment's incoming state: the earlier segments' states loaded one at a time
(Horner's rule) or in groups, on a GPU. (Chapter 07.)

    python -m lightning_edu.perf.incoming OUT.json

bf16, 16 heads, d in {64, 128}, B = max(1, 32768 / T) sequences of T in {8K, 32K, 128K} tokens (32K tokens per
call), the benchmark's per-head decays. Before its sweep, the program of segment j sums the local states of
segments 0 .. j-1 (the pre-pass wrote them; they sit in L2). One at a time, each load waits for the last (Horner's
rule: state times lambda^L, plus the next); in groups, a group's loads are in flight together
(:data:`~lightning_edu.triton_kernels.la2_fast.INCOMING_LOAD_BYTES`, :func:`~lightning_edu.triton_kernels.la2_fast.incoming_group`).
The programs of one wave all start together, and the one with the most segments before it starts its sweep last.

The two ways, ``INCOMING_LOAD_BYTES`` = 0 (one at a time) and the package's value, are timed in interleaved rounds,
each with the backend's launches planned afresh:

- ``fwd_ms``: the backend's forward with no backward to follow, ``triton.testing.do_bench``'s median (L2 emptied
  before every run, as the benchmark times); ``fwd_graph_ms``: the same captured in a CUDA graph,
  ``do_bench_cudagraph``'s median (the GPU's time alone);
- ``main_graph_ms``: the main pass alone on the backend's tiles and segments, the pre-pass's states computed once
  beforehand (CUDA graph);
- ``fwdbwd_ms``: forward with its states saved and the backend's backward, ``do_bench``'s median.

Beside them, once: ``main_given_ms``, the main pass handed every segment's incoming state (no sum at all: the
least the start of a segment can cost), and ``main_by_bytes``, the main pass at other values of
INCOMING_LOAD_BYTES. ``rel_diff``: the largest difference between the two ways' forward outputs, relative to the
largest output (only rounding moves). ``floor_frac``: the HBM floor at the measured copy bandwidth over the time.
One JSON record with the machine, versions and commit.
"""

from __future__ import annotations

import sys

from .bench import head_decays
from .environment import save_record
from .two_ways import HEADS, ROUNDS, backend_calls, floors_ms, inputs, start_record, summary, time_two_ways

__all__ = ["SHAPES", "BYTES", "main"]

SHAPES = tuple((d, t) for d in (64, 128) for t in (8192, 32768, 131072))
BYTES = (16384, 32768, 65536, 131072)


def main(argv=None) -> int:
    import numpy as np
    import torch
    from triton.testing import do_bench, do_bench_cudagraph

    from ..triton_kernels import la2_fast, ops

    argv = sys.argv[1:] if argv is None else argv
    record = start_record(argv, __doc__, "incoming")
    if isinstance(record, int):
        return record
    log2_decay = torch.tensor(np.log2(head_decays(HEADS)), dtype=torch.float32, device="cuda")
    default = la2_fast.INCOMING_LOAD_BYTES
    record["incoming_load_bytes"] = default

    def use(value):
        la2_fast.INCOMING_LOAD_BYTES = value
        ops.forget_plans()

    for d, t in SHAPES:
        batch = max(1, 32768 // t)
        q, k, v, do = inputs(batch, t, d)
        fwd, fwdbwd = backend_calls(q, k, v, do, log2_decay)
        cfg, seg_len, num_seg = ops.launch_plan(q, v, None, False)
        tma = la2_fast._tma(None, q, v)
        local = torch.empty(batch * HEADS, num_seg, d, d, device="cuda", dtype=torch.float32)
        la2_fast.segment_states(k, v, log2_decay, local, seg_len, cfg["block"], cfg["block_dv"], cfg["num_warps"],
                                cfg["num_stages"])
        incoming = la2_fast._forward_form(q, k, v, log2_decay, None, False, cfg["block"], cfg["block_dv"],
                                          cfg["num_warps"], cfg["num_stages"], seg_len, local_states=local,
                                          store_incoming=True)[2]["incoming"]

        def main_pass(states=local, given=False):
            return la2_fast._forward_form(q, k, v, log2_decay, None, False, cfg["block"], cfg["block_dv"],
                                          cfg["num_warps"], cfg["num_stages"], seg_len,
                                          **({"incoming": states} if given else {"local_states": states}), tma=tma)

        times, outs = time_two_ways(lambda on: use(default if on else 0),
                                    {"fwd_ms": lambda: do_bench(fwd, return_mode="median"),
                                     "fwd_graph_ms": lambda: do_bench_cudagraph(fwd, return_mode="median"),
                                     "main_graph_ms": lambda: do_bench_cudagraph(main_pass, return_mode="median"),
                                     "fwdbwd_ms": lambda: do_bench(fwdbwd, return_mode="median")},
                                    first=fwd)
        by_bytes = {}
        for value in BYTES:
            use(value)
            by_bytes[str(value)] = round(do_bench_cudagraph(main_pass, return_mode="median"), 5)
        use(default)
        given = None
        if incoming is not None:
            given = round(do_bench_cudagraph(lambda: main_pass(incoming, True), return_mode="median"), 5)
        fwd_floor, fb_floor = floors_ms(batch, t, d, record["copy_bandwidth_bytes_per_s"])
        ref = outs[False].float()
        row = {"D": d, "T": t, "batch": batch, "segments": num_seg, "block_dv": cfg["block_dv"], "tma": tma,
               "group": la2_fast.incoming_group(d, cfg["block_dv"]),
               "rel_diff": float((outs[True].float() - ref).abs().max() / ref.abs().max()),
               "main_given_ms": given, "main_by_bytes": by_bytes}
        for way, name in ((False, "one_at_a_time"), (True, "grouped")):
            row[name] = summary(times[way], {"fwd_floor_frac": ("fwd_ms", fwd_floor),
                                             "fwd_graph_floor_frac": ("fwd_graph_ms", fwd_floor),
                                             "fwdbwd_floor_frac": ("fwdbwd_ms", fb_floor)})
        a, b = row["one_at_a_time"], row["grouped"]
        print(f"d={d} T={t} ({num_seg} seg, group {row['group']}): fwd {a['fwd_ms']:.4f} -> {b['fwd_ms']:.4f} ms "
              f"(graph {a['fwd_graph_ms']:.4f} -> {b['fwd_graph_ms']:.4f}; main {a['main_graph_ms']:.4f} -> "
              f"{b['main_graph_ms']:.4f}, given {given}), f+b {a['fwdbwd_ms']:.4f} -> {b['fwdbwd_ms']:.4f}; "
              f"floor {a['fwd_floor_frac']:.3f} -> {b['fwd_floor_frac']:.3f}; by bytes {by_bytes}; "
              f"rel diff {row['rel_diff']:.1e}", flush=True)
        record["results"].append(row)
        save_record(argv[0], record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
