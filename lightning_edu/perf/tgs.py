"""Training speed against context length: the Lightning Attention-2 paper's Table 1, measured on one GPU.

    python -m lightning_edu.perf.tgs --out tgs.json                          # 0.4B and 0.1B, contexts 1K-92K
    python -m lightning_edu.perf.tgs --sizes 0.1B --models llama tnl --contexts 1024 8192 --out small.json

TGS (tokens per GPU per second) of a whole training step: forward, backward and AdamW update of a decoder
(:mod:`lightning_edu.models`), bf16 autocast, activation checkpointing on every block, random tokens from a
32000-token vocabulary. Each step carries ``--tokens`` tokens (batch = tokens / context), or one sequence
when the context is longer. Four models per size, the paper's three and fla's kernel:

* ``llama``   -- LLaMA-style, causal softmax attention through PyTorch's SDPA (FlashAttention kernels)
* ``tnl``     -- TransNormerLLM-style with this book's lightning attention (Triton, ``backend="triton"``)
* ``tnl_la1`` -- the same model with this book's Lightning Attention-1 kernel (quadratic)
* ``tnl_fla`` -- the same model with flash-linear-attention's ``chunk_simple_gla`` (when fla imports)

For each (size, model, context): ``--warmup`` steps (compilation, autotuning), then the median over
``--steps`` timed steps (``torch.cuda.Event`` around each), and the peak memory of the timed steps. A step
that runs out of memory is recorded as "OOM". Results are written after every point; past ``--budget``
seconds the remaining points are listed as skipped. Refuses to run without CUDA: CPU numbers would say
nothing about the GPU.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import numpy as np

__all__ = ["MODELS", "PAPER_TABLE1", "build", "fit_tgs", "main"]

MODELS = ("tnl", "tnl_fla", "llama", "tnl_la1")

PAPER_CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 81920, 94208)

PAPER_TABLE1 = {
    "contexts": PAPER_CONTEXTS,
    "hardware": "2 x A100 80GB",
    "tgs": {
        "0.4B": {"LLaMA-FA2": (35931, 32453, 28184, 21996, 15479, 9715, 5643, 4604, 4078),
                 "TNL-LA1": (41789, 39043, 34894, 28627, 21112, 13852, 8247, 6824, 6012),
                 "TNL-LA2": (38615, 38680, 38714, 38172, 37755, 37364, 38278, 38457, 38596)},
        "1B": {"LLaMA-FA2": (14897, 13990, 12644, 10887, 8468, 5836, 3820, 3167, None),
               "TNL-LA1": (21195, 20128, 18553, 16012, 12594, 8848, 5611, 4625, None),
               "TNL-LA2": (20052, 19967, 20009, 19841, 19805, 19691, 20077, 20186, None)},
        "3B": {"LLaMA-FA2": (7117, 6708, 6008, 4968, 3755, 2558, None, None, None),
               "TNL-LA1": (8001, 7649, 7117, 6152, 4859, 3512, None, None, None),
               "TNL-LA2": (7524, 7593, 7599, 7559, 7545, 7545, None, None, None)},
    },
}
"""The Lightning Attention-2 paper's Table 1: TGS on 2 x A100 80GB at the contexts above (None: out of memory)."""


def fit_tgs(contexts, tgs) -> tuple[float, float]:
    """(a, b) of the straight line ``1 / TGS = a + b T`` fitted by least squares: seconds per token. (Chapter 13.)

    a is what a token costs whatever the context (projections, MLP, output layer, optimiser); b what each token
    of context adds to it (softmax attention and LA-1 compute about T / 2 scores per token). For lightning
    attention b should be about 0. Points whose TGS is None (out of memory) are left out; at least two must remain.
    """
    contexts, tgs = list(contexts), list(tgs)
    if len(contexts) != len(tgs):
        raise ValueError(f"contexts and tgs must have the same length, got {len(contexts)} and {len(tgs)}")
    pairs = [(float(T), float(x)) for T, x in zip(contexts, tgs) if x is not None]
    if len(pairs) < 2:
        raise ValueError(f"fit_tgs needs at least two measured points, got {len(pairs)}")
    T, x = np.array(pairs).T
    if not np.all(x > 0):
        raise ValueError("every TGS must be > 0")
    b, a = np.polyfit(T, 1.0 / x, 1)
    return float(a), float(b)


def build(model: str, size: str, vocab: int, max_len: int):
    """The decoder named ``model`` (one of :data:`MODELS`) at ``size``, with activation checkpointing."""
    from ..models import llama, tnl

    if model not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {model!r}")
    if model == "llama":
        return llama(vocab, size, max_len=max_len, checkpoint=True)
    attention = {"tnl": "lightning", "tnl_la1": "la1", "tnl_fla": "fla"}[model]
    return tnl(vocab, size, attention, max_len=max_len, checkpoint=True, backend="triton")


def main(argv=None) -> int:
    import torch

    from ..models.train import train_step
    from .environment import environment_record, save_record

    parser = argparse.ArgumentParser(prog="python -m lightning_edu.perf.tgs", description=__doc__.split("\n\n")[0])
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
    command = "python -m lightning_edu.perf.tgs " + " ".join(argv)
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
