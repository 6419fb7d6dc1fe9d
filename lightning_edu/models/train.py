"""A plain training loop (AdamW, optional autocast, a progress bar) and MQAR accuracy.

Deliberately short: a linear warm-up at most, no decay schedule, no gradient accumulation, no checkpoints. It is enough to
compare attention variants on the same data with the same optimiser, which is all the measurements need.
"""

from __future__ import annotations

import math
import numbers
import time
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from .mqar import IGNORE_INDEX
from ..validation import validate_int

__all__ = ["train", "train_step", "evaluate_mqar"]

_AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)


def _autocast(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=dtype)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, inputs: torch.Tensor, targets: torch.Tensor,
               autocast_dtype: torch.dtype | None = None, grad_clip: float | None = 1.0) -> torch.Tensor:
    """One optimiser step on one batch (already on the model's device); returns the loss, still on the device.

    The loss is the cross-entropy of ``model(inputs)`` (batch, n, vocab) against ``targets``, positions with
    target -100 skipped, computed in float32 whatever the autocast dtype of the forward pass.
    """
    with _autocast(inputs.device, autocast_dtype):
        logits = model(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if grad_clip is not None:
        nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    return loss.detach()


def train(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], steps: int, lr: float = 1e-3,
          device: str | torch.device = "cpu", autocast_dtype: torch.dtype | None = None, log_every: int = 10,
          progress: bool = True, weight_decay: float = 0.0, grad_clip: float | None = 1.0,
          warmup: int = 0) -> list[dict]:
    """Train ``model`` for ``steps`` AdamW steps on (inputs, targets) pairs from ``batches``; returns the log.

    The loss is the cross-entropy of ``model(inputs)`` (batch, n, vocab) against ``targets`` (batch, n),
    positions with target -100 skipped. ``autocast_dtype`` (torch.bfloat16 or torch.float16) runs the forward
    pass under ``torch.autocast`` on ``device``; weights and optimiser state stay float32. Gradients are
    clipped to norm ``grad_clip`` (None: not clipped). With ``warmup`` > 0 the learning rate rises linearly from
    lr / warmup to lr over the first ``warmup`` steps, and stays at lr after.

    Every ``log_every`` steps, and at the last step, a record is appended: ``{"step", "loss",
    "tokens_per_s"}``, the loss averaged over the steps since the previous record and the input tokens per
    second of wall time over those steps (data, forward, backward and update all counted). The progress bar
    (``tqdm.auto``: a widget in a notebook, text in a terminal; ``progress=False`` hides it) shows both.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    steps, log_every = validate_int("steps", steps, 1), validate_int("log_every", log_every, 1)
    if isinstance(lr, bool) or not isinstance(lr, numbers.Real) or not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
    if autocast_dtype is not None and autocast_dtype not in _AUTOCAST_DTYPES:
        raise ValueError(f"autocast_dtype must be None, torch.bfloat16 or torch.float16, got {autocast_dtype!r}")
    warmup = validate_int("warmup", warmup, 0)
    device = torch.device(device)
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / warmup)) if warmup else None
    pin = device.type == "cuda"  # pinned batches copy without waiting for the GPU: the next step's work overlaps
    records: list[dict] = []
    it = iter(batches)
    loss_sum, tokens, t0 = 0.0, 0, time.perf_counter()
    bar = tqdm(range(1, steps + 1), disable=not progress, desc="train")
    for step in bar:
        try:
            inputs, targets = next(it)
        except StopIteration:
            raise ValueError(f"batches ran out after {step - 1} of {steps} steps") from None
        inputs, targets = (t.pin_memory().to(device, non_blocking=True) if pin and t.device.type == "cpu"
                           else t.to(device) for t in (inputs, targets))
        loss = train_step(model, opt, inputs, targets, autocast_dtype, grad_clip)
        if schedule is not None:
            schedule.step()
        # the loss stays on the device between records: no synchronisation in every step
        loss_sum, tokens = loss_sum + loss, tokens + inputs.numel()
        if step % log_every == 0 or step == steps:
            n = step - (records[-1]["step"] if records else 0)
            mean = float(loss_sum) / n  # waits for the GPU: the time below covers the steps' work
            elapsed = time.perf_counter() - t0
            records.append({"step": step, "loss": mean, "tokens_per_s": tokens / max(elapsed, 1e-12)})
            bar.set_postfix(loss=f"{records[-1]['loss']:.4f}", tok_s=f"{records[-1]['tokens_per_s']:.3g}")
            loss_sum, tokens, t0 = 0.0, 0, time.perf_counter()
    return records


@torch.no_grad()
def evaluate_mqar(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                  device: str | torch.device | None = None) -> float:
    """The fraction of query positions (targets != -100) where the model's most likely token is the value.

    ``inputs`` and ``targets`` as returned by :func:`lightning_edu.models.mqar.mqar_batch`; ``device`` defaults
    to that of the model's first parameter. The model is put in eval mode.
    """
    if inputs.shape != targets.shape:
        raise ValueError(f"inputs and targets must have the same shape, got {tuple(inputs.shape)} and {tuple(targets.shape)}")
    mask = targets != IGNORE_INDEX
    if not bool(mask.any()):
        raise ValueError("targets hold no query position (every target is -100)")
    device = next(model.parameters()).device if device is None else torch.device(device)
    model.eval()
    predicted = model(inputs.to(device)).argmax(-1).cpu()
    return float((predicted[mask] == targets[mask]).float().mean())
