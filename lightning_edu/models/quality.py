"""What linear attention costs in quality: a small language model and MQAR recall, one attention at a time.

    python -m benchmarks.quality --preset gpu --only lm --out quality_lm.json      # the recorded preset (chapter 13)
    python -m benchmarks.quality --preset gpu --only mqar --budget 200 --out quality_mqar.json  # likewise
    python -m benchmarks.quality --preset cpu --out quality.json   # a CPU: about a minute each (PRESETS)

Every attention of ``KINDS`` gets the same decoder (:class:`lightning_edu.models.Decoder`: width, depth,
SwiGLU, tied embeddings), the same initial weights where their shapes agree (one seed), the same batches
and the same optimiser settings; only the token mixer differs. Two experiments:

* **Language model** (:mod:`lightning_edu.models.lm`, bytes of the Python reference documentation):
  the training loss every ``log_every`` steps and the validation loss every ``eval_every`` steps; the
  result of a run is its lowest validation loss (the corpus is small, so a long run ends by memorising it).
* **MQAR** (:mod:`lightning_edu.models.mqar`): for each number of key-value pairs, train from scratch
  (:func:`mqar_run`: AdamW with a learning-rate warm-up, large batches of fresh sequences, the loss at the
  queries only) and report the recall accuracy on fresh sequences.

The lightning kind uses TransNormerLLM's decay schedule ("fla_lightning"); elu, relu2 and hybrid use no
decay (lambda = 1), as their papers do. For MQAR that matters: recall needs a layer that copies each key into
the position of its value (the previous token), so a model must tell near from far. Softmax has RoPE for
that and lightning its decay; elu and relu2 with lambda = 1 see their past as an unordered sum, and the
hybrid's softmax blocks have no position embedding (only the causal mask, from which a model can learn a
little about positions). Zoology gives every model a short convolution for this step: ``short_conv`` in an
experiment's settings (``--short-conv WIDTH`` on the command line) puts one of that width before every block's
attention (:class:`~lightning_edu.models.blocks.ShortConv`); without it (the presets) the table compares the
attentions as this book builds them, not the best each could do.

``--budget SECONDS`` starts no run once that much time has passed (a run already started finishes, so the
whole can overrun by one run) and lists the runs it left out. Runs go in order: the language model's, then
MQAR's by number of pairs (fewest first, every attention at each), so a budget cuts the hardest ones.

**The file** ``--out`` names is one JSON object, the same layout whatever ``--only`` says (it is rewritten
after every run, so an interrupted run leaves what it finished):

* the header of :func:`lightning_edu.environment.environment_record` (``machine``, versions, ``date``,
  ``commit``, ``command``), then ``preset`` (its name), ``config`` (the whole preset: both experiments' sizes,
  whichever ran) and ``autocast``;
* ``corpus`` (the bytes' source and sizes), only when the language model ran;
* ``results``: one record a run, in the order they ran, each opening with ``"experiment": "lm"`` or
  ``"mqar"`` followed by :func:`lm_run`'s or :func:`mqar_run`'s keys; with ``--only``, one experiment's alone;
* ``skipped``: the runs ``--budget`` left out, as ``"lm KIND seed S"`` and ``"mqar KIND pairs P"``.

Chapter 13's recorded files (``notebooks/data/quality_*.json``) hold one experiment each (``--only lm``,
``--only mqar``), read through :func:`lightning_edu.book.load_recorded`, which asks for ``results``. (The oldest
language-model file predates the ``experiment`` tag; a record without one belongs to its file's experiment.)
"""

from __future__ import annotations

import math
import time

import torch

from . import Decoder, evaluate_mqar, mqar_batch, mqar_batches
from .lm import VOCAB, evaluate_lm, lm_batches, split_corpus
from .train import train, train_step

__all__ = ["KINDS", "PRESETS", "state_per_head", "lm_run", "mqar_run", "over_seeds", "turn_step"]

KINDS = ("softmax", "lightning", "elu", "relu2", "hybrid")
"""The attentions compared, in the order tables list them."""

_DECAY = {"lightning": "fla_lightning"}

PRESETS = {
    "cpu": dict(
        lm=dict(d_model=64, heads=2, layers=2, seq_len=128, batch=8, steps=150, lr=3e-3, eval_every=50,
                eval_windows=24, log_every=10, seeds=(0,)),
        mqar=dict(d_model=64, heads=2, layers=2, seq_len=24, vocab=32, batch=64, steps=250, lr=3e-3, warmup=50,
                  log_every=25, pairs=(4, 8), eval_batch=512)),
    "gpu": dict(
        lm=dict(d_model=256, heads=4, layers=4, seq_len=512, batch=16, steps=1500, lr=1e-3, eval_every=100,
                eval_windows=64, log_every=20, seeds=(0,)),
        mqar=dict(d_model=128, heads=2, layers=2, seq_len=128, vocab=65, batch=512, steps=500, lr=1e-3, warmup=100,
                  log_every=50, pairs=(8, 12, 16, 24), eval_batch=512)),
}
"""Experiment sizes. "cpu" runs on a laptop's CPU (the language model in about a minute on two cores, MQAR in about
as long); "gpu" is the recorded preset of chapter 13 (bf16 autocast). The records in notebooks/data/ (quality_*)
hold what each run measured.

Why the MQAR recipe is what it is. A model first learns to answer with *some* value of its sequence (accuracy
1/pairs, loss log(pairs): a plateau) and only later, suddenly, with the right one; whether and when it turns is
what the recipe decides. Each choice below came from short exploratory runs at these sizes (not kept as records):

* **A learning-rate warm-up**: at full rate from the first step Adam's updates left the models on the plateau.
* **Batches of hundreds of sequences**: the loss sees only the ``pairs`` queries of a sequence, and the turn needs
  many answers per step.
* **The share of the keys one sequence uses** (pairs / ((vocab - 1) // 2)) matters more than the vocabulary's
  size: too few pairs among many keys never turned, every key in every sequence makes guessing among the values
  the blind guess. Hence vocabulary 65 (32 keys, 32 values) and 8 to 24 pairs, a quarter to three quarters of the
  keys (Zoology's vocabulary of 8192 suits its far longer training).
* **The learning rate** 1e-3, with which the whole preset was tried, and a width of 64 for "cpu", the narrowest
  that turned for every seed tried.
* **Steps**: at 500 steps a cell in the middle of the table is a seed caught before or after its turn; the
  records quality_mqar_steps_h200 and quality_mqar_h200 (three seeds in every cell) measure how many steps the
  seeds need to agree, and where no budget makes them.
"""


def _model(kind: str, vocab: int, cfg: dict, max_len: int, seed: int, device) -> Decoder:
    torch.manual_seed(seed)
    return Decoder(vocab, cfg["d_model"], cfg["heads"], cfg["layers"], kind, max_len=max_len,
                   decay=_DECAY.get(kind), hybrid_block=_hybrid_block(max_len),
                   short_conv=cfg.get("short_conv", 0)).to(device)


def _hybrid_block(max_len: int) -> int:
    return min(64, max_len)


def state_per_head(kind: str, cfg: dict) -> int:
    """The numbers one head of one layer carries from a sequence's first ``cfg["seq_len"] - 1`` tokens to its last
    (what recall has to fit through), for a model of ``cfg``'s width and heads (head dim d = d_model / heads):

    * softmax: its keys and values, 2 (n - 1) d, growing with the sequence;
    * lightning: the state KV, d x d;
    * elu, relu2: the state S and the normaliser z, d (d + 1) (relu2's map keeps d features);
    * hybrid: the linear part's S and z over the finished blocks, d (d + 1), and the current softmax block's keys
      and values, 2 (B - 1) d at most, B its block.

    A short convolution adds the last width - 1 inputs of each channel, d_model (width - 1) per layer, to every
    kind; they are not counted here (the same for every kind)."""
    d, n = cfg["d_model"] // cfg["heads"], cfg["seq_len"]
    if kind == "softmax":
        return 2 * (n - 1) * d
    if kind == "lightning":
        return d * d
    if kind in ("elu", "relu2"):
        return d * (d + 1)
    if kind == "hybrid":
        return d * (d + 1) + 2 * (_hybrid_block(n) - 1) * d
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


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
    return {"kind": kind, "seed": seed, "params": model.n_params(), "state_per_head": state_per_head(kind, cfg),
            "train_curve": curve, "valid_curve": valid, "best_valid_loss": best[1], "best_step": best[0],
            "seconds": time.perf_counter() - t0}


def mqar_run(kind: str, cfg: dict, pairs: int, seed: int = 0, device="cpu", autocast_dtype=None) -> dict:
    """Train one model on MQAR with ``pairs`` key-value pairs; returns its accuracy on fresh sequences.

    The book's training loop (:func:`~lightning_edu.models.train.train`): AdamW (weight decay 0.01, as lm_run's
    optimiser; gradients clipped to norm 1) on fresh batches of cfg["batch"] sequences, the learning rate rising
    linearly from cfg["lr"] / cfg["warmup"] to cfg["lr"] over the first cfg["warmup"] steps and constant after. A model first learns to answer with some
    value of its sequence (accuracy 1/pairs, a plateau) and only later, suddenly, with the right one. Adam's
    first updates move every weight by about the learning rate, whatever its gradient; at full rate from the
    first step they left our models on that plateau far longer (see :data:`PRESETS`), hence the warm-up. The
    batches are large because the loss sees only ``pairs`` positions of each sequence: the turn from guessing
    to recall needs many answers per step.

    The record: ``accuracy`` on cfg["eval_batch"] fresh sequences (seed 10000 + seed), ``state_per_head``
    (:func:`state_per_head`), ``loss_curve`` ([step,
    mean training loss of the steps since the previous point], at every multiple of cfg["log_every"] and at the
    last step: where a model left the plateau, if it did), ``final_loss`` (its last point) and ``seconds``
    (training and evaluation, wall time).
    """
    device = torch.device(device)
    model = _model(kind, cfg["vocab"], cfg, cfg["seq_len"], seed, device)
    batches = mqar_batches(cfg["batch"], cfg["seq_len"], pairs, cfg["vocab"], seed=seed)
    t0 = time.perf_counter()
    records = train(model, batches, cfg["steps"], lr=cfg["lr"], device=device, autocast_dtype=autocast_dtype,
                    log_every=cfg["log_every"], progress=False, weight_decay=0.01, warmup=cfg["warmup"])
    curve = [[r["step"], r["loss"]] for r in records]
    test = mqar_batch(cfg["eval_batch"], cfg["seq_len"], pairs, cfg["vocab"], seed=10_000 + seed)
    with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        accuracy = evaluate_mqar(model, *test)
    return {"kind": kind, "pairs": pairs, "seed": seed, "accuracy": accuracy, "final_loss": curve[-1][1],
            "state_per_head": state_per_head(kind, cfg), "loss_curve": curve, "seconds": time.perf_counter() - t0}


def over_seeds(results, value: str, by=("kind", "pairs")) -> dict:
    """Runs of several seeds, summarised: {key: (mean, lowest, highest, seeds)} of each run's ``value`` (say
    "accuracy" or "best_valid_loss") over the runs that share ``key``, the tuple of their ``by`` fields (a record
    without one of them, the language model's "pairs", contributes None there). ``seeds`` is the sorted list of
    the seeds found, so a cell a budget cut short shows as fewer seeds than its neighbours."""
    cells: dict = {}
    for r in results:
        cells.setdefault(tuple(r.get(name) for name in by), []).append(r)
    out = {}
    for key, runs in cells.items():
        values = [float(r[value]) for r in runs]
        out[key] = (sum(values) / len(values), min(values), max(values), sorted(r.get("seed", 0) for r in runs))
    return out


def turn_step(run: dict, fraction: float = 0.3) -> int | None:
    """The step at which an MQAR run left its plateau: the first point of its ``loss_curve`` whose mean training
    loss is below ``fraction`` of ln(pairs), the loss of guessing among the sequence's values (where a model sits
    before it recalls); None for a run that never got there. Why a fraction of ln(pairs): the plateau's loss
    depends on the number of pairs, and a model that recalls is far below it (a model at 0.3 ln p answers most
    queries right)."""
    threshold = fraction * math.log(run["pairs"])
    return next((int(step) for step, loss in run["loss_curve"] if loss < threshold), None)
