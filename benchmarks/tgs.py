"""Training speed against context length, measured on one GPU: the Lightning Attention-2 paper's Table 1 (chapter 13).

    python -m benchmarks.tgs --out tgs.json                          # 0.4B and 0.1B, contexts 1K-92K
    python -m benchmarks.tgs --sizes 0.1B --models llama tnl --contexts 1024 8192 --out small.json
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

from lightning_edu.models.tgs import MODELS, PAPER_CONTEXTS, PAPER_TABLE1, build


def main(argv=None) -> int:
    import torch

    from lightning_edu.environment import environment_record, save_record
    from lightning_edu.models.train import train_step

    parser = argparse.ArgumentParser(prog="python -m benchmarks.tgs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["0.4B", "0.1B"])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--contexts", nargs="+", type=int, default=list(PAPER_CONTEXTS))
    parser.add_argument("--tokens", type=int, default=65536, help="tokens per step (batch = tokens // context)")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--budget", type=float, default=math.inf, help="seconds; later points are skipped")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tgs: needs a CUDA GPU (training speed on a CPU says nothing about the GPU)")
    argv = sys.argv[1:] if argv is None else argv
    command = "python -m benchmarks.tgs " + " ".join(argv)
    record = {**environment_record(command), "tokens_per_step": args.tokens, "vocab": args.vocab, "warmup": args.warmup,
              "steps": args.steps, "autocast": "bfloat16", "checkpointing": True, "results": [], "skipped": [],
              "paper": PAPER_TABLE1}
    start = time.perf_counter()

    def save():
        save_record(args.out, record)

    for size in args.sizes:
        for name in args.models:
            try:
                model = build(name, size, args.vocab, max(args.contexts)).cuda()
            except ValueError as exc:  # fla not installed
                record["skipped"].append(f"{size} {name}: {exc}")
                continue
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            for T in args.contexts:
                point = {"size": size, "model": name, "context": T, "params": model.n_params()}
                if time.perf_counter() - start > args.budget:
                    record["skipped"].append(f"{size} {name} {T}: over the time budget")
                    continue
                batch = max(1, args.tokens // T)
                gen = torch.Generator(device="cuda").manual_seed(T)
                tokens = torch.randint(0, args.vocab, (batch, T + 1), device="cuda", generator=gen)
                inputs, targets = tokens[:, :-1], tokens[:, 1:]
                try:
                    for _ in range(args.warmup):
                        train_step(model, opt, inputs, targets, torch.bfloat16)
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    times = []
                    for _ in range(args.steps):
                        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        begin.record()
                        train_step(model, opt, inputs, targets, torch.bfloat16)
                        end.record()
                        end.synchronize()
                        times.append(begin.elapsed_time(end))
                    ms = statistics.median(times)
                    point.update(batch=batch, step_ms=ms, tgs=batch * T / (ms / 1e3),
                                 peak_GiB=torch.cuda.max_memory_allocated() / 2**30)
                except torch.cuda.OutOfMemoryError:
                    point.update(batch=batch, step_ms=None, tgs=None, peak_GiB=None, oom=True)
                opt.zero_grad(set_to_none=True)
                del tokens, inputs, targets
                torch.cuda.empty_cache()
                record["results"].append(point)
                print(point, flush=True)
                save()
            del model, opt
            torch.cuda.empty_cache()
    record["seconds"] = time.perf_counter() - start
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
