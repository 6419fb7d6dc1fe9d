"""The one-pass forward (chained scan, decoupled look-back) beside the backend's two-pass forward, on a GPU.
(Chapter 14.)

    python -m benchmarks.lookback OUT.json [--ncu]

bf16, 16 heads, 32K tokens per call (B = 32768 / T; 1 x 128K at T = 128K), the benchmark's per-head decays,
head dim 64 and 128, T = 2K, 8K, 32K, 128K. At each shape:

* ``two_pass_ms``: ``la2_fast_forward`` as the backend runs a forward (its plan, no states saved);
* ``variants``: :func:`~lightning_edu.triton_kernels.lookback.lookback_forward` with the look-back and with the
  chained scan at each segment length of :data:`SEG_LENS`: median ms of ``triton.testing.do_bench``, the
  largest difference from the two-pass output relative to its largest entry, and whether five more calls gave
  the same output bit for bit (the look-back adds a different number of terms depending on timing);
* ``floor_ms``: the 4-tensor HBM floor at the measured copy bandwidth.

With ``--ncu``, Nsight Compute profiles every kernel of one two-pass forward and of the one-pass forwards at
:data:`NCU_SEG_LENS` at T = 32K (each kernel on its own, caches emptied before it, as
:mod:`benchmarks.kernels` does): its time and the bytes it read from and wrote to DRAM, in tensors
(one of q, k, v, o): the forward must read three and write one. One JSON record with the machine, versions
and commit.
"""

from __future__ import annotations

import json
import sys

from lightning_edu.costs import hbm_floor_bytes
from lightning_edu.environment import environment_record, save_record
from lightning_edu.measure import copy_bandwidth
from lightning_edu.models.decay import head_decays

from .common import usage_refused

__all__ = ["SEG_LENS", "NCU_SEG_LENS", "SHAPES", "main"]

SEG_LENS = (256, 512, 1024)
NCU_SEG_LENS = (256, 1024)
SHAPES = tuple((d, t) for d in (128, 64) for t in (2048, 8192, 32768, 131072))
HEADS = 16

_CHILD = r"""
import json, sys, numpy as np, torch
from lightning_edu.models.decay import head_decays
from lightning_edu.triton_kernels import _tiles
from lightning_edu.triton_kernels.la2_fast import la2_fast_forward
from lightning_edu.triton_kernels.lookback import lookback_forward
D, T = int(sys.argv[1]), int(sys.argv[2])
B, H = max(1, 32768 // T), 16
gen = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(B, H, T, D, device="cuda", generator=gen).bfloat16() / 4 for _ in range(3))
log2_decay = torch.tensor(np.log2(head_decays(H)), dtype=torch.float32, device="cuda")
calls = [("two-pass", lambda: la2_fast_forward(q, k, v, log2_decay))]
for seg_len in SEG_LENS:
    for lookback in (True, False):
        name = f"{'look-back' if lookback else 'chained'} {seg_len}"
        calls.append((name, lambda s=seg_len, lb=lookback: lookback_forward(q, k, v, log2_decay, seg_len=s, lookback=lb)))
launches, where = [], [None]
fast_launch = _tiles._fast_launch
def noted(kernel, grid, *args, **meta):
    launches.append({"pass": where[0], "kernel": kernel.fn.__name__, "grid": list(grid),
                     "exact": bool(meta.get("SAFE", False))})
    return fast_launch(kernel, grid, *args, **meta)
for _, call in calls:
    call()
torch.cuda.synchronize()
_tiles._fast_launch = noted
torch.cuda.cudart().cudaProfilerStart()
for name, call in calls:
    where[0] = name
    call(); torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
print("LAUNCHES " + json.dumps({"launches": launches, "tensor_bytes": q.numel() * q.element_size()}))
"""


def _ncu(D: int, T: int) -> dict:
    from .kernels import _profiled, label_launches

    child = _CHILD.replace("SEG_LENS", repr(NCU_SEG_LENS))
    kernels = ("_la2_fast_forward_kernel", "_segment_state_kernel", "_one_pass_forward_kernel")
    rows, noted = _profiled(child, D, T, "LAUNCHES", kernels)
    data = json.loads(noted)
    return {"D": D, "T": T, "tensor_bytes": data["tensor_bytes"],
            "launches": label_launches(rows, data["launches"], data["tensor_bytes"])}


def main(argv=None) -> int:
    import numpy as np
    import torch
    from triton.testing import do_bench

    from lightning_edu.triton_kernels.la2_fast import la2_fast_forward
    from lightning_edu.triton_kernels.lookback import lookback_forward

    argv = sys.argv[1:] if argv is None else argv
    refused = usage_refused([a for a in argv if a != "--ncu"], __doc__)
    if refused is not None:
        return refused
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    path = next(a for a in argv if a != "--ncu")
    record = {**environment_record("python -m benchmarks.lookback " + " ".join(argv)), "heads": HEADS,
              "dtype": "bfloat16", "seg_lens": list(SEG_LENS), "results": [], "ncu": []}
    bw = copy_bandwidth()
    record["copy_bandwidth_bytes_per_s"] = bw
    log2_decay = torch.tensor(np.log2(head_decays(HEADS)), dtype=torch.float32, device="cuda")

    def save():
        save_record(path, record)

    for d, t in SHAPES:
        batch = max(1, 32768 // t)
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(batch, HEADS, t, d, device="cuda", generator=gen).bfloat16() / 4 for _ in range(3))
        ref = la2_fast_forward(q, k, v, log2_decay)[0].float()
        row = {"d": d, "T": t, "batch": batch, "floor_ms": hbm_floor_bytes(batch, t, HEADS, d) / bw * 1e3,
               "two_pass_ms": do_bench(lambda: la2_fast_forward(q, k, v, log2_decay), return_mode="median"),
               "variants": []}
        for seg_len in SEG_LENS:
            for lookback in (True, False):
                def call(s=seg_len, lb=lookback):
                    return lookback_forward(q, k, v, log2_decay, seg_len=s, lookback=lb)[0]
                o = call()
                row["variants"].append({
                    "lookback": lookback, "seg_len": seg_len, "ms": do_bench(call, return_mode="median"),
                    "rel_err": ((o.float() - ref).abs().max() / ref.abs().max()).item(),
                    "same_bits": all(torch.equal(call(), o) for _ in range(5))})
        record["results"].append(row)
        best = min(row["variants"], key=lambda x: x["ms"])
        print(f"d={d} T={t}: two-pass {row['two_pass_ms']:.3f} ms, best one-pass {best['ms']:.3f} ms "
              f"({'look-back' if best['lookback'] else 'chained'}, {best['seg_len']} rows)", flush=True)
        save()
    if "--ncu" in argv:
        for d in (128, 64):
            record["ncu"].append(_ncu(d, 32768))
            save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
