"""A kernel-optimisation contest: write the fastest correct Lightning Attention forward.

For GPU courses. Each student hands in one Python file that defines::

    def forward(q, k, v, log2_decay) -> o

* ``q``, ``k``: (batch, heads, n, d_k) and ``v``: (batch, heads, n, d_v) contiguous torch tensors, all of one
  dtype (float32, or bfloat16 when timed), on the GPU when there is one; d_k and d_v are powers of two from 16
  to 128 and may differ; n is any length from 1 up, not a multiple of anything;
* ``log2_decay``: a float32 (heads,) tensor on the same device, log2(lambda) for each head, lambda in (0, 1]
  (0 exactly for lambda = 1);
* ``o``: (batch, heads, n, d_v), in v's dtype and on v's device, the causal Lightning Attention forward with
  no initial state: ``o_t = sum_{s <= t} lambda^(t - s) (q_t . k_s) v_s`` for each batch and head.

The file may import torch, triton and numpy, and must stand alone (no second file of the student's). It may
not call this package's implementations (``lightning_edu.lightning_attention``, the book's kernels and their
helpers): the check refuses such a submission and says which function it called.

What is graded:

* **correctness** (:func:`check_forward_kernel`), on any machine: float32 inputs of awkward shapes (n = 1, n
  not a multiple of 16 or 64, n ~ 300, d_k != d_v, a head with lambda = 1 and one with lambda = 0.001)
  against a float64 numpy reference; on a GPU, bfloat16 inputs at a few shapes too. Without a GPU, Triton
  runs kernels in its CPU interpreter, whose bfloat16 arithmetic is wrong: there a bfloat16 call is checked
  for the output's shape, dtype and device only;
* **speed** (:func:`time_forward_kernel`), on a GPU only: bfloat16, 16 heads, 32K tokens per call, sequence
  lengths 2048, 8192 and 32768, head dims 64 and 128, each shape timed beside the book's kernel
  (``la2_fast``) in the same process;
* **points** (:func:`grade`): a wrong submission scores 0; a correct one scores ``correct_points`` (60) plus
  ``speed_points`` (40) times ``min(speedup, speedup_cap) / speedup_cap``, where speedup is the geometric mean
  over the six shapes of (the book's time / the student's time) and ``speedup_cap`` is 1: matching the book's
  kernel earns all 40. Without a GPU, speed is not measured and the points are out of 60.

The command (a folder holds one ``.py`` file per student, or one sub-folder per student with a
``submission.py``; the student's name is the file's stem or the sub-folder's name)::

    python -m lightning_edu.exercises.contest starter submission.py       # a correct, plain Triton starting point
    python -m lightning_edu.exercises.contest grade submissions/ --out report.json --markdown leaderboard.md

The starter (:data:`STARTER`) is a complete, correct submission: one program per (batch, head) walks the
sequence in blocks of 16 rows, in float32, carrying the d_k x d_v state from block to block. It passes the
check under the interpreter; it is written to be read, not to be fast (batch * heads programs, 16-row fp32
tiles), and the contest is to make it fast. A minimal submission written in torch ops, correct and
quadratic in n, for trying out the grader::

    import torch

    def forward(q, k, v, log2_decay):
        n = q.shape[-2]
        t = torch.arange(n, device=q.device)
        gap = (t[:, None] - t[None, :]).float()                      # t - s
        decay = torch.exp2(log2_decay.float()[:, None, None] * gap.clamp(min=0))
        weights = torch.where(gap >= 0, decay, 0.0) * (q.float() @ k.float().transpose(-1, -2))
        return (weights @ v.float()).to(v.dtype)

Grading runs the students' code in the grading process, as nbgrader does: a submission that never returns
stops the run, and one that corrupts the GPU's state (an illegal memory access) spoils the GPU for the
submissions graded after it in the same run; grade such a file on its own.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import re
import secrets
import sys
import types
from pathlib import Path

import numpy as np

from . import _integrity
from ._core import ExerciseError, exception_chain, exercise, passed, seeded

__all__ = [
    "STARTER", "TOLERANCE", "check_forward_kernel", "time_forward_kernel", "load_submission", "find_submissions",
    "grade", "leaderboard_markdown", "main",
]

# Largest |o - reference| in a (batch, head), over the largest |reference| in it, that passes.
TOLERANCE = {
    ("float32", "cpu"): 1e-4,   # numpy-exact fp32 dots (the interpreter, or torch on the CPU)
    ("float32", "cuda"): 5e-3,  # a GPU's tl.dot takes float32 operands as tf32 (10-bit mantissa) by default
    ("bfloat16", "cuda"): 3e-2,  # 8-bit mantissa: bf16 dot operands (the state too), fp32 accumulation
}

# Rounding of the dot operands, per entry, as a fraction of the same sum taken over absolute values,
# (|Q| |K|^T * M) |V|. Where the terms of a sum cancel, the answer is small beside its terms, and the relative
# tolerance above alone fails a correct kernel: on a GPU the book's starter kernel (fp32 inputs, tf32 dots) failed
# it in a single-token case of fresh random inputs.
# tf32 keeps 10 bits of mantissa (a relative rounding of at most 2^-11 per operand); the rounding errors of a
# sum's terms add up like a random walk, and in practice stay well within 2^-11 of the sum over absolute values
# (the worst case, every error of one sign, is a few times that). bf16: 2^-8 likewise.
ROUNDING = {
    ("float32", "cpu"): 0.0,
    ("float32", "cuda"): 2.0**-11,
    ("bfloat16", "cuda"): 2.0**-8,
}

# The timed shapes: (T, D), bf16, 16 heads, 32K tokens per call (batch = 32768 // T).
TIMING_SHAPES = tuple((T, D) for D in (64, 128) for T in (2048, 8192, 32768))
TIMING_HEADS = 16
TIMING_TOKENS = 32768
# How far the timed call's output may stray from the book's kernel's on the same bf16 inputs (per head,
# relative to the largest |o| of the head): a guard against a kernel that is right on the small checked
# shapes and skips work on the large timed ones, loose enough for two bf16 kernels' rounding.
TIMED_AGREEMENT = 5e-2

_NOT_MEASURED = "not measured"


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


# ------------------------------------------------------------------------------------------- the starter

STARTER = '''\
"""My Lightning Attention forward: o_t = sum_{s <= t} lambda^(t - s) (q_t . k_s) v_s.

The contest's starting point: correct, and written to be read rather than to be fast. One program per
(batch, head) walks the sequence in blocks of BLOCK rows, in float32, and carries the d_k x d_v state KV
from block to block (Algorithm 1 of Lightning Attention-2). Make it fast: more programs than batch * heads,
bigger tiles, bf16 dots, ...
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _forward_kernel(Q, K, V, O, LOG2_DECAY, n, H,
                    D_K: tl.constexpr, D_V: tl.constexpr, BLOCK: tl.constexpr):
    bh = tl.program_id(0)                                 # which (batch, head): batch * H + head
    log2_lam = tl.load(LOG2_DECAY + bh % H)
    r = tl.arange(0, BLOCK)
    ck = tl.arange(0, D_K)
    cv = tl.arange(0, D_V)
    q_ptr = Q + bh * n * D_K
    k_ptr = K + bh * n * D_K
    v_ptr = V + bh * n * D_V
    o_ptr = O + bh * n * D_V
    # lambda^(r - s) inside a block, from the distance itself: no negative power, nothing overflows
    dist = (r[:, None] - r[None, :]).to(tl.float32)
    intra_decay = tl.where(dist >= 0, tl.exp2(log2_lam * tl.maximum(dist, 0.0)), 0.0)
    q_decay = tl.exp2(log2_lam * (r + 1).to(tl.float32))  # row r is r + 1 steps after the state's last token
    kv = tl.zeros((D_K, D_V), dtype=tl.float32)
    for start in range(0, n, BLOCK):
        rows = start + r
        ok = rows < n
        q = tl.load(q_ptr + rows[:, None] * D_K + ck[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        k = tl.load(k_ptr + rows[:, None] * D_K + ck[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + rows[:, None] * D_V + cv[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        scores = tl.dot(q, tl.trans(k)) * intra_decay                     # the block against itself
        o = tl.dot(scores, v) + tl.dot(q * q_decay[:, None], kv)          # + the blocks before it
        tl.store(o_ptr + rows[:, None] * D_V + cv[None, :], o.to(O.dtype.element_ty), mask=ok[:, None])
        b = tl.minimum(n - start, BLOCK)                                  # valid rows in this block
        k_decay = tl.where(ok, tl.exp2(log2_lam * (b - 1 - r).to(tl.float32)), 0.0)
        kv = kv * tl.exp2(log2_lam * b.to(tl.float32)) + tl.dot(tl.trans(k * k_decay[:, None]), v)


def forward(q, k, v, log2_decay):
    batch, heads, n, d_k = q.shape
    d_v = v.shape[-1]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.empty_like(v)
    _forward_kernel[(batch * heads,)](q, k, v, o, log2_decay, n, heads, D_K=d_k, D_V=d_v, BLOCK=16)
    return o
'''


# ------------------------------------------------------------------------------------------- correctness

# (batch, heads, n, d_k, d_v, lambda per head, what the case is for): every n but one is no multiple of 16.
_CASES = (
    (2, 3, 37, 16, 32, (0.9, 1.0, 1e-3), "a partial last block, lambda = 1 and a lambda near 0"),
    (1, 2, 1, 32, 16, (0.5, 1.0), "a single token"),
    (1, 2, 100, 32, 16, (0.99, 0.7), "past a 64-row block"),
    (1, 2, 300, 16, 16, (0.995, 1.0), "a longer sequence"),
)
_PROBE = (1, 2, 20, 16, 16, (0.9, 1.0), "bfloat16 in, bfloat16 out")
_CUDA_BF16_CASES = (
    (1, 2, 100, 64, 64, (0.9, 1e-3), "bfloat16, d = 64"),
    (2, 4, 300, 128, 128, (0.999, 0.95, 0.5, 1.0), "bfloat16, d = 128"),
    (1, 2, 1, 64, 128, (0.5, 1.0), "bfloat16, a single token"),
)


def _draw_case(case, seed: int, index: int):
    """The case as drawn for ``seed``: 0 keeps the listed shape and lambdas, another seed moves n and the lambdas
    (keeping what the case is for: lambda = 1 stays 1, a lambda near 0 stays near 0, n = 1 stays 1)."""
    batch, heads, n, d_k, d_v, lams, what = case
    if not seed:
        return batch, heads, n, d_k, d_v, lams, what
    rng = seeded(seed * 16 + index)
    if n > 1:
        n = int(rng.integers(n - 15, n + 15))
        if n % 16 == 0:  # never a whole number of 16-row blocks
            n += 1
    new = []
    for lam in lams:
        if lam == 1.0:
            new.append(1.0)
        elif lam < 0.01:
            new.append(float(np.round(rng.uniform(5e-4, 5e-3), 5)))
        else:
            new.append(float(np.round(rng.uniform(max(0.3, lam - 0.2), min(0.999, lam + 0.005)), 3)))
    return batch, heads, n, d_k, d_v, tuple(new), what


def _describe(batch, heads, n, d_k, d_v, lams, dtype_name) -> str:
    lam_text = ", ".join(f"{lam:g}" for lam in lams)
    return f"batch {batch}, heads {heads}, n {n}, d_k {d_k}, d_v {d_v}, lambda per head [{lam_text}], {dtype_name}"


def _weights(n: int, lams, keep: str = "causal", shift: int = 0, clamp: bool = False) -> np.ndarray:
    """(heads, n, n) float64 weights of v_s in o_t: lambda^(t - s + shift) where ``keep`` keeps (t, s), else 0.

    ``keep``: "causal" s <= t, "strict" s < t, "next" s <= t + 1, "all" every s (then lambda^|t - s|);
    ``clamp``: a negative power is taken as 0 (weight 1), as code that clamps the distance at 0 does."""
    t = np.arange(n)
    gap = t[:, None] - t[None, :]
    kept = {"causal": gap >= 0, "strict": gap >= 1, "next": gap >= -1, "all": np.ones_like(gap, dtype=bool)}[keep]
    power = np.abs(gap) if keep == "all" else gap + shift
    if clamp:
        power = np.maximum(power, 0)
    lam = np.asarray(lams, dtype=np.float64)[:, None, None]
    return np.where(kept, lam ** np.where(kept, power, 0).astype(np.float64), 0.0)


def _attend(q, k, v, weights) -> np.ndarray:
    return ((q @ k.swapaxes(-1, -2)) * weights[None]) @ v


def _reference(q, k, v, lams) -> np.ndarray:
    """The float64 answer by the masked product [(Q K^T) * M] V of chapter 03 (numpy arrays in, numpy out)."""
    from ..numpy_reference import causal_linear_masked

    return causal_linear_masked(q, k, v, list(lams))


# The mistakes a message can name outright: (weights of the wrong function, what to tell the student).
def _mistakes(n, lams):
    ln = np.exp(np.log2(np.asarray(lams, dtype=np.float64)))  # exp(log2 lambda): e raised where 2 belongs
    return (
        (_weights(n, lams, "strict"), "the diagonal is left out: o_t sums over s <= t, s = t included (weight "
         "lambda^0 = 1); the causal mask keeps t - s >= 0, not t - s > 0"),
        (_weights(n, lams, "next"), "o_t also sees token t + 1: the causal mask keeps s <= t only"),
        (_weights(n, lams, "next", clamp=True), "o_t also sees token t + 1: the causal mask keeps s <= t only"),
        (_weights(n, lams, "all"), "o_t sees the tokens after t: mask out s > t (the causal mask)"),
        (_weights(n, [1.0] * len(lams)), "there is no decay: v_s must be weighed by lambda^(t - s), with "
         "lambda^(t - s) = exp2(log2_decay[head] * (t - s))"),
        (_weights(n, lams, shift=1), "the decay has one power too many: the weight of v_s is lambda^(t - s), so "
         "s = t has weight 1"),
        (_weights(n, lams, shift=-1), "the decay has one power too few: the weight of v_s is lambda^(t - s), "
         "so s = t - 1 has weight lambda"),
        (_weights(n, ln), "the decay is e^(log2_decay * (t - s)): log2_decay holds log2(lambda), so raise 2 to "
         "it (tl.exp2, torch.exp2), not e"),
        (_weights(n, [lams[0]] * len(lams)), "every head uses head 0's lambda: read log2_decay[head], with "
         "head = (batch * heads + head) % heads in a program per (batch, head)"),
    )


def _per_head_error(got: np.ndarray, ref: np.ndarray):
    """(|got - ref| per entry scaled by each (batch, head)'s largest |ref|, that scale)."""
    scale = np.maximum(np.abs(ref).max(axis=(2, 3), keepdims=True), 1e-30)
    with np.errstate(invalid="ignore", over="ignore"):
        return np.abs(got - ref) / scale, scale


def _matches(got, ref, rtol) -> bool:
    err, _ = _per_head_error(got, ref)
    return bool(np.all(err <= rtol))


def _failure(exc: BaseException, what: str) -> ExerciseError:
    """A short message for an exception from the student's code (a Triton compile error is dozens of lines)."""
    if any(isinstance(e, NotImplementedError) for e in exception_chain(exc)):
        return ExerciseError(f"{what}: your forward is not implemented yet (it raised NotImplementedError)")
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    summary = lines[0] if lines else ""
    if len(lines) > 1 and lines[-1] != summary:
        summary = f"{summary} ... {lines[-1]}"
    if len(summary) > 300:
        summary = summary[:297] + "..."
    name = type(exc).__name__
    compiling = "Compil" in name or "triton" in type(exc).__module__
    advice = (" A Triton kernel failed to compile or launch: check its signature against the launch, that the "
              "tile shapes are powers of two, and that every tl.dot side is >= 16." if compiling else "")
    return ExerciseError(f"{what}: your forward raised {name}: {summary}.{advice}")


def _expect_output(got, v, what: str):
    """The returned value as a detached tensor, or an ExerciseError on its type, shape, dtype or device."""
    import torch

    if got is None:
        raise ExerciseError(f"{what}: your forward returned None -- did you forget `return o`?")
    if isinstance(got, (tuple, list)):
        raise ExerciseError(f"{what}: your forward returned a {type(got).__name__} of {len(got)}; return o alone "
                            "(no final state)")
    if not isinstance(got, torch.Tensor):
        raise ExerciseError(f"{what}: your forward returned {type(got).__name__}, expected a torch tensor o")
    batch, heads, n, d_v = v.shape
    if tuple(got.shape) != tuple(v.shape):
        layout = ""
        if tuple(got.shape) == (batch, n, heads, d_v):
            layout = " -- the heads and the sequence are swapped: the layout is (batch, heads, n, d)"
        elif got.dim() == 4 and tuple(got.shape[:3]) == (batch, heads, n):
            layout = f" -- o's last dim is v's head dim d_v = {d_v} (here d_k = {got.shape[-1]}?)"
        raise ExerciseError(f"{what}: o has shape {tuple(got.shape)}, expected (batch, heads, n, d_v) = "
                            f"{tuple(v.shape)}{layout}")
    if got.dtype != v.dtype:
        raise ExerciseError(f"{what}: o has dtype {str(got.dtype).replace('torch.', '')} for "
                            f"{str(v.dtype).replace('torch.', '')} inputs; return o in v's dtype (allocate it with "
                            "torch.empty_like(v), or cast with .to(v.dtype) before returning)")
    if got.device != v.device:
        raise ExerciseError(f"{what}: o is on {got.device}, the inputs on {v.device}; return o on the inputs' device")
    return got.detach()


def _diagnose(got, q, k, v, lams, rtol, what, dtype_name, rounding: float = 0.0) -> None:
    """Raise an ExerciseError naming the first wrong (batch, head, row), and a hint, unless ``got`` passes: every
    entry within ``rtol`` of its (batch, head)'s largest |reference|, plus ``rounding`` of the entry's sum over
    absolute values (:data:`ROUNDING`)."""
    ref = _reference(q, k, v, lams)
    batch, heads, n, _ = ref.shape
    finite = np.isfinite(got)
    if not finite.all():
        b, h, t = (int(x) for x in np.argwhere(~finite.all(axis=3))[0])
        kind = "NaN" if np.isnan(got).any() else "inf"
        bad_heads = sorted({int(x) for x in np.argwhere(~finite.all(axis=(0, 2, 3))).ravel()})
        if all(lams[x] < 0.01 for x in bad_heads):
            hint = ("only heads with lambda near 0 have them: a negative power of lambda overflowed (lambda^-t is "
                    "1e108 at lambda = 0.001, t = 36). Take powers of the distance t - s >= 0 only, "
                    "exp2(log2_decay * (t - s)), never lambda^t * lambda^-s")
        else:
            hint = ("with finite inputs every output is finite: look for rows never written (torch.empty and a "
                    "mask that skips them), or a division")
        raise ExerciseError(f"{what}: o contains {kind}, first at batch {b}, head {h} (lambda = {lams[h]:g}), row {t}. "
                            f"Hint: {hint}")
    err, scale = _per_head_error(got, ref)
    allowed = rtol + (rounding * _reference(np.abs(q), np.abs(k), np.abs(v), lams) / scale if rounding else 0.0)
    bad = err > allowed  # (batch, heads, n, d_v)
    if not bad.any():
        return
    rows = bad.any(axis=3)  # (batch, heads, n)
    first_t = int(np.argwhere(rows.any(axis=(0, 1))).min())
    b, h = (int(x) for x in np.argwhere(rows[:, :, first_t])[0])
    wrong_pairs = int(rows.any(axis=2).sum())
    where = (f"{what}: o differs first at batch {b}, head {h} (lambda = {lams[h]:g}), row {first_t} of {n}; "
             f"{wrong_pairs} of {batch * heads} (batch, head) pairs are wrong; max |difference| "
             f"{float(np.max(np.abs(got - ref)[b, h])):.2g} vs max |reference| {float(scale[b, h, 0, 0]):.2g} in that "
             f"head (tolerance {rtol:g} of it for {dtype_name})")
    raise ExerciseError(f"{where}. Hint: {_hint(got, q, k, v, lams, rtol, rows, first_t, b)}")


def _hint(got, q, k, v, lams, rtol, rows, first_t, b) -> str:
    n = q.shape[-2]
    for weights, message in _mistakes(n, lams):
        if _matches(got, _attend(q, k, v, weights), rtol):
            return message
    heads_wrong = rows.any(axis=(0, 2))
    unit = np.asarray(lams) == 1.0
    only_decayed = bool(unit.any() and not heads_wrong[unit].any())
    decay_note = (" Only heads with lambda != 1 are wrong, so the decay is off: the weight of v_s is "
                  "lambda^(t - s), and inside a kernel that works in blocks, lambda^(r + 1) for the state's "
                  "contribution to row r of a block and lambda^(b - 1 - r) for row r's k in the state update"
                  if only_decayed else "")
    if rows.shape[0] > 1 and not rows[0].any():
        return (f"batch 0 is right and batch {b} wrong: a (batch, head) pair starts at (batch * heads + head) * n * d "
                "in each tensor, and its lambda is log2_decay[head], head = pair % heads." + decay_note)
    if first_t == 0:
        return ("row 0 is already wrong, where o_0 = (q_0 . k_0) v_0: check the diagonal term (s = t, weight 1) and "
                "how q, k, v are read: contiguous (batch, heads, n, d), d_k for q and k, d_v for v, the (batch, "
                "head) pair at offset (batch * heads + head) * n * d." + decay_note)
    if first_t % 16 == 0:
        return (f"rows 0-{first_t - 1} are right in every head and row {first_t}, a block boundary (a multiple of "
                "16), is the first wrong one: the state carried from one block to the next is off. Before a block "
                "starting at row j, KV = sum_{s < j} lambda^(j - 1 - s) k_s^T v_s; row r of the block adds "
                "lambda^(r + 1) q_r KV; after the block, KV = lambda^b KV + sum_r lambda^(b - 1 - r) k_r^T v_r over "
                "its b valid rows." + decay_note)
    return (f"rows 0-{first_t - 1} are right in every head: look at what changes at row {first_t} -- a block "
            "boundary, the mask of a partial last block (rows past n), or a loop bound." + decay_note)


def _inputs(case, seed: int, index: int, dtype, device):
    import torch

    from ..checks import random_qkv

    batch, heads, n, d_k, d_v, lams, what = _draw_case(case, seed, index)
    q, k, v = random_qkv(batch, heads, n, d_k, d_v, seed=9000 + 31 * index + seed)
    tensors = [torch.tensor(x, dtype=torch.float32).to(device=device, dtype=dtype).contiguous() for x in (q, k, v)]
    log2_decay = torch.tensor(np.log2(np.asarray(lams, dtype=np.float64)), dtype=torch.float32, device=device)
    return (batch, heads, n, d_k, d_v, lams, what), tensors, log2_decay


def _run_case(forward, case, seed, index, count, dtype_name, device, *, values: bool = True) -> None:
    import torch

    dtype = getattr(torch, dtype_name)
    (batch, heads, n, d_k, d_v, lams, what), (q, k, v), log2_decay = _inputs(case, seed, index, dtype, device)
    label = f"case {index + 1} of {count}, {what} ({_describe(batch, heads, n, d_k, d_v, lams, dtype_name)})"
    saved = [x.clone() for x in (q, k, v, log2_decay)]
    try:
        got = forward(q, k, v, log2_decay)
        if device == "cuda":
            torch.cuda.synchronize()  # a kernel's fault surfaces here, and is the student's
    except ExerciseError:
        raise
    except Exception as exc:  # noqa: BLE001 - anything the student's code raises becomes a message
        raise _failure(exc, label) from exc
    for name, before, after in zip(("q", "k", "v", "log2_decay"), saved, (q, k, v, log2_decay)):
        if not torch.equal(before, after):
            raise ExerciseError(f"{label}: your forward wrote into its input {name}; leave the inputs as they are")
    got = _expect_output(got, v, label)
    if not values:
        return
    as64 = [x.detach().to("cpu", torch.float64).numpy() for x in (q, k, v)]  # the rounded inputs, exactly
    _diagnose(got.to("cpu", torch.float64).numpy(), *as64, lams, TOLERANCE[(dtype_name, device)], label, dtype_name,
              ROUNDING[(dtype_name, device)])


def _prepare_integrity() -> None:
    """Import the book's kernels before the student's code runs, so that their launchers are switched off
    for the student's calls even when the student imports them inside ``forward``."""
    import importlib

    for name in ("lightning_edu.triton_kernels", "lightning_edu.triton_kernels.la1",
                 "lightning_edu.triton_kernels.decode", "lightning_edu.torch_chunked"):
        with contextlib.suppress(Exception):
            importlib.import_module(name)


@exercise("7.3")
def check_forward_kernel(forward, seed: int = 0) -> None:
    """``forward(q, k, v, log2_decay)`` must return the causal Lightning Attention output o (see the module's
    docstring): checked in float32 on four cases of awkward shapes against float64 numpy, and in bfloat16 (on
    a GPU: values at three shapes; without one: the output's shape, dtype and device, since Triton's CPU
    interpreter computes bfloat16 wrongly). ``seed`` 0 draws the fixed inputs, ``None`` fresh ones (the seed
    is printed), a positive int those of that seed. Prints ``Correct: ...`` or raises ExerciseError."""
    _prepare_integrity()
    device = _device()
    cases = [(case, "float32", True) for case in _CASES]
    if device == "cuda":
        cases += [(case, "bfloat16", True) for case in _CUDA_BF16_CASES]
    else:
        cases.append((_PROBE, "bfloat16", False))
    for index, (case, dtype_name, values) in enumerate(cases):
        _run_case(forward, case, seed, index, len(cases), dtype_name, device, values=values)
    if device == "cuda":
        passed(f"forward matches the float64 reference on {len(_CASES)} float32 cases (n = 1, partial blocks, "
               f"lambda = 1 and near 0, d_k != d_v) and {len(_CUDA_BF16_CASES)} bfloat16 cases, on the GPU")
    else:
        passed(f"forward matches the float64 reference on {len(_CASES)} float32 cases (n = 1, partial blocks, "
               "lambda = 1 and near 0, d_k != d_v) and returns bfloat16 for bfloat16 inputs (values in bfloat16 "
               "are checked on a GPU only)")


# ------------------------------------------------------------------------------------------- speed


def _require_gpu(who: str) -> None:
    import torch

    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        raise RuntimeError(f"{who} needs a CUDA GPU with Triton's interpreter off (TRITON_INTERPRET unset): "
                           "timings taken in the CPU interpreter would say nothing about a GPU")


def _geomean(values) -> float:
    values = list(values)
    return float(math.exp(sum(math.log(x) for x in values) / len(values)))


def _timing_args(shapes, heads, tokens, warmup, rep, bandwidth) -> tuple:
    """The timing arguments checked (ValueError/TypeError naming the one that is wrong); returns the shapes."""
    try:
        shapes = tuple(tuple(s) if isinstance(s, (list, tuple)) else s for s in shapes)
    except TypeError:
        raise TypeError(f"shapes must be a sequence of (T, D) pairs, got {shapes!r}") from None
    if not shapes:
        raise ValueError("shapes must name at least one (T, D) pair")
    for shape in shapes:
        if not (isinstance(shape, tuple) and len(shape) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in shape)):
            raise ValueError(f"each shape is a (T, D) pair of positive ints, got {shape!r}")
    for name, value in (("heads", heads), ("tokens", tokens), ("warmup", warmup), ("rep", rep)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if bandwidth is not None:
        _check_number("bandwidth", bandwidth, positive=True)
    return shapes


def time_forward_kernel(forward, *, shapes=TIMING_SHAPES, heads: int = TIMING_HEADS, tokens: int = TIMING_TOKENS,
                        warmup: int = 25, rep: int = 100, bandwidth: float | None = None) -> list[dict]:
    """Time ``forward`` beside the book's kernel on a GPU; one row per (T, D) of ``shapes``.

    Each shape: bfloat16 q, k, v of (tokens // T, heads, T, D), the lambdas of the benchmark
    (:func:`lightning_edu.models.decay.head_decays`), the book's forward (``la2_fast_forward`` with the backend's
    tiles, :func:`lightning_edu.triton_kernels.tiles_for`) timed first, then the student's, each by
    ``triton.testing.do_bench`` (median of the repetitions, ``warmup`` and ``rep`` in ms). do_bench clears the
    L2 cache before every repetition (it writes a 256 MB buffer), so each call reads its inputs from HBM, as
    it would inside a model. Before timing, one call of the student's forward runs with the package's
    implementations switched off (an integrity check at the timed shape), and its output is compared with the
    book's: a row whose output strays by more than :data:`TIMED_AGREEMENT` of a head's largest |o| is marked.

    Row keys: T, D, batch, heads, dtype, ms, book_ms, speedup (book_ms / ms: above 1 is faster than the book),
    floor_frac and book_floor_frac (the HBM floor's time over the measured time: q, k, v read and o written
    once, :func:`~lightning_edu.costs.hbm_floor_bytes`, at the device-to-device copy ``bandwidth`` in
    bytes/s, measured here when None), max_rel_diff_vs_book, agrees_with_book; or ``error`` for a shape where
    the student's forward failed. Raises RuntimeError without CUDA or under Triton's interpreter.
    """
    if not callable(forward):
        raise TypeError(f"forward must be callable, got {type(forward).__name__}")
    shapes = _timing_args(shapes, heads, tokens, warmup, rep, bandwidth)
    _require_gpu("time_forward_kernel")
    import torch

    from ..measure import copy_bandwidth

    bw = copy_bandwidth() if bandwidth is None else float(bandwidth)
    rows = []
    for T, D in shapes:
        rows.append(_time_shape(forward, T, D, heads, tokens, warmup, rep, bw))
        torch.cuda.empty_cache()  # the shape's tensors are gone with _time_shape's frame
    return rows


def _time_shape(forward, T: int, D: int, heads: int, tokens: int, warmup: int, rep: int, bw: float) -> dict:
    """One row of :func:`time_forward_kernel`: the book's forward and the student's at one (T, D)."""
    import torch
    from triton.testing import do_bench

    from ..costs import hbm_floor_bytes
    from ..measure import benchmark_inputs
    from ..models.decay import head_decays
    from ..triton_kernels import log2_decay_tensor, tiles_for
    from ..triton_kernels.la2_fast import la2_fast_forward

    batch = max(1, tokens // T)
    row = {"T": T, "D": D, "batch": batch, "heads": heads, "dtype": "bfloat16"}
    q, k, v, _ = benchmark_inputs(batch, heads, T, D, torch.bfloat16)
    book_decay = log2_decay_tensor(head_decays(heads), "cuda")
    student_decay = book_decay.clone()  # the book's tensor is cached and shared: the student gets a copy
    cfg = tiles_for(q, v)  # the backend's tiles for this call

    def book():
        return la2_fast_forward(q, k, v, book_decay, None, **cfg)[0]

    def student():
        return forward(q, k, v, student_decay)

    try:
        want = book().float()
        _prepare_integrity()
        got = _integrity.guarded(forward, label=getattr(forward, "__name__", "forward"))(q, k, v, student_decay)
        got = _expect_output(got, v, f"T = {T}, D = {D}").float()
        scale = want.abs().amax(dim=(2, 3), keepdim=True).clamp_min(1e-30)
        diff = float(((got - want).abs() / scale).nan_to_num(nan=float("inf")).max())
        row.update(max_rel_diff_vs_book=diff, agrees_with_book=diff <= TIMED_AGREEMENT)
        del want, got
        row["book_ms"] = do_bench(book, warmup=warmup, rep=rep, return_mode="median")
        row["ms"] = do_bench(student, warmup=warmup, rep=rep, return_mode="median")
    except Exception as exc:  # noqa: BLE001 - reported in the row, never a crash of the grading run
        row["error"] = str(exc if isinstance(exc, ExerciseError) else _failure(exc, f"T = {T}, D = {D}"))
    if "ms" in row:
        floor_ms = hbm_floor_bytes(batch, T, heads, D, q.element_size()) / bw * 1e3
        row.update(speedup=row["book_ms"] / row["ms"], floor_frac=floor_ms / row["ms"],
                   book_floor_frac=floor_ms / row["book_ms"], copy_bandwidth_bytes_per_s=bw)
    return row


# ------------------------------------------------------------------------------------------- submissions


def load_submission(path) -> types.FunctionType:
    """The ``forward`` of the submission file at ``path`` (or of ``path/submission.py`` for a folder).

    The file is read and run as a fresh module; nothing is written next to it (no ``__pycache__``). Raises
    ExerciseError with a message for a file that cannot be read, does not compile, fails while it runs, or
    defines no callable ``forward``."""
    path = Path(path)
    if path.is_dir():
        if not (path / "submission.py").is_file():
            raise ExerciseError(f"{path.name}/ holds no submission.py: hand in one file named submission.py")
        path = path / "submission.py"
    if path.suffix != ".py":
        raise ExerciseError(f"{path}: a submission is a Python file ending in .py")
    try:
        source = path.read_bytes()
    except OSError as exc:
        raise ExerciseError(f"{path}: could not be read ({type(exc).__name__}: {exc.strerror or exc})") from exc
    try:
        code = compile(source, str(path.resolve()), "exec", dont_inherit=True)
    except (SyntaxError, ValueError) as exc:
        line = f" (line {exc.lineno})" if getattr(exc, "lineno", None) else ""
        raise ExerciseError(f"{path.name} does not compile{line}: {type(exc).__name__}: "
                            f"{getattr(exc, 'msg', None) or exc}") from exc
    stem = re.sub(r"\W", "_", path.parent.name if path.name == "submission.py" else path.stem)
    module_name = f"contest_submission_{stem}_{secrets.token_hex(4)}"
    module = types.ModuleType(module_name)
    module.__file__ = str(path.resolve())
    sys.modules[module_name] = module  # Triton and dataclasses look a function's module up by name
    saved = sys.dont_write_bytecode
    sys.dont_write_bytecode = True
    try:
        exec(code, module.__dict__)  # noqa: S102 - running the student's file is what grading is
    except (Exception, SystemExit) as exc:  # noqa: BLE001
        sys.modules.pop(module_name, None)
        raise _failure(exc, f"{path.name}, while loading") from exc
    finally:
        sys.dont_write_bytecode = saved
    forward = module.__dict__.get("forward")
    if forward is None:
        raise ExerciseError(f"{path.name} defines no function `forward(q, k, v, log2_decay)`")
    if not callable(forward):
        raise ExerciseError(f"{path.name} defines forward as a {type(forward).__name__}, not a function")
    return forward


def find_submissions(paths) -> dict[str, Path]:
    """{student: path} for command-line arguments: a ``.py`` file is one student (its stem); a folder with a
    ``submission.py`` is one student (the folder's name); any other folder holds one ``.py`` file per student and
    one sub-folder per student, meant to hold a ``submission.py`` (the sub-folder is listed either way, so that
    :func:`grade` reports a missing file rather than skipping the student).
    Files and folders whose names start with ``_`` or ``.`` are skipped. Raises ValueError for a path that does
    not exist or is neither, and for two submissions of one name."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    found: dict[str, Path] = {}

    def add(name: str, path: Path):
        if name in found:
            raise ValueError(f"two submissions named {name!r}: {found[name]} and {path}")
        found[name] = path

    for raw in paths:
        path = Path(raw)
        if path.is_file():
            if path.suffix != ".py":
                raise ValueError(f"{path} is not a .py file")
            add(path.parent.name if path.name == "submission.py" else path.stem, path)
        elif path.is_dir():
            if (path / "submission.py").is_file():
                add(path.resolve().name, path / "submission.py")
                continue
            for entry in sorted(path.iterdir()):
                if entry.name.startswith(("_", ".")):
                    continue
                if entry.is_file() and entry.suffix == ".py":
                    add(entry.stem, entry)
                elif entry.is_dir():
                    add(entry.name, entry)
        else:
            raise ValueError(f"{path} does not exist")
    return found


# ------------------------------------------------------------------------------------------- grading


def _points_rule(correct_points, speed_points, speedup_cap) -> str:
    scaled = f"min(speedup, {speedup_cap:g})" + (f" / {speedup_cap:g}" if speedup_cap != 1 else "")
    return (f"a wrong submission scores 0; a correct one {correct_points:g} points, plus {speed_points:g} x "
            f"{scaled} where speedup is the geometric mean over the timed "
            "shapes of the book's time over the student's (0 when a timed shape fails or its output strays "
            "from the book's)")


def _check_number(name: str, value, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{name} must be a finite number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be {'positive' if positive else 'non-negative'}, got {value!r}")
    return float(value)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _score_speed(row: dict, timings: list, correct_points: float, speed_points: float, speedup_cap: float) -> None:
    """Fill a correct entry's timings, speedup, best_floor_frac, points and message from its timed rows.

    Speed points need every timed shape to have run and to agree with the book's output; the fraction of
    the HBM floor is shown for the shapes that ran either way."""
    row["timings"] = timings
    ran = [r for r in timings if "ms" in r]
    failed = [r for r in timings if "ms" not in r]
    strays = [r for r in ran if not r["agrees_with_book"]]
    row["best_floor_frac"] = max((r["floor_frac"] for r in ran), default=None)
    row["points"] = correct_points
    if failed:
        row["message"] += f" | speed: no points, failed at {_shape_text(failed[0])}: {_one_line(failed[0]['error'])}"
    elif strays:
        r = strays[0]
        row["message"] += (f" | speed: no points, the timed output at {_shape_text(r)} differs from the book's "
                           f"kernel's by {r['max_rel_diff_vs_book']:.2g} of a head's largest |o| (allowed "
                           f"{TIMED_AGREEMENT:g})")
    else:
        row["speedup"] = _geomean(r["speedup"] for r in timings)
        row["points"] = correct_points + speed_points * min(row["speedup"], speedup_cap) / speedup_cap


def grade(submissions: dict, *, seed: int | None = None, measure_speed: bool | None = None,
          correct_points: float = 60, speed_points: float = 40, speedup_cap: float = 1.0,
          timing: dict | None = None) -> dict:
    """Grade ``submissions`` ({student: a path to a .py file or folder, or a forward function}) and rank them.

    Each submission is loaded (:func:`load_submission`), checked (:func:`check_forward_kernel`, every student
    on the same inputs: those of ``seed``, fresh ones drawn once for the run when None), and, when speed is
    measured, timed (:func:`time_forward_kernel`, the book's kernel re-timed beside each student's, one copy
    bandwidth measured for the run). ``measure_speed`` None measures speed where a CUDA GPU is usable and
    not otherwise; True without one raises RuntimeError. ``timing`` passes keywords to
    :func:`time_forward_kernel` (shapes, heads, tokens, warmup, rep).

    Points: a wrong submission scores 0; a correct one ``correct_points``, plus, when speed is measured,
    ``speed_points * min(speedup, speedup_cap) / speedup_cap``, speedup being the geometric mean over the timed
    shapes of the book's time over the student's; a timed shape that fails, or whose output strays from the
    book's, costs the speed share (the report's ``points_rule`` says this in words). Ranks: by points, then by
    speedup; equal points and speedup share a rank (1, 1, 3).

    Returns a JSON-ready report: ``environment`` (machine, versions, commit, command), ``seed``,
    ``speed_measured``, ``speed_note``, ``points_rule``, ``max_points``, ``copy_bandwidth_bytes_per_s`` and
    ``entries``, one per student in rank order: student, source, rank, correct, message, speedup,
    best_floor_frac, points, timings. Speed fields are None when speed was not measured.
    """
    from ..environment import environment_record

    if not isinstance(submissions, dict) or not submissions:
        raise TypeError("submissions must be a non-empty dict {student name: path or forward function}")
    for name, entry in submissions.items():
        if not isinstance(name, str) or not name.strip():
            raise TypeError(f"student names must be non-empty strings, got {name!r}")
        if not (isinstance(entry, (str, os.PathLike)) or callable(entry)):
            raise TypeError(f"submission of {name!r} must be a path or a function, got {type(entry).__name__}")
    correct_points = _check_number("correct_points", correct_points, positive=False)
    speed_points = _check_number("speed_points", speed_points, positive=False)
    speedup_cap = _check_number("speedup_cap", speedup_cap, positive=True)
    if seed is None:
        seed = secrets.randbelow(2**31 - 2) + 1
    elif isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be None or a non-negative int, got {seed!r}")
    timing = dict(timing or {})
    unknown = set(timing) - {"shapes", "heads", "tokens", "warmup", "rep"}
    if unknown:
        raise ValueError(f"timing takes shapes, heads, tokens, warmup and rep, not {sorted(unknown)}")
    defaults = dict(shapes=TIMING_SHAPES, heads=TIMING_HEADS, tokens=TIMING_TOKENS, warmup=25, rep=100)
    _timing_args(**{**defaults, **timing}, bandwidth=None)
    gpu = _device() == "cuda"
    if measure_speed is None:
        measure_speed = gpu
    elif not isinstance(measure_speed, bool):
        raise TypeError(f"measure_speed must be None, True or False, got {measure_speed!r}")
    if measure_speed:
        _require_gpu("grade(measure_speed=True)")
    bandwidth = None
    if measure_speed:
        from ..measure import copy_bandwidth

        bandwidth = copy_bandwidth()

    entries = []
    for name, entry in submissions.items():
        source = f"function {getattr(entry, '__name__', '?')}" if callable(entry) else str(entry)
        row = {"student": name, "source": source, "correct": False, "message": "", "speedup": None,
               "best_floor_frac": None, "points": 0.0, "timings": None}
        entries.append(row)
        try:
            forward = entry if callable(entry) else load_submission(entry)
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                check_forward_kernel(forward, seed=seed)
            lines = [line for line in out.getvalue().splitlines() if line.startswith("Correct:")]
            row["correct"], row["message"] = True, lines[-1] if lines else "Correct"
        except ExerciseError as exc:
            row["message"] = _one_line(exc)
            continue
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - one student's crash never stops the run
            row["message"] = _one_line(_failure(exc, "the check"))
            continue
        row["points"] = correct_points
        if not measure_speed:
            continue
        try:
            timings = time_forward_kernel(forward, bandwidth=bandwidth, **timing)
        except Exception as exc:  # noqa: BLE001
            timings = [{"error": _one_line(f"{type(exc).__name__}: {exc}")}]
        _score_speed(row, timings, correct_points, speed_points, speedup_cap)
    entries.sort(key=lambda r: (-r["points"], -(r["speedup"] or 0.0), r["student"]))
    previous, rank = None, 0
    for position, row in enumerate(entries, start=1):
        key = (row["points"], row["speedup"])
        if key != previous:
            rank, previous = position, key
        row["rank"] = rank
        row["points"] = round(row["points"], 2)

    command = "python -m lightning_edu.exercises.contest " + " ".join(sys.argv[1:]) if _is_cli() else "grade(...)"
    if measure_speed:
        note = (f"measured on the GPU: bfloat16, {timing.get('heads', TIMING_HEADS)} heads, "
                f"{timing.get('tokens', TIMING_TOKENS)} tokens per call, the median of triton.testing.do_bench (L2 "
                "cleared before each repetition), the book's kernel timed beside each submission")
    elif not gpu:
        note = "not measured: no CUDA GPU in this run (correctness only, kernels in Triton's CPU interpreter)"
    else:
        note = "not measured: switched off for this run"
    return {
        "contest": "Lightning Attention forward",
        "environment": environment_record(command, device="cuda" if measure_speed else "cpu"),
        "seed": seed,
        "speed_measured": bool(measure_speed),
        "speed_note": note,
        "points_rule": _points_rule(correct_points, speed_points, speedup_cap),
        "max_points": correct_points + (speed_points if measure_speed else 0.0),
        "copy_bandwidth_bytes_per_s": bandwidth,
        "entries": entries,
    }


def _is_cli() -> bool:
    return bool(sys.argv and sys.argv[0].endswith(("contest.py", "contest")))


def _shape_text(row) -> str:
    return f"T = {row['T']}, D = {row['D']}" if "T" in row else "every shape"


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def leaderboard_markdown(report: dict) -> str:
    """The leaderboard of a :func:`grade` report as markdown: a table (rank, student, correct, geometric-mean
    speedup over the book's kernel, best fraction of the HBM floor, points), the messages, and where and how it
    was measured. Speed columns say "not measured" when speed was not measured; no number is made up."""
    if not isinstance(report, dict) or "entries" not in report:
        raise TypeError("leaderboard_markdown takes the dict that grade() returns")
    env = report.get("environment", {})
    measured = report.get("speed_measured", False)
    lines = ["# Leaderboard: Lightning Attention forward", ""]
    if not measured:
        lines += [f"**Speed was {report.get('speed_note', 'not measured')}.** Points are the correctness share only, "
                  f"out of {report.get('max_points', 0):g}.", ""]
    lines += ["| rank | student | correct | speedup vs the book (geo. mean) | best fraction of HBM floor | points |",
              "|---:|---|:---:|---:|---:|---:|"]
    for row in report["entries"]:
        if not measured:
            speed = floor = _NOT_MEASURED if row["correct"] else "-"
        else:
            if row["speedup"] is not None:
                speed = f"{row['speedup']:.2f}x"
            else:
                speed = "no points" if row["correct"] else "-"
            floor = f"{row['best_floor_frac']:.2f}" if row["best_floor_frac"] is not None else "-"
        lines.append(f"| {row['rank']} | {_cell(row['student'])} | {'yes' if row['correct'] else 'no'} | {speed} | "
                     f"{floor} | {row['points']:g} / {report.get('max_points', 0):g} |")
    lines += ["", "## Messages", ""]
    lines += [f"- **{_cell(row['student'])}**: {row['message']}" for row in report["entries"]]
    if measured:
        lines += ["", "## Timings (ms; the book's kernel beside each)", "",
                  "| student | T | D | ms | book ms | speedup | fraction of HBM floor |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for row in report["entries"]:
            for t in row.get("timings") or ():
                if "ms" in t:
                    lines.append(f"| {_cell(row['student'])} | {t['T']} | {t['D']} | {t['ms']:.3f} | "
                                 f"{t['book_ms']:.3f} | {t['speedup']:.2f}x | {t['floor_frac']:.2f} |")
    bw = report.get("copy_bandwidth_bytes_per_s")
    lines += ["", "## How", "",
              f"- points: {report.get('points_rule', '')}",
              f"- correctness inputs: seed {report.get('seed')} (`check_forward_kernel(forward, seed="
              f"{report.get('seed')})` reproduces a student's message)",
              f"- speed: {report.get('speed_note', '')}"
              + (f"; device-to-device copy bandwidth {bw / 1e12:.2f} TB/s" if bw else ""),
              f"- machine: {env.get('machine', '?')}; torch {env.get('torch', '?')}, triton {env.get('triton', '?')}, "
              f"python {env.get('python', '?')}; {env.get('date', '?')}; commit {env.get('commit') or 'unknown'}",
              f"- command: `{env.get('command', '?')}`", ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- the command


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_edu.exercises.contest",
                                     description="The Lightning Attention forward kernel contest: grade "
                                                 "submissions, or write the starter submission.")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("grade", help="check (and on a GPU, time) submissions and print the leaderboard")
    g.add_argument("paths", nargs="+", metavar="DIR_OR_FILE",
                   help="a .py file per student, a student's folder with submission.py, or a folder of either")
    g.add_argument("--out", help="write the report as JSON here")
    g.add_argument("--markdown", help="write the leaderboard as markdown here")
    g.add_argument("--seed", type=int, default=None, help="the correctness inputs' seed (default: fresh)")
    g.add_argument("--no-speed", action="store_true", help="do not time, even on a GPU")
    s = sub.add_parser("starter", help="write the starter submission (a correct, plain Triton kernel)")
    s.add_argument("path", help="where to write it (an existing file is never overwritten)")
    args = parser.parse_args(argv)
    if args.command == "starter":
        target = Path(args.path)
        if target.exists():
            parser.error(f"{target} exists; the starter never overwrites a file")
        target.write_text(STARTER)
        print(f"wrote {target}: define forward(q, k, v, log2_decay) there and make it fast")
        return 0
    if args.seed is not None and args.seed < 0:
        parser.error("--seed must be a non-negative int")
    try:
        found = find_submissions(args.paths)
    except ValueError as exc:
        parser.error(str(exc))
    if not found:
        parser.error("no submissions found (a .py file per student, or a folder per student with submission.py)")
    report = grade(found, seed=args.seed, measure_speed=False if args.no_speed else None)
    text = leaderboard_markdown(report)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
