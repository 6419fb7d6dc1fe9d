"""Record what linear attention costs in quality (chapter 13): :func:`lightning_edu.models.quality.lm_run` and
:func:`~lightning_edu.models.quality.mqar_run` for every attention of a preset.

    python -m benchmarks.quality --preset gpu --only lm --out quality_lm.json      # the recorded preset (chapter 13)
    python -m benchmarks.quality --preset gpu --only mqar --budget 200 --out quality_mqar.json  # likewise
    python -m benchmarks.quality --preset cpu --out quality.json   # a CPU: about a minute each (PRESETS)
"""

from __future__ import annotations

import argparse
import math
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
              "autocast": str(autocast_dtype), "results": [], "skipped": []}
    start = time.perf_counter()

    def save():
        save_record(args.out, record)

    def over_budget(what):
        if time.perf_counter() - start > args.budget:
            record["skipped"].append(what)
            return True
        return False

    if args.only in (None, "lm"):
        data = split_corpus()
        record["corpus"] = {"source": "pydoc_data.topics", "train_bytes": len(data[0]), "valid_bytes": len(data[1])}
        for seed in preset["lm"]["seeds"]:
            for kind in args.kinds:
                if not over_budget(f"lm {kind} seed {seed}"):
                    r = {"experiment": "lm", **lm_run(kind, preset["lm"], seed, device, data, autocast_dtype)}
                    record["results"].append(r)
                    print(f"lm {kind} seed {seed}: {r['best_valid_loss']:.4f}", flush=True)
                    save()
    if args.only in (None, "mqar"):
        for seed in mqar_seeds:  # seeds outermost: a run cut short by the budget has every cell at one seed first
            for pairs in preset["mqar"]["pairs"]:
                for kind in args.kinds:
                    what = f"mqar {kind} pairs {pairs}" + (f" seed {seed}" if len(mqar_seeds) > 1 else "")
                    if not over_budget(what):
                        r = {"experiment": "mqar", **mqar_run(kind, preset["mqar"], pairs, seed, device, autocast_dtype)}
                        record["results"].append(r)
                        print(f"mqar {kind} {pairs} seed {seed}: {r['accuracy']:.3f} ({r['seconds']:.1f} s)", flush=True)
                        save()
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
