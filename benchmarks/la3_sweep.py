"""The recompute-heavy backward on a GPU: its tiles beside la2_fast's backward, and what every kernel uses on
chip. (Chapter 09.)

    python -m benchmarks.la3_sweep OUT.json

Two parts, one JSON record (with the machine, versions and commit):

* ``results``: the backward alone (the forward's saved states given), bf16, 16 heads, 32K tokens per call
  (128K at T = 128K), head dim 64 and 128; la2_fast's backward and la3 at each (chunk, micro, warps) of
  :data:`TILES`; median of ``triton.testing.do_bench``, peak memory beyond the inputs, and the 7-tensor
  HBM floor's bytes (q, k, v, do in; dq, dk, dv out).
* ``resources``: shared memory, registers and spills of every kernel compiled (fast and exact passes) at head
  dim 64 and 128: la3's in bf16 and fp32; la2_fast's, la2_literal's and, when the ``lightning_attn`` package
  imports, the original Lightning Attention-2 kernels' in bf16.
"""

from __future__ import annotations

import json
import math
import sys
import time

from lightning_edu.environment import environment_record, save_record
from lightning_edu.models.decay import head_decays
from lightning_edu.triton_kernels.resources import compiled_resources

from .common import usage_refused

__all__ = ["TILES", "main"]

# name -> la3_backward keyword arguments (the dK/dV kernel's chunk, micro-chunk, warps, stages)
TILES = {
    "la3 64/16/4w": dict(chunk=64, micro=16, dkdv_warps=4, dkdv_stages=1),
    "la3 64/32/4w": dict(chunk=64, micro=32, dkdv_warps=4, dkdv_stages=1),
    "la3 64/64/4w": dict(chunk=64, micro=64, dkdv_warps=4, dkdv_stages=1),
    "la3 64/64/8w": dict(chunk=64, micro=64, dkdv_warps=8, dkdv_stages=1),
}
HEADS = 16



def main(argv=None) -> int:
    import torch
    from triton.testing import do_bench

    from lightning_edu.triton_kernels import kernel_config, log2_decay_tensor, tiles_for
    from lightning_edu.triton_kernels.la2_fast import la2_fast_backward, la2_fast_forward
    from lightning_edu.triton_kernels.la2_literal import la2_literal_backward, la2_literal_forward
    from lightning_edu.triton_kernels.la3 import la3_backward

    argv = sys.argv[1:] if argv is None else argv
    refused = usage_refused(argv, __doc__)
    if refused is not None:
        return refused
    path = argv[0]
    record = {**environment_record("python -m benchmarks.la3_sweep " + " ".join(argv)), "heads": HEADS,
              "results": [], "resources": [], "errors": []}

    def save():
        save_record(path, record)

    decay = head_decays(HEADS).tolist()
    l2 = log2_decay_tensor(decay, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    start = time.time()

    def make(batch, n, d, dtype):
        return (torch.randn(batch, HEADS, n, d, device="cuda", generator=gen) * d**-0.5).to(dtype)

    def keep(records, **what):
        for r in records:
            r.update(what)
            record["resources"].append(r)

    for d in (128, 64):
        for n in (2048, 8192, 32768, 131072):
            batch = max(1, 32768 // n)
            q, k, v, do = (make(batch, n, d, torch.bfloat16) for _ in range(4))
            cfg = tiles_for(q, v)  # the backend's tiles for this call
            _, _, saved = la2_fast_forward(q, k, v, l2, None, save_states=True, **cfg)
            runs = {"la2_fast": lambda: la2_fast_backward(q, k, v, do, l2, None, None, saved=saved, **cfg)}
            for name, tiles in TILES.items():
                runs[name] = lambda tiles=tiles: la3_backward(q, k, v, do, l2, None, None, saved=saved, **cfg, **tiles)
            for name, run in runs.items():
                try:
                    keep(compiled_resources(run), what=name + " backward", D=d, dtype="bfloat16")
                    torch.cuda.synchronize()
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                    run()
                    torch.cuda.synchronize()
                    peak = torch.cuda.max_memory_allocated() - base
                    ms = do_bench(run, warmup=10, rep=100, return_mode="median")
                    row = dict(method=name, D=d, T=n, B=batch, bwd_ms=ms, peak_extra_bytes=int(peak),
                               floor_bytes=7 * batch * n * HEADS * d * 2)
                except Exception as e:  # a failed point is recorded, not fatal
                    row = dict(method=name, D=d, T=n, error=repr(e)[:300])
                record["results"].append(row)
                print(f"{time.time() - start:5.0f}s", json.dumps(row), flush=True)
                save()

    try:
        from lightning_attn.ops import lightning_attn_func
    except Exception as e:  # optional: the original kernels
        lightning_attn_func = None
        record["errors"].append(f"lightning_attn not imported: {e!r}"[:300])
    for d in (64, 128):
        for dtype in (torch.bfloat16, torch.float32):
            q, k, v, do = (make(1, 1024, d, dtype) for _ in range(4))
            cfg = kernel_config(d, d, dtype)
            name = str(dtype).replace("torch.", "")
            jobs = {  # every la3 kernel in both dtypes; the others in bf16, as they are benchmarked
                "la3 backward": lambda: la3_backward(q, k, v, do, l2, None, None, **cfg),
                "la3 64/16/4w backward": lambda: la3_backward(q, k, v, do, l2, None, None, **cfg, **TILES["la3 64/16/4w"]),
            }
            if dtype == torch.bfloat16:
                jobs.update({
                    "la2_fast forward": lambda: la2_fast_forward(q, k, v, l2, None, save_states=True, **cfg),
                    "la2_fast backward": lambda: la2_fast_backward(q, k, v, do, l2, None, None, **cfg),
                    "la2_literal forward+backward": lambda: (la2_literal_forward(q, k, v, l2, None),
                                                             la2_literal_backward(q, k, v, do, l2, None, None)),
                })
            if lightning_attn_func is not None and dtype == torch.bfloat16:
                s = torch.tensor([-math.log(x) for x in decay], device="cuda", dtype=torch.float32)

                def original():
                    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
                    lightning_attn_func(*leaves, s).backward(do)

                jobs["original LA-2 forward+backward"] = original
            for what, job in jobs.items():
                try:
                    keep(compiled_resources(job, prefixes=("lightning_edu", "lightning_attn")), what=what, D=d,
                         dtype=name)
                except Exception as e:
                    record["errors"].append(f"{what} D={d} {name}: {e!r}"[:300])
                print(f"{time.time() - start:5.0f}s compiled {what} D={d} {name}", flush=True)
                save()
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
