"""Record the torch forms' time and peak memory against n, on CPU or CUDA (chapter 06): the sweeps of
:mod:`lightning_edu.sweeps` at the sizes below, written in the book's recorded-data format.

    python -m benchmarks.torch_sweep --out FILE [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from lightning_edu.environment import environment_record
from lightning_edu.sweeps import _decay, headline_benchmark, sweep_block_sizes, sweep_forms


def _main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.torch_sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16", "float64"),
                        help="default float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--batch", type=int, default=None, help="default 1 on CPU, 4 on CUDA")
    parser.add_argument("--heads", type=int, default=None, help="default 2 on CPU, 8 on CUDA")
    parser.add_argument("--dim", type=int, default=64, help="d_k = d_v")
    parser.add_argument("--min-n", type=int, default=256)
    parser.add_argument("--max-n", type=int, default=65536)
    parser.add_argument("--max-quadratic-n", type=int, default=8192)
    parser.add_argument("--max-recurrent-n", type=int, default=16384)
    parser.add_argument("--bench-n", type=int, default=16384)
    parser.add_argument("--block-sizes", default="16,32,48,64,96,128,256,512")
    parser.add_argument("--budget", type=float, default=1.0, help="seconds of repeats per timed point")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--bench-threads", default="", help="also run the benchmark at these thread counts, e.g. 1,2")
    parser.add_argument("--bench-heads", default="", help="also run the benchmark with these numbers of heads, e.g. 1,4")
    ns = parser.parse_args(argv)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    cuda = ns.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no CUDA device")
    dtype = getattr(torch, ns.dtype or ("bfloat16" if cuda else "float32"))
    batch = ns.batch or (4 if cuda else 1)
    heads = ns.heads or (8 if cuda else 2)
    config = {"batch": batch, "heads": heads, "d_k": ns.dim, "d_v": ns.dim, "dtype": str(dtype).replace("torch.", ""),
              "device": ns.device, "decay": [round(float(x), 6) for x in _decay(None, heads)], "block_size": 64,
              "max_quadratic_n": ns.max_quadratic_n, "max_recurrent_n": ns.max_recurrent_n}
    command = "python -m benchmarks.torch_sweep " + " ".join(argv if argv is not None else sys.argv[1:])
    record = {**environment_record(command, ns.device), "config": config, "results": {}}
    out = Path(ns.out)

    def save():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1) + "\n")

    def log(line):
        print(line, flush=True)

    kw = dict(batch=batch, heads=heads, d=ns.dim, dtype=dtype, device=ns.device, log=log)
    log(f"{record['machine']} | torch {record['torch']} | {config}")
    sizes = [n for n in (2**p for p in range(6, 21)) if ns.min_n <= n <= ns.max_n]
    record["results"]["benchmark"] = headline_benchmark(ns.bench_n, **kw)
    save()
    if ns.bench_threads and not cuda:  # the same benchmark at other thread counts: how each form uses the cores
        default_threads = torch.get_num_threads()
        record["results"]["benchmark_threads"] = {}
        for threads in (int(t) for t in ns.bench_threads.split(",")):
            torch.set_num_threads(threads)
            record["results"]["benchmark_threads"][str(threads)] = headline_benchmark(ns.bench_n, **kw)
            save()
        torch.set_num_threads(default_threads)
    if ns.bench_heads:  # the per-token scan is bound by its n steps, the chunk-parallel form by arithmetic (~ heads)
        record["results"]["benchmark_heads"] = {}
        for h in (int(x) for x in ns.bench_heads.split(",")):
            record["results"]["benchmark_heads"][str(h)] = headline_benchmark(ns.bench_n, **{**kw, "heads": h})
            save()
    record["results"]["sweep"] = sweep_forms(sizes, max_quadratic_n=ns.max_quadratic_n, max_recurrent_n=ns.max_recurrent_n,
                                       budget_s=ns.budget, **kw)
    save()
    blocks = [int(b) for b in ns.block_sizes.split(",")]
    record["results"]["block_sizes"] = sweep_block_sizes(ns.bench_n, blocks, budget_s=ns.budget, **kw)
    save()
    log(f"wrote {out}")
    return record


if __name__ == "__main__":
    _main()
