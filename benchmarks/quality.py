"""Record what linear attention costs in quality (chapter 13): :func:`lightning_edu.models.quality.lm_run` and
:func:`~lightning_edu.models.quality.mqar_run` for every attention of a preset.

    python -m benchmarks.quality --preset gpu --only lm --out quality_lm.json      # the recorded preset (chapter 13)
    python -m benchmarks.quality --preset gpu --only mqar --budget 200 --out quality_mqar.json  # likewise
    python -m benchmarks.quality --preset cpu --out quality.json   # a CPU: about a minute each (PRESETS)
    python -m benchmarks.quality --preset gpu --only mqar --seeds 0 1 2 --jobs 8 --out q.json   # 8 runs at a time

``--jobs N`` trains N runs at a time, each in its own process (spawned: CUDA does not survive a fork). A run's
result does not depend on N (its seed fixes its weights and batches); its ``seconds`` does, since the runs share
the machine, and the record says N. Why: the recorded models are small enough that one run leaves most of a GPU
idle between its kernel launches.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import multiprocessing
import os
import sys
import time

import torch

from lightning_edu.environment import environment_record, save_record
from lightning_edu.models.lm import split_corpus
from lightning_edu.models.quality import KINDS, PRESETS, lm_run, mqar_run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quality", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--only", choices=("lm", "mqar"), default=None)
    parser.add_argument("--budget", type=float, default=math.inf, help="seconds; later runs are skipped past it")
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="seeds of every run (default: the preset's for the language model, 0 for MQAR)")
    parser.add_argument("--steps", type=int, default=None, help="training steps of every run (default: the preset's)")
    parser.add_argument("--pairs", type=int, nargs="+", default=None, help="MQAR's pair counts (default: the preset's)")
    parser.add_argument("--short-conv", type=int, default=0, metavar="WIDTH",
                        help="a causal depthwise convolution of this width (>= 2) before every attention, as Zoology "
                             "gives every model (default 0: none)")
    parser.add_argument("--jobs", type=int, default=1, help="runs trained at a time, one process each (default 1)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    for name in ("seeds", "pairs"):
        if getattr(args, name) is not None and len(set(getattr(args, name))) != len(getattr(args, name)):
            parser.error(f"--{name} lists a value twice: {getattr(args, name)}")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if args.pairs is not None and min(args.pairs) < 1:
        parser.error(f"--pairs must be at least 1, got {args.pairs}")
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    if args.short_conv < 0 or args.short_conv == 1:
        parser.error(f"--short-conv must be 0 (none) or a width of at least 2, got {args.short_conv}")
    preset = {name: dict(cfg) for name, cfg in PRESETS[args.preset].items()}
    for cfg in preset.values():
        if args.steps is not None:
            cfg["steps"] = args.steps
        if args.short_conv:
            cfg["short_conv"] = args.short_conv
    if args.seeds is not None:
        preset["lm"]["seeds"] = tuple(args.seeds)
    mqar_seeds = tuple(args.seeds) if args.seeds is not None else (0,)
    if args.pairs is not None:
        preset["mqar"]["pairs"] = tuple(args.pairs)
    device = "cuda" if args.preset == "gpu" else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("quality: --preset gpu needs a CUDA GPU; use --preset cpu here")
    autocast_dtype = torch.bfloat16 if device == "cuda" else None
    command = "python -m benchmarks.quality " + " ".join(argv)
    record = {**environment_record(command, device=device), "preset": args.preset, "config": preset,
              "mqar_seeds": list(mqar_seeds),
              "autocast": str(autocast_dtype), "jobs": args.jobs, "results": [], "skipped": []}
    runs = []  # (what, experiment, kind, pairs, seed) in the record's order
    data = None  # the corpus split, read once when the language model runs
    if args.only in (None, "lm"):
        data = split_corpus()
        record["corpus"] = {"source": "pydoc_data.topics", "train_bytes": len(data[0]), "valid_bytes": len(data[1])}
        runs += [(f"lm {kind} seed {seed}", "lm", kind, None, seed)
                 for seed in preset["lm"]["seeds"] for kind in args.kinds]
    if args.only in (None, "mqar"):
        # seeds outermost: a run cut short by the budget has every cell at one seed first
        runs += [(f"mqar {kind} pairs {pairs}" + (f" seed {seed}" if len(mqar_seeds) > 1 else ""), "mqar", kind,
                  pairs, seed) for seed in mqar_seeds for pairs in preset["mqar"]["pairs"] for kind in args.kinds]

    def save():
        save_record(args.out, record)

    def report(r):
        if r["experiment"] == "lm":
            print(f"lm {r['kind']} seed {r['seed']}: {r['best_valid_loss']:.4f}", flush=True)
        else:
            print(f"mqar {r['kind']} {r['pairs']} seed {r['seed']}: {r['accuracy']:.3f} ({r['seconds']:.1f} s)",
                  flush=True)

    start = time.perf_counter()
    if args.jobs == 1:
        for what, experiment, kind, pairs, seed in runs:
            if time.perf_counter() - start > args.budget:
                record["skipped"].append(what)
                continue
            r = _train(experiment, kind, pairs, seed, preset[experiment], device, autocast_dtype, data)
            record["results"].append(r)
            report(r)
            save()
    else:
        done = {}
        deadline = time.time() + args.budget  # a wall-clock time every worker can read
        context = multiprocessing.get_context("spawn")
        threads = max(1, (os.cpu_count() or 1) // args.jobs)  # the CPU preset's workers share the cores
        with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=context, initializer=torch.set_num_threads,
                                                    initargs=(threads,)) as pool:
            futures = {pool.submit(_one_run, experiment, kind, pairs, seed, preset[experiment], device,
                                   autocast_dtype, deadline): i
                       for i, (_, experiment, kind, pairs, seed) in enumerate(runs)}
            for future in concurrent.futures.as_completed(futures):
                done[futures[future]] = r = future.result()
                if r is not None:
                    report(r)
                record["results"] = [done[i] for i in sorted(done) if done[i] is not None]
                record["skipped"] = [runs[i][0] for i in sorted(done) if done[i] is None]
                save()
    save()
    return 0


def _train(experiment, kind, pairs, seed, cfg, device, autocast_dtype, data=None):
    """One run's record: the language model (on ``data``, the corpus split, read when None) or MQAR."""
    if experiment == "lm":
        return {"experiment": "lm", **lm_run(kind, cfg, seed, device, data or split_corpus(), autocast_dtype)}
    return {"experiment": "mqar", **mqar_run(kind, cfg, pairs, seed, device, autocast_dtype)}


def _one_run(experiment, kind, pairs, seed, cfg, device, autocast_dtype, deadline):
    """One run of ``--jobs``, in a worker process: its record, or None when it would start past ``deadline``."""
    if time.time() > deadline:
        return None
    return _train(experiment, kind, pairs, seed, cfg, device, autocast_dtype)


if __name__ == "__main__":
    raise SystemExit(main())
