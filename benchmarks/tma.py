"""la2_fast's forward with descriptor (TMA) loads beside its pointer kernel, on a GPU. (Chapter 14.)

    python -m benchmarks.tma OUT.json

bf16, 16 heads, 32K tokens per call (B = 32768 / T; 1 x 128K at T = 128K), the benchmark's per-head decays, head
dim 64 and 128, T = 2K, 8K, 32K, 128K. At each shape and each tile configuration of :data:`TILES` (``backend``:
the backend's tiles for the shape; the others as named), the GPU's time of one forward with the same tiles and
segments through :func:`~lightning_edu.triton_kernels.la2_fast.la2_fast_forward` (pointers: ``tma=False``) and
through :func:`~lightning_edu.triton_kernels.la2_tma.la2_tma_forward` (descriptors): median of
``triton.testing.do_bench_cudagraph``, each forward (pre-pass, main kernel, exact pass) captured in a CUDA graph
and replayed, so no host time counts. Whether the two outputs agree bit for bit. ``backend_ms``: the backend's
own forward (its plan, the sliced one where it applies) timed the same way. ``floor_ms``: the 4-tensor HBM
floor at the measured copy bandwidth. One JSON record with the machine, versions and commit.
"""

from __future__ import annotations

import sys

from lightning_edu.costs import hbm_floor_bytes
from lightning_edu.environment import save_record
from lightning_edu.models.decay import head_decays

from .common import gpu_record

__all__ = ["TILES", "SHAPES", "main"]

TILES = {  # name -> (block, block_dv, num_warps, num_stages); None: the backend's for the shape
    "backend": None,
    "64 rows, d_v whole, 8 warps, 3 stages": (64, 128, 8, 3),
    "64 rows, 64 columns, 4 warps, 2 stages": (64, 64, 4, 2),
}
SHAPES = tuple((d, t) for d in (128, 64) for t in (2048, 8192, 32768, 131072))
HEADS = 16


def main(argv=None) -> int:
    import numpy as np
    import torch
    from triton.testing import do_bench_cudagraph

    from lightning_edu.triton_kernels.la2_fast import backend_tiles, la2_fast_forward
    from lightning_edu.triton_kernels.la2_tma import la2_tma_forward

    argv = sys.argv[1:] if argv is None else argv
    record = gpu_record(argv, __doc__, "tma", heads=HEADS, dtype="bfloat16",
                        timer="triton.testing.do_bench_cudagraph, median", results=[])
    if isinstance(record, int):
        return record
    bw = record["copy_bandwidth_bytes_per_s"]
    log2_decay = torch.tensor(np.log2(head_decays(HEADS)), dtype=torch.float32, device="cuda")
    for d, t in SHAPES:
        batch = max(1, 32768 // t)
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(batch, HEADS, t, d, device="cuda", generator=gen).bfloat16() / 4 for _ in range(3))
        row = {"d": d, "T": t, "batch": batch, "floor_ms": hbm_floor_bytes(batch, t, HEADS, d) / bw * 1e3,
               "backend_ms": do_bench_cudagraph(lambda: la2_fast_forward(q, k, v, log2_decay), return_mode="median"),
               "tiles": []}
        for name, tiles in TILES.items():
            cfg = dict(zip(("block", "block_dv", "num_warps", "num_stages"), tiles or backend_tiles(q, v)))
            if cfg["block_dv"] is not None and cfg["block_dv"] > d:
                continue  # d_v whole is the 64 columns at d = 64
            pointers = lambda: la2_fast_forward(q, k, v, log2_decay, **cfg, tma=False)  # noqa: E731
            descriptors = lambda: la2_tma_forward(q, k, v, log2_decay, **cfg)  # noqa: E731
            row["tiles"].append({
                "name": name, **cfg, "pointers_ms": do_bench_cudagraph(pointers, return_mode="median"),
                "tma_ms": do_bench_cudagraph(descriptors, return_mode="median"),
                "same_bits": bool(torch.equal(pointers()[0], descriptors()[0]))})
            x = row["tiles"][-1]
            print(f"d={d} T={t} {name}: pointers {x['pointers_ms']:.3f} ms, TMA {x['tma_ms']:.3f} ms", flush=True)
        record["results"].append(row)
        save_record(argv[0], record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
