"""How many segments: the forward with d_v whole over segment counts, on a GPU. (Chapter 14.)

    python -m benchmarks.segments OUT.json

bf16, d = 128, 16 heads, one sequence of 32K and of 128K tokens, the benchmark's per-head decays. The forward
with no backward to follow, on :data:`~lightning_edu.triton_kernels.la2_fast.WHOLE_DV`'s tiles (64-row blocks,
d_v whole, 8 warps) through descriptors (:func:`~lightning_edu.triton_kernels.la2_tma.la2_tma_forward`), at 3
and 4 pipeline stages, cut into 6 to 16 segments; and the backend's own forward
(:func:`~lightning_edu.triton_kernels.ops.forward_impl` with no states to save), with the segment count it
chose. Each time is the GPU's alone: the median of ``triton.testing.do_bench_cudagraph``, the forward's
launches (pre-pass, main kernel, exact pass) captured in a CUDA graph and replayed. ``floor_frac``: the 4-tensor
HBM floor at the measured copy bandwidth over the time. One JSON record with the machine, versions and commit.

What it shows: a program of these tiles fills an SM by itself (its pipelined tiles take more than half of the
shared memory), so the programs run in waves of one per SM. With 16 (batch, head) pairs on 132 SMs, 8 segments
(128 programs) are one wave; 9 to 16 segments are two, and 16 fill both; the pre-pass reads K and V of every
segment but the last a second time, so fewer segments also move fewer bytes.
"""

from __future__ import annotations

import sys

from lightning_edu.costs import hbm_floor_bytes
from lightning_edu.environment import save_record
from lightning_edu.models.decay import head_decays

from .common import gpu_record

__all__ = ["SEGMENTS", "STAGES", "LENGTHS", "main"]

SEGMENTS = (6, 7, 8, 9, 10, 12, 16)
STAGES = (3, 4)
LENGTHS = (32768, 131072)
HEADS = 16
D = 128


def main(argv=None) -> int:
    import numpy as np
    import torch
    from triton.testing import do_bench_cudagraph

    from lightning_edu.triton_kernels import ops
    from lightning_edu.triton_kernels.plan import WHOLE_DV
    from lightning_edu.triton_kernels.la2_tma import la2_tma_forward

    argv = sys.argv[1:] if argv is None else argv
    record = gpu_record(argv, __doc__, "segments", heads=HEADS, d=D, dtype="bfloat16",
                        timer="triton.testing.do_bench_cudagraph, median", results=[])
    if isinstance(record, int):
        return record
    bw = record["copy_bandwidth_bytes_per_s"]
    record["sm_count"] = torch.cuda.get_device_properties(0).multi_processor_count
    log2_decay = torch.tensor(np.log2(head_decays(HEADS)), dtype=torch.float32, device="cuda")
    for t in LENGTHS:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(1, HEADS, t, D, device="cuda", generator=gen).bfloat16() / 4 for _ in range(3))
        floor_ms = hbm_floor_bytes(1, t, HEADS, D) / bw * 1e3
        cfg, _, num_seg = ops.launch_plan(q, v, None, False)
        ms = do_bench_cudagraph(lambda: ops.forward_impl(q, k, v, log2_decay, None, None, False),
                                return_mode="median")
        row = {"T": t, "floor_ms": floor_ms, "backend": {**cfg, "segments": num_seg, "ms": ms,
                                                          "floor_frac": floor_ms / ms}, "sweep": []}
        print(f"T={t} backend: {num_seg} segments, {ms:.4f} ms ({floor_ms / ms:.2f} of the floor)", flush=True)
        for stages in STAGES:
            for segments in SEGMENTS:
                seg_len = -(-t // (segments * 64)) * 64
                ms = do_bench_cudagraph(
                    lambda: la2_tma_forward(q, k, v, log2_decay, block=64, block_dv=WHOLE_DV["block_dv"],
                                            num_warps=WHOLE_DV["num_warps"], num_stages=stages, seg_len=seg_len),
                    return_mode="median")
                row["sweep"].append({"stages": stages, "segments": segments, "seg_len": seg_len, "ms": ms,
                                     "floor_frac": floor_ms / ms})
                print(f"T={t} {stages} stages, {segments:2d} segments: {ms:.4f} ms", flush=True)
        record["results"].append(row)
        save_record(argv[0], record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
