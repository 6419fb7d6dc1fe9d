"""Decoding without a KV cache: the memory a linear-attention state saves, and the speed of one step. (Chapter 10.)

    python -m benchmarks.decode OUT.json        # on a CUDA machine

Computed anywhere: :func:`kv_cache_bytes` and :func:`state_bytes` (and :func:`memory_table`) for a model of
:data:`MODEL`'s shape. Measured by :func:`main` in one GPU run, one JSON record with the machine, versions and
commit:

* ``memory``: the peak bytes a decode loop of one layer (the model's heads, batch 1) allocates beyond its
  inputs: our step carrying its state in place, and softmax attention (SDPA) over a preallocated KV cache,
  at :data:`MEMORY_CONTEXTS` tokens.
* ``results`` (the speed): one decode step of one layer (:data:`SPEED_HEADS` heads, head dim 128, bf16) at batch 1..256:
  our Triton step kernel called directly (``kernel``), the same step through :func:`lightning_attention_step`
  (``api``: validation included), and SDPA of one query over a KV cache of 4K, 32K and 128K tokens with the
  new key and value written into the cache first (``sdpa flash`` / ``sdpa efficient``). Each timed three
  ways: ``loop_ms``, the wall time per step of up to :data:`LOOP_STEPS` steps called back to back from Python
  (what a decode loop without CUDA graphs gets: the host's time per step wherever it exceeds the GPU's), the
  median of :data:`LOOP_ROUNDS` rounds; ``ms``, ``triton.testing.do_bench`` (each call timed alone after a
  write that flushes L2, during which the host prepares the call: GPU time from a cold cache, host time
  hidden); and, where it captures, ``graph_ms``, replayed from a CUDA graph (``do_bench_cudagraph``: the GPU
  time alone). A cache that would not fit in :data:`CACHE_LIMIT_BYTES` is recorded as skipped.
"""

from __future__ import annotations

import json
import sys
import time

from lightning_edu.costs import MEMORY_CONTEXTS, MODEL, kv_cache_bytes, step_floor_bytes

__all__ = ["SPEED_BATCHES", "SPEED_CONTEXTS", "SPEED_HEADS", "CACHE_LIMIT_BYTES", "LOOP_STEPS", "LOOP_ROUNDS", "main"]

SPEED_BATCHES = (1, 4, 16, 64, 256)
SPEED_CONTEXTS = (4096, 32768, 131072)
SPEED_HEADS = 16
#: The largest KV cache (one layer) the speed run allocates; larger points are recorded as not fitting.
CACHE_LIMIT_BYTES = 40 * 2**30
#: Steps of one back-to-back round of ``loop_ms`` (fewer for a call slower than 0.2 ms), and its rounds (the
#: median is recorded).
LOOP_STEPS = 1000
LOOP_ROUNDS = 5


def main(argv=None) -> int:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench, do_bench_cudagraph

    from lightning_edu.api import lightning_attention_step
    from lightning_edu.environment import environment_record, save_record
    from lightning_edu.measure import copy_bandwidth
    from lightning_edu.models.decay import head_decays
    from lightning_edu.triton_kernels import log2_decay_tensor
    from lightning_edu.triton_kernels.decode import decode_step

    from .common import usage_refused

    argv = sys.argv[1:] if argv is None else argv
    refused = usage_refused(argv, __doc__)
    if refused is not None:
        return refused
    if not torch.cuda.is_available():
        print("python -m benchmarks.decode measures on a CUDA GPU; none is available here.")
        return 2
    path = argv[0]
    record = {**environment_record("python -m benchmarks.decode " + " ".join(argv)), "model": MODEL,
              "speed_heads": SPEED_HEADS, "head_dim": 128, "dtype": "bfloat16", "memory": [], "results": [],
              "errors": []}
    record["copy_bandwidth_bytes_per_s"] = copy_bandwidth()
    start = time.time()
    gen = torch.Generator(device="cuda").manual_seed(0)
    d = 128

    def save():
        save_record(path, record)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)

    def peak_beyond(run) -> int:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated() - base)

    # -- memory: one layer, the model's heads, batch 1, a loop of `steps` new tokens after a context of n.
    heads = MODEL["heads"]
    steps = 16
    l2 = log2_decay_tensor(head_decays(heads).tolist(), "cuda")
    q, k, v = (rand(1, heads, steps, d) for _ in range(3))
    for n in MEMORY_CONTEXTS:
        def ours():
            state = torch.zeros(1, heads, d, d, device="cuda")  # the prefill's state stands here
            for t in range(steps):
                decode_step(q[:, :, t], k[:, :, t], v[:, :, t], state, l2, out_state=state)

        def softmax():
            cache_k = torch.zeros(1, heads, n + steps, d, device="cuda", dtype=torch.bfloat16)
            cache_v = torch.zeros_like(cache_k)
            for t in range(steps):
                cache_k[:, :, n + t] = k[:, :, t]
                cache_v[:, :, n + t] = v[:, :, t]
                F.scaled_dot_product_attention(q[:, :, t:t + 1], cache_k[:, :, :n + t + 1], cache_v[:, :, :n + t + 1])

        for method, run in (("ours", ours), ("sdpa", softmax)):
            try:
                row = dict(method=method, tokens=n, heads=heads, peak_extra_bytes=peak_beyond(run))
            except Exception as e:  # a failed point is recorded, not fatal
                row = dict(method=method, tokens=n, error=repr(e)[:300])
            record["memory"].append(row)
            print(f"{time.time() - start:5.0f}s", json.dumps(row), flush=True)
            save()
    torch.cuda.empty_cache()

    # -- speed: one step of one layer.
    heads = SPEED_HEADS
    decay = head_decays(heads).tolist()
    l2 = log2_decay_tensor(decay, "cuda")

    def back_to_back(fn) -> float:
        # ms per call of calls in a row, nothing between them: the median of LOOP_ROUNDS rounds, each of
        # LOOP_STEPS calls or of as many as take about 0.2 s (at least 10) for a slow call
        def per_call(steps):
            torch.cuda.synchronize()
            start_s = time.perf_counter()
            for _ in range(steps):
                fn()
            torch.cuda.synchronize()
            return (time.perf_counter() - start_s) / steps * 1e3

        steps = max(10, min(LOOP_STEPS, int(200 / max(per_call(3), 1e-3))))
        return sorted(per_call(steps) for _ in range(LOOP_ROUNDS))[LOOP_ROUNDS // 2]

    def timed(method, batch, context, fn, **extra):
        row = dict(method=method, batch=batch, context=context, **extra)
        for key, bench in (("loop_ms", lambda: back_to_back(fn)),
                           ("ms", lambda: do_bench(fn, warmup=25, rep=200, return_mode="median")),
                           ("graph_ms", lambda: do_bench_cudagraph(fn, rep=200, return_mode="median"))):
            try:
                row[key] = bench()
                row[key.replace("ms", "tokens_per_s")] = batch / (row[key] * 1e-3)
            except Exception as e:
                row[key + "_error"] = repr(e)[:200]
        record["results"].append(row)
        print(f"{time.time() - start:5.0f}s", json.dumps(row), flush=True)
        save()

    for batch in SPEED_BATCHES:
        q, k, v = (rand(batch, heads, d) for _ in range(3))
        state = torch.randn(batch, heads, d, d, device="cuda", generator=gen) * 0.01
        floor = step_floor_bytes(batch, heads, d, d)
        timed("ours kernel", batch, None, lambda: decode_step(q, k, v, state, l2, out_state=state), floor_bytes=floor)
        timed("ours api", batch, None, lambda: lightning_attention_step(q, k, v, state, decay, backend="triton"),
              floor_bytes=floor)
        for n in SPEED_CONTEXTS:
            cache = kv_cache_bytes(n + 1, layers=1, heads=heads, head_dim=d, batch=batch)
            if cache > CACHE_LIMIT_BYTES:
                record["results"].append(dict(method="sdpa", batch=batch, context=n, cache_bytes=cache,
                                            skipped=f"a KV cache of {cache / 2**30:.0f} GiB for one layer"))
                save()
                continue
            cache_k = torch.empty(batch, heads, n + 1, d, device="cuda", dtype=torch.bfloat16).normal_(generator=gen)
            cache_v = torch.empty_like(cache_k).normal_(generator=gen)
            for name, backend in (("sdpa flash", SDPBackend.FLASH_ATTENTION),
                                  ("sdpa efficient", SDPBackend.EFFICIENT_ATTENTION)):
                def step(backend=backend):
                    cache_k[:, :, n] = k
                    cache_v[:, :, n] = v
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(q[:, :, None], cache_k, cache_v)

                timed(name, batch, n, step, cache_bytes=cache)
            cache_k = cache_v = None  # free this cache before the next, larger one
            torch.cuda.empty_cache()
    print(f"{time.time() - start:5.0f}s done", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
