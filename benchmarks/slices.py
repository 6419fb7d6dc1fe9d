"""Slices against segments: the forward with no backward to follow over how d_v is cut and how the sequence is
cut, on a GPU. (Chapter 14.)

    python -m benchmarks.slices OUT.json [--T 32768 ...] [--D 64 128] [--segments 2 4 8 16] [--budget-s 400]

bf16, 16 heads, B = max(1, 32768 / T) sequences of T tokens, the benchmark's per-head decays. Both ways of making
programs for the chip cost bytes. A segment makes the pre-pass read K and V of every segment but the last a second
time; a slice of d_v makes its program read all of Q and K, but at the same time as the other slices of its (batch,
head), so that L2 can serve the repeats. Each variant is a main pass of ``block_dv``-column slices (``slices``
programs per (batch, head) and segment) on ``segments`` segments, with ``num_stages`` pipeline stages, its tiles
loaded through pointers or descriptors (``tma``), after a pre-pass of ``pre_dv``-column slices (the pre-pass's
slicing is its own: it writes whole states). Each time is the GPU's alone: the median of
``triton.testing.do_bench_cudagraph``, the launches captured in a CUDA graph and replayed; the backend's own forward
(:func:`~lightning_edu.triton_kernels.ops.forward_impl` with no states to save) is timed beside them, and also by
``triton.testing.do_bench`` (L2 emptied before every run, host launches included, as the benchmark times).
``prepass_ms``: the pre-pass alone, for each segment count and ``pre_dv``. ``floor_frac``: the 4-tensor HBM floor at
the measured copy bandwidth over the time. ``rel_diff``: the largest difference from the backend's output, relative
to its largest entry. One JSON record with the machine, versions and commit, saved after every shape;
``--budget-s``: no shape is started after that many seconds (a shape started finishes).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

from lightning_edu.costs import hbm_floor_bytes
from lightning_edu.environment import save_record
from lightning_edu.models.decay import head_decays

from .common import gpu_record

__all__ = ["main", "variants"]

HEADS = 16


def variants(d: int) -> list[dict]:
    """The (block_dv, num_warps, num_stages, tma) of the main pass tried at head dim d (= d_k = d_v)."""
    dvs = [x for x in (128, 64, 32, 16) if x <= d]
    out = []
    for block_dv in dvs:
        warps = (8,) if block_dv == 128 else (4, 8) if block_dv == 64 and d == 128 else (4,)
        for num_warps, num_stages, tma in itertools.product(warps, (2, 3, 4), (False, True)):
            if block_dv == 128 and num_stages == 4:
                continue  # more shared memory than an SM has
            out.append(dict(block_dv=block_dv, num_warps=num_warps, num_stages=num_stages, tma=tma))
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m benchmarks.slices", add_help=False)
    parser.add_argument("out")
    parser.add_argument("--T", type=int, nargs="+", default=[32768])
    parser.add_argument("--D", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--segments", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--budget-s", type=float, default=400.0, help="stop starting new shapes after this long")
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    try:
        args, rest = parser.parse_known_args(argv)
    except SystemExit:  # no OUT.json (argparse has said why)
        args, rest = None, []
    if args is None or rest or args.out.startswith("-"):
        print(__doc__)
        return 2
    record = gpu_record([args.out], __doc__, "slices", heads=HEADS, dtype="bfloat16",
                        timer="triton.testing.do_bench_cudagraph, median", results=[])
    if isinstance(record, int):
        return record
    record["command"] = "python -m benchmarks.slices " + " ".join(argv)
    import numpy as np
    import torch
    from triton.testing import do_bench, do_bench_cudagraph

    from lightning_edu.triton_kernels import la2_fast, ops
    from lightning_edu.triton_kernels._tiles import cdiv

    bw = record["copy_bandwidth_bytes_per_s"]
    log2_decay = torch.tensor(np.log2(head_decays(HEADS)), dtype=torch.float32, device="cuda")
    start = time.time()
    for d in args.D:
        for t in args.T:
            if time.time() - start > args.budget_s:
                print(f"budget spent: d={d} T={t} not measured", flush=True)
                continue
            batch = max(1, 32768 // t)
            gen = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(batch, HEADS, t, d, device="cuda", generator=gen).bfloat16() / 4 for _ in range(3))
            floor_ms = hbm_floor_bytes(batch, t, HEADS, d) / bw * 1e3

            def backend():
                return ops.forward_impl(q, k, v, log2_decay, None, None, False)

            ref = backend()[0].float()
            scale = float(ref.abs().max())
            cfg, _, num_seg = ops.launch_plan(q, v, None, False)
            graph_ms = do_bench_cudagraph(backend, return_mode="median")
            bench_ms = do_bench(backend, return_mode="median")
            row = {"D": d, "T": t, "batch": batch, "floor_ms": floor_ms,
                   "backend": {**{k_: v_ for k_, v_ in cfg.items() if isinstance(v_, (int, float, str, bool))},
                               "segments": num_seg, "ms": graph_ms, "floor_frac": floor_ms / graph_ms,
                               "do_bench_ms": bench_ms, "do_bench_floor_frac": floor_ms / bench_ms},
                   "prepass_ms": {}, "sweep": []}
            print(f"d={d} T={t} backend {num_seg} seg: graph {graph_ms:.4f} ms ({floor_ms / graph_ms:.3f}), "
                  f"do_bench {bench_ms:.4f} ({floor_ms / bench_ms:.3f})", flush=True)
            n_bh = batch * HEADS
            for segments in args.segments:
                seg_len = cdiv(cdiv(t, segments), 64) * 64
                num = cdiv(t, seg_len)
                for pre_dv in sorted({d, 64, 32} & set(range(16, d + 1))):
                    seg = torch.empty(n_bh, num, d, d, device="cuda", dtype=torch.float32)
                    try:
                        ms = do_bench_cudagraph(lambda: la2_fast.segment_states(k, v, log2_decay, seg, seg_len, 64,
                                                                                pre_dv, 4, 2),
                                                return_mode="median")
                    except Exception as exc:  # noqa: BLE001 - a variant that does not compile is reported
                        ms = f"{type(exc).__name__}: {exc}"[:200]
                    row["prepass_ms"][f"{segments}x{pre_dv}"] = ms
                for var in variants(d):
                    for pre_dv in sorted({d, var["block_dv"]}):
                        seg = torch.empty(n_bh, num, d, d, device="cuda", dtype=torch.float32)

                        def run(var=var, pre_dv=pre_dv, seg=seg, seg_len=seg_len):
                            la2_fast.segment_states(k, v, log2_decay, seg, seg_len, 64, pre_dv, 4, 2)
                            return la2_fast._forward_form(q, k, v, log2_decay, None, False, 64, var["block_dv"],
                                                          var["num_warps"], var["num_stages"], seg_len,
                                                          local_states=seg, tma=var["tma"])

                        entry = {**var, "segments": num, "seg_len": seg_len, "pre_dv": pre_dv,
                                 "programs": n_bh * num * cdiv(d, var["block_dv"])}
                        try:
                            out = run()[0].float()
                            entry["rel_diff"] = float((out - ref).abs().max()) / scale
                            entry["ms"] = do_bench_cudagraph(run, return_mode="median")
                            entry["floor_frac"] = floor_ms / entry["ms"]
                        except Exception as exc:  # noqa: BLE001
                            entry["error"] = f"{type(exc).__name__}: {exc}"[:200]
                        row["sweep"].append(entry)
                        print(f"  {entry}", flush=True)
            best = sorted((e for e in row["sweep"] if "ms" in e and e["rel_diff"] < 0.05), key=lambda e: e["ms"])[:5]
            for e in best:
                print(f"BEST d={d} T={t}: {e}", flush=True)
            record["results"].append(row)
            save_record(args.out, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
