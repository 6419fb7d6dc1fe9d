"""The paper's Figure 3 on this GPU: LA-1, LA-2 (literal and fast) and softmax against the sequence length.
(Chapter 08.)

    python -m benchmarks.figure3 OUT.json        # on a GPU machine; written after every row
"""

from __future__ import annotations

import os
import sys

import torch

from lightning_edu.environment import environment_record, save_record
from lightning_edu.measure import copy_bandwidth
from lightning_edu.models.decay import head_decays
from lightning_edu.triton_kernels import VARIANTS, kernel_config, log2_decay_tensor
from lightning_edu.triton_kernels._tiles import sm_count
from lightning_edu.triton_kernels.la1 import la1_backward, la1_forward
from lightning_edu.triton_kernels.la2_literal import la2_literal_backward, la2_literal_forward

from .common import usage_refused

__all__ = ["figure3_benchmark"]


def figure3_benchmark(seq_lens=(1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072), heads: int = 16,
                      head_dim: int = 128, batch: int = 1, dtype=torch.bfloat16, progress=print) -> dict:
    """The paper's Figure 3 on this GPU: runtime and peak extra memory of the forward and the backward pass
    against the sequence length T for LA-1 (``la1``), LA-2 literal (``la2_literal``), LA-2 fast
    (``la2_fast``, the backend's kernels) and softmax (``scaled_dot_product_attention``, causal). (Chapter 08.)

    Batch and heads are fixed, so LA-2 grows linearly in T and the other two quadratically. Times are
    ``triton.testing.do_bench`` medians in ms: "fwd" is the forward alone, "bwd" the backward alone (for
    our kernels: the backward launches; for softmax: autograd's backward, replayed on a retained graph). Memory is torch.cuda's peak allocation above the inputs, in MiB,
    for the forward alone and for forward + backward. Returns {"copy_bandwidth_GBps", "results": [...]}.
    """
    from triton.testing import do_bench

    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("figure3_benchmark times GPU kernels: it needs CUDA and TRITON_INTERPRET unset")
    dev = "cuda"
    # Device-to-device copy bandwidth (bytes read + written), the HBM ceiling the floors are divided by.
    copy_gbps = copy_bandwidth() / 1e9
    progress({"copy_bandwidth_GBps": copy_gbps})
    decay = head_decays(heads)  # the benchmark's per-head schedule (bench.head_decays)
    log2_decay = log2_decay_tensor(decay, dev)

    def la2_fwd(q, k, v):
        return la2_literal_forward(q, k, v, log2_decay)[0]

    def la2_bwd(q, k, v, do):
        return la2_literal_backward(q, k, v, do, log2_decay)

    def sdpa_fwd(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    fast_fwd, fast_bwd = VARIANTS["la2_fast"]
    cfg = kernel_config(head_dim, head_dim, dtype, batch_heads=batch * heads,
                        sms=sm_count(torch.device(dev)))  # the backend's tiles
    methods = {
        "la1": (lambda q, k, v: la1_forward(q, k, v, decay), lambda q, k, v, do: la1_backward(q, k, v, do, decay)),
        "la2_literal": (la2_fwd, la2_bwd),
        "la2_fast": (lambda q, k, v: fast_fwd(q, k, v, log2_decay, None, **cfg)[0],
                     lambda q, k, v, do: fast_bwd(q, k, v, do, log2_decay, None, None, **cfg)),
        "softmax": (sdpa_fwd, None),
    }
    results = []
    for T in seq_lens:
        shape = (batch, heads, T, head_dim)
        q, k, v, do = (torch.randn(shape, device=dev, dtype=dtype) for _ in range(4))
        for name, (fwd, bwd) in methods.items():
            row = {"method": name, "T": T, "batch": batch, "heads": heads, "D": head_dim, "dtype": str(dtype).split(".")[-1]}
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                if bwd is None:  # softmax: autograd
                    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                    o = fwd(qg, kg, vg)
                    torch.cuda.synchronize()
                    row["fwd_peak_MiB"] = (torch.cuda.max_memory_allocated() - base) / 2**20
                    o.backward(do)
                    torch.cuda.synchronize()
                    row["fwdbwd_peak_MiB"] = (torch.cuda.max_memory_allocated() - base) / 2**20
                    del o
                    with torch.no_grad():
                        row["fwd_ms"] = do_bench(lambda: fwd(q, k, v), return_mode="median")
                    o = fwd(qg, kg, vg)
                    row["bwd_ms"] = do_bench(lambda: o.backward(do, retain_graph=True), return_mode="median",
                                             grad_to_none=[qg, kg, vg])
                    del o, qg, kg, vg
                else:
                    o = fwd(q, k, v)
                    torch.cuda.synchronize()
                    row["fwd_peak_MiB"] = (torch.cuda.max_memory_allocated() - base) / 2**20
                    grads = bwd(q, k, v, do)
                    torch.cuda.synchronize()
                    row["fwdbwd_peak_MiB"] = (torch.cuda.max_memory_allocated() - base) / 2**20
                    del o, grads
                    row["fwd_ms"] = do_bench(lambda: fwd(q, k, v), return_mode="median")
                    row["bwd_ms"] = do_bench(lambda: bwd(q, k, v, do), return_mode="median")
            except torch.cuda.OutOfMemoryError:
                row["error"] = "out of memory"
            results.append(row)
            progress(row)
        del q, k, v, do
    return {"copy_bandwidth_GBps": copy_gbps, "results": results}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    refused = usage_refused(argv, __doc__)
    if refused is not None:
        return refused
    target = argv[0]
    record = {**environment_record("python -m benchmarks.figure3 " + " ".join(argv)),
              "copy_bandwidth_GBps": None, "results": []}

    def save(row):  # rewrite after every row, so a run cut short still leaves what it measured
        print(row, flush=True)
        if "copy_bandwidth_GBps" in row:
            record["copy_bandwidth_GBps"] = row["copy_bandwidth_GBps"]
        else:
            record["results"].append(row)
        save_record(target, record)

    figure3_benchmark(progress=save)
    print("wrote", target)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
