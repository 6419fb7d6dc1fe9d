"""What linear attention costs in quality: a small language model and MQAR recall, one attention at a time.

    python -m lightning_edu.perf.quality --preset gpu --out quality.json   # the recorded run (chapter 13)
    python -m lightning_edu.perf.quality --preset cpu --out quality.json   # a minute on a laptop

Every attention of ``KINDS`` gets the same decoder (:class:`lightning_edu.models.Decoder`: width, depth,
SwiGLU, tied embeddings), the same initial weights where their shapes agree (one seed), the same batches
and the same optimiser settings; only the token mixer differs. Two experiments:

* **Language model** (:mod:`lightning_edu.models.lm`, bytes of the Python reference documentation):
  the training loss every ``log_every`` steps and the validation loss every ``eval_every`` steps; the
  result of a run is its lowest validation loss (the corpus is small, so a long run ends by memorising it).
* **MQAR** (:mod:`lightning_edu.models.mqar`): for each number of key-value pairs, train from scratch and
  report the recall accuracy on fresh sequences.

The lightning kind uses TransNormerLLM's decay schedule ("fla_lightning"); elu, relu2 and hybrid use no
decay (lambda = 1), as their papers do.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np
import torch

from ..models import Decoder, evaluate_mqar, mqar_batch, mqar_batches, train
from ..models.lm import VOCAB, evaluate_lm, lm_batches, split_corpus
from ..models.train import train_step
from .environment import environment_record

__all__ = ["KINDS", "PRESETS", "lm_run", "mqar_run", "main"]

KINDS = ("softmax", "lightning", "elu", "relu2", "hybrid")
"""The attentions compared, in the order tables list them."""

_DECAY = {"lightning": "fla_lightning"}

PRESETS = {
    "cpu": dict(
        lm=dict(d_model=64, heads=2, layers=2, seq_len=128, batch=8, steps=150, lr=3e-3, eval_every=50,
                eval_windows=24, log_every=10, seeds=(0,)),
        mqar=dict(d_model=32, heads=2, layers=2, seq_len=48, vocab=64, batch=32, steps=150, lr=3e-3,
                  pairs=(2, 4, 8), eval_batch=256)),
    "gpu": dict(
        lm=dict(d_model=256, heads=4, layers=4, seq_len=512, batch=16, steps=1500, lr=1e-3, eval_every=100,
                eval_windows=64, log_every=20, seeds=(0,)),
        mqar=dict(d_model=128, heads=2, layers=2, seq_len=128, vocab=256, batch=128, steps=1500, lr=2e-3,
                  pairs=(8, 32), eval_batch=512)),
}
"""Experiment sizes: "cpu" runs in about a minute on two cores, "gpu" is the recorded run."""


def _model(kind: str, vocab: int, cfg: dict, max_len: int, seed: int, device) -> Decoder:
    torch.manual_seed(seed)
    return Decoder(vocab, cfg["d_model"], cfg["heads"], cfg["layers"], kind, max_len=max_len,
                   decay=_DECAY.get(kind), hybrid_block=min(64, max_len)).to(device)


def lm_run(kind: str, cfg: dict, seed: int = 0, device="cpu", data=None, autocast_dtype=None) -> dict:
    """Train one language model; returns its curves and its lowest validation loss (nats per byte)."""
    device = torch.device(device)
    train_data, valid_data = split_corpus() if data is None else data
    model = _model(kind, VOCAB, cfg, cfg["seq_len"], seed, device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"])
    batches = lm_batches(train_data, cfg["batch"], cfg["seq_len"], seed=seed)
    curve, valid, loss_sum, t0 = [], [], 0.0, time.perf_counter()
    for step in range(1, cfg["steps"] + 1):
        inputs, targets = next(batches)
        model.train()
        loss_sum += float(train_step(model, opt, inputs.to(device), targets.to(device), autocast_dtype))
        if step % cfg["log_every"] == 0:
            curve.append([step, loss_sum / cfg["log_every"]])
            loss_sum = 0.0
        if step % cfg["eval_every"] == 0 or step == cfg["steps"]:
            valid.append([step, evaluate_lm(model, valid_data, cfg["seq_len"], max_windows=cfg["eval_windows"],
                                            autocast_dtype=autocast_dtype)])
    best = min(valid, key=lambda r: r[1])
    return {"kind": kind, "seed": seed, "params": model.n_params(), "train_curve": curve, "valid_curve": valid,
            "best_valid_loss": best[1], "best_step": best[0], "seconds": time.perf_counter() - t0}


def mqar_run(kind: str, cfg: dict, pairs: int, seed: int = 0, device="cpu", autocast_dtype=None) -> dict:
    """Train one model on MQAR with ``pairs`` key-value pairs; returns its accuracy on fresh sequences."""
    device = torch.device(device)
    model = _model(kind, cfg["vocab"], cfg, cfg["seq_len"], seed, device)
    batches = mqar_batches(cfg["batch"], cfg["seq_len"], pairs, cfg["vocab"], seed=seed)
    t0 = time.perf_counter()
    # AdamW's default weight decay (0.01), as lm_run's optimiser; a record per step, so the last is the last step's loss
    log = train(model, batches, cfg["steps"], lr=cfg["lr"], device=device, autocast_dtype=autocast_dtype,
                log_every=1, progress=False, weight_decay=0.01)
    test = mqar_batch(cfg["eval_batch"], cfg["seq_len"], pairs, cfg["vocab"], seed=10_000 + seed)
    with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        accuracy = evaluate_mqar(model, *test)
    return {"kind": kind, "pairs": pairs, "seed": seed, "accuracy": accuracy, "final_loss": log[-1]["loss"],
            "seconds": time.perf_counter() - t0}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--only", choices=("lm", "mqar"), default=None)
    parser.add_argument("--budget", type=float, default=math.inf, help="seconds; later runs are skipped past it")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    preset = PRESETS[args.preset]
    device = "cuda" if args.preset == "gpu" else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("quality: --preset gpu needs a CUDA GPU; use --preset cpu here")
    autocast_dtype = torch.bfloat16 if device == "cuda" else None
    command = "python -m lightning_edu.perf.quality " + " ".join(argv)
    record = {**environment_record(command, device=device), "preset": args.preset, "config": preset,
              "autocast": str(autocast_dtype), "lm": [], "mqar": [], "skipped": []}
    start = time.perf_counter()

    def save():
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)

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
                    record["lm"].append(lm_run(kind, preset["lm"], seed, device, data, autocast_dtype))
                    print(f"lm {kind} seed {seed}: {record['lm'][-1]['best_valid_loss']:.4f}", flush=True)
                    save()
    if args.only in (None, "mqar"):
        for pairs in preset["mqar"]["pairs"]:
            for kind in args.kinds:
                if not over_budget(f"mqar {kind} pairs {pairs}"):
                    record["mqar"].append(mqar_run(kind, preset["mqar"], pairs, 0, device, autocast_dtype))
                    print(f"mqar {kind} {pairs}: {record['mqar'][-1]['accuracy']:.3f}", flush=True)
                    save()
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
