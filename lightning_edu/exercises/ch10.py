"""Checks for the exercises of chapter 10 (inference: decoding, and packed variable-length batches).

Everything here is one head in float64 numpy, with no batch or head axes:

* :func:`check_step` -- the reader's decoding step ``step(q, k, v, state, lam) -> (o, new_state)`` on seeded
  random tokens (d_k != d_v; lambda = 1, 0.9, 1e-3; a zero state), against
  :func:`lightning_edu.lightning_attention_step`, then run over 37 tokens against one
  :func:`lightning_edu.lightning_attention` call. It recognises the output read from the old state, the decay
  applied to the new token, the outer product transposed, the decay forgotten, and a state changed in place.
* :func:`suspect_packed_forward` -- a chunked packed forward with a bug for the reader to find, and
  :func:`check_exposes_suspect`, which checks the reader's input on which it is wrong.
* :func:`check_packed_forward` -- the reader's packed forward against :func:`reference_packed_forward` (one
  call of the recurrence per sequence) on empty, length-1 and single sequences, a boundary at every position
  of a short packed batch, and a NaN that must stay in its own sequence.

A failure names the first wrong token and the sequence it belongs to.
"""

from __future__ import annotations

import numpy as np

from ..api import lightning_attention, lightning_attention_step
from ..numpy_reference import causal_linear_recurrent
from ..validation import validate_cu_seqlens, validate_decay, validate_positive_int
from ._core import ExerciseError, call_reader, exercise, expect_shape, passed, refuse_low_precision, wrong_rows

__all__ = [
    "check_step",
    "suspect_packed_forward",
    "reference_packed_forward",
    "check_exposes_suspect",
    "check_packed_forward",
]

_RTOL = 1e-9
_STEP_RTOL = 1e-10
_STEP_CASES = [  # (d_k, d_v, lambda, zero state)
    (5, 3, 1.0, False),
    (5, 3, 0.9, False),
    (4, 6, 1e-3, False),
    (5, 3, 0.9, True),
    (3, 7, 0.5, False),
]
_PACKED_CASES = [  # (cu_seqlens, d_k, d_v, lambda)
    ([0, 16, 21, 40], 5, 3, 0.9),
    ([0, 0, 7, 7, 20], 5, 3, 0.9),
    ([0, 1, 2, 3, 9], 4, 6, 0.8),
    ([0, 37], 5, 3, 0.95),
    ([0, 5, 21, 40, 41], 3, 7, 1.0),
    ([0, 1, 33, 34, 70], 5, 3, 0.7),
    ([0, 3, 300], 3, 2, 0.05),  # a long sequence at a small lambda: lambda^-t overflows in a cumsum rewrite
]
_SWEEP_N = 24
# What a shape error in a step means: the outer product or the read transposed.
_STEP_SHAPES = ("a transpose: state is (d_k, d_v), keys along the rows, so new_state = lam * state + np.outer(k, v) "
                "(np.outer(v, k) is its (d_v, d_k) transpose), and o = q @ new_state, a (d_k,) vector times a (d_k, "
                "d_v) matrix (new_state @ q multiplies the wrong side)")
_SUSPECT_BLOCKS = (8, 16, 32)


# ----------------------------------------------------------------------------------------------------------
# Shared helpers


def _qkv(seed: int, n: int, d_k: int, d_v: int):
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, n, d_k))
    v = rng.standard_normal((n, d_v))
    return q, k, v


def _as_array(name: str, out, shape) -> np.ndarray:
    refuse_low_precision(name, out)
    try:
        return expect_shape(name, out, shape).astype(np.float64)
    except ExerciseError:
        raise
    except Exception as exc:  # a string, a ragged list, ...: reported, never a crash of the check
        raise ExerciseError(f"{name} is {type(out).__name__}, which is not an array of numbers: {exc}") from exc


def _shape(x):
    try:
        return np.shape(x)
    except Exception:  # a ragged list has no shape
        return None


def _same(got, ref, rtol: float = _RTOL) -> bool:
    return ref is not None and got.shape == ref.shape and not wrong_rows(got, ref, rtol=rtol, axis=0).size


def _max_diff(got, ref) -> float:
    diff = np.abs(got - ref)
    return float(np.nanmax(diff)) if np.isfinite(diff).any() else float("nan")


# ----------------------------------------------------------------------------------------------------------
# 1. One decoding step


def _step_reference(q, k, v, state, lam):
    o, new_state = lightning_attention_step(q[None, None], k[None, None], v[None, None], state[None, None], lam,
                                            backend="numpy")
    return o[0, 0], new_state[0, 0]


def _run_step(step, q, k, v, state, lam, where: str):
    """Call the reader's step on copies; return (o, new_state) as float64 arrays, or raise ExerciseError."""
    d_k, d_v = k.shape[0], v.shape[0]
    args = (q.copy(), k.copy(), v.copy(), state.copy(), lam)
    out = call_reader(step, "step", args, where, shape_hint=_STEP_SHAPES)
    if out is None:
        raise ExerciseError("step returned None -- did you forget `return o, new_state`?")
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise ExerciseError(f"step must return a pair (o, new_state), got {type(out).__name__}"
                            + (f" of length {len(out)}" if isinstance(out, (tuple, list)) else ""))
    for name, given, original in (("state", args[3], state), ("q", args[0], q), ("k", args[1], k), ("v", args[2], v)):
        if not np.array_equal(given, original):
            if name == "state":
                raise ExerciseError(f"step changed the state you were given in place; return a new array ({where}): "
                                    "the caller keeps the old state (to branch, or to retry a token), so write "
                                    "new_state = lam * state + np.outer(k, v), not state *= lam; state += ...")
            raise ExerciseError(f"step changed its argument {name} in place ({where}); leave the inputs alone")
    o_raw, s_raw = out
    if s_raw is not None and d_k != d_v and _shape(s_raw) == (d_v, d_k):
        raise ExerciseError(f"new_state has shape {(d_v, d_k)} = (d_v, d_k) {where}, expected (d_k, d_v) = "
                            f"{(d_k, d_v)}: "
                            "the outer product is transposed (v^T k). The state is k^T v = np.outer(k, v), keys "
                            "along the rows, so that o = q new_state has d_v entries")
    o = _as_array(f"o (the output of step, {where})", o_raw, (d_v,))
    new_state = _as_array(f"new_state (the state step returned, {where})", s_raw, (d_k, d_v))
    return o, new_state


def _step_mistake(q, k, v, state, lam, o, new_state, ref_o, ref_state, where: str) -> str:
    """The message for a wrong step: the mistake recognised, or where it differs."""
    outer = np.outer(k, v)
    if not np.isfinite(o).all() or not np.isfinite(new_state).all():
        return (f"step returned NaN or inf {where}: with finite inputs and lambda in (0, 1] every output and "
                "state entry is finite")
    if not _same(new_state, ref_state, _STEP_RTOL):
        if lam != 1.0 and _same(new_state, lam * (state + outer), _STEP_RTOL):
            return (f"new_state is wrong {where}: you decayed the new token too, lam * (state + outer(k, v)). "
                    "Only the old state decays: new_state = lam * state + outer(k, v); the token just added "
                    "decays from the next step on")
        if lam != 1.0 and _same(new_state, state + outer, _STEP_RTOL):
            return (f"new_state is wrong {where}, yet right at lam = 1 only: new_state = state + outer(k, v) "
                    "forgets the decay. Multiply the old state by lam: new_state = lam * state + outer(k, v)")
        return (f"new_state differs from lightning_attention_step {where}: max |difference| "
                f"{_max_diff(new_state, ref_state):.2g}. It must be lam * state + np.outer(k, v)")
    if _same(o, q @ state, _STEP_RTOL) or _same(o, lam * (q @ state), _STEP_RTOL):
        return (f"o is wrong {where}: it was read from the old state, before the update, so the token does not "
                "see itself. Update first, then read: o = q @ new_state")
    return (f"o differs from lightning_attention_step {where} although new_state is right: max |difference| "
            f"{_max_diff(o, ref_o):.2g}. The output is o = q @ new_state, a vector of d_v entries")


@exercise("10.1", reveals=("step_from_args",))
def check_step(step, seed: int = 0) -> None:
    """``step(q, k, v, state, lam) -> (o, new_state)``: one decoding step of one head, for one token.

    q, k: (d_k,); v: (d_v,); state: (d_k, d_v); lam: a float in (0, 1]. ``new_state = lam state + k^T v``
    (``np.outer(k, v)``) and ``o = q new_state``, a (d_v,) vector; the given state must not change.
    """
    for case, (d_k, d_v, lam, zero) in enumerate(_STEP_CASES):
        rng = np.random.default_rng(1000 + case + seed)
        q, k = rng.standard_normal((2, d_k))
        v = rng.standard_normal(d_v)
        state = np.zeros((d_k, d_v)) if zero else rng.standard_normal((d_k, d_v))
        where = f"for d_k = {d_k}, d_v = {d_v}, lam = {lam}" + (", a zero state" if zero else "")
        o, new_state = _run_step(step, q, k, v, state, lam, where)
        ref_o, ref_state = _step_reference(q, k, v, state, lam)
        if _same(o, ref_o, _STEP_RTOL) and _same(new_state, ref_state, _STEP_RTOL):
            continue
        raise ExerciseError(_step_mistake(q, k, v, state, lam, o, new_state, ref_o, ref_state, where))

    # Many steps: a prompt-free generation of 37 tokens from a random initial state equals one call over them.
    n, d_k, d_v, lam = 37, 5, 3, 0.9
    q, k, v = _qkv(1010 + seed, n, d_k, d_v)
    state0 = np.random.default_rng(1011 + seed).standard_normal((d_k, d_v))
    ref_o, ref_state = lightning_attention(q[None, None], k[None, None], v[None, None], lam, backend="numpy",
                                           initial_state=state0[None, None], return_state=True)
    ref_o, ref_state = ref_o[0, 0], ref_state[0, 0]
    state, outs = state0, []
    for t in range(n):
        o, state = _run_step(step, q[t], k[t], v[t], state, lam, f"at token {t} of a {n}-token run")
        outs.append(o)
    outs = np.stack(outs)
    rows = wrong_rows(outs, ref_o, rtol=_STEP_RTOL, axis=0)
    if rows.size:
        t = int(rows[0])
        raise ExerciseError(f"stepping through {n} tokens (lam = {lam}, a random initial state) differs from one "
                            f"lightning_attention call first at token {t} ({rows.size} of {n} outputs wrong, max "
                            f"|difference| {_max_diff(outs, ref_o):.2g}): feed each step the state the previous "
                            "step returned")
    if not _same(state, ref_state, _STEP_RTOL):
        raise ExerciseError(f"after {n} steps the state differs from lightning_attention's final state (max "
                            f"|difference| {_max_diff(state, ref_state):.2g}) although every output is right")
    passed(f"step matches lightning_attention_step on {len(_STEP_CASES)} tokens (lam = 1, 0.9, 1e-3, a zero "
                  f"state) and {n} steps equal one lightning_attention call, final state included")


# ----------------------------------------------------------------------------------------------------------
# 2. Packed batches: a reference, a suspect, and an input that exposes it


def reference_packed_forward(q, k, v, lam, cu_seqlens) -> np.ndarray:
    """The packed forward done one sequence at a time: the ground truth of this chapter's checks.

    One head: q, k (total, d_k); v (total, d_v); lam in (0, 1]; cu_seqlens: num_seqs + 1 integers, from 0 to
    total, never decreasing. Sequence i is rows ``cu_seqlens[i] : cu_seqlens[i + 1]``; each runs through
    :func:`lightning_edu.numpy_reference.causal_linear_recurrent` on its own slice from a zero state (an empty
    sequence has no rows and contributes nothing). Returns o (total, d_v), float64.
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    bounds = validate_cu_seqlens(cu_seqlens, q.shape[0])
    o = np.zeros((q.shape[0], v.shape[1]))
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            rows = slice(start, end)
            o[rows] = causal_linear_recurrent(q[None, None, rows], k[None, None, rows], v[None, None, rows], lam)[0, 0]
    return o


def suspect_packed_forward(q, k, v, lam, cu_seqlens, block: int = 16) -> np.ndarray:
    """A chunked packed forward: the blockwise algorithm of chapter 04 run over the packed tokens.

    One head: q, k (total, d_k); v (total, d_v); lam in (0, 1]; cu_seqlens as in
    :func:`reference_packed_forward`, every sequence starting from a zero state. The packed rows are cut into
    blocks of ``block`` tokens; a block's outputs are its intra-block part (the masked product) plus its
    inter-block part (the running state, decayed), and the state then advances over the block. Returns o
    (total, d_v), float64.
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    block = validate_positive_int("block", block)
    total = q.shape[0]
    bounds = validate_cu_seqlens(cu_seqlens, total)
    starts = set(bounds[:-1])  # the rows where a sequence begins
    lam = float(validate_decay(lam, 1)[0])
    o = np.zeros((total, v.shape[1]))
    state = np.zeros((q.shape[1], v.shape[1]))  # the running state KV, carried from one block to the next
    for b0 in range(0, total, block):
        b1 = min(b0 + block, total)
        if b0 in starts:  # this block's first row begins a sequence: that sequence starts from zeros
            state = np.zeros_like(state)
        r = np.arange(b1 - b0)  # row positions inside the block, 0 .. B-1
        gap = r[:, None] - r[None, :]
        mask = np.where(gap >= 0, lam ** np.maximum(gap, 0), 0.0)  # causal decay lam^(r - s), one for the block
        intra = ((q[b0:b1] @ k[b0:b1].T) * mask) @ v[b0:b1]  # row r sees every row s <= r of this block
        inter = (lam ** (r + 1))[:, None] * (q[b0:b1] @ state)  # and, decayed, the state the block started from
        o[b0:b1] = intra + inter
        # The state after the block: the old one decayed over all B rows, row s added with lam^(B - 1 - s).
        state = lam ** (b1 - b0) * state + (k[b0:b1] * (lam ** (b1 - b0 - 1 - r))[:, None]).T @ v[b0:b1]
    return o


def _sequence_of(bounds, t: int) -> int:
    """The sequence that packed row t belongs to (the last i with cu_seqlens[i] <= t < cu_seqlens[i + 1])."""
    return int(np.searchsorted(np.asarray(bounds[1:]), t, side="right"))


def _token(bounds, t: int) -> str:
    i = _sequence_of(bounds, t)
    return f"token {t} (sequence {i}, its token {t - bounds[i]})"


def _inner(bounds, total: int) -> list[int]:
    """The boundaries where one non-empty stretch of rows ends and another begins: 0 < b < total."""
    return sorted({b for b in bounds if 0 < b < total})


@exercise("10.2", allowed=("lightning_edu.exercises.ch10.suspect_packed_forward",
                           "lightning_edu.exercises.ch10.reference_packed_forward"))
def check_exposes_suspect(make_input) -> None:
    """``make_input() -> (q, k, v, lam, cu_seqlens)``: an input on which :func:`suspect_packed_forward` (its
    default block of 16) differs from :func:`reference_packed_forward`.

    q, k: (total, d_k); v: (total, d_v), finite numbers; lam in (0, 1]; cu_seqlens: integers starting at 0,
    never decreasing, ending at total (an empty sequence repeats a boundary).
    """
    out = call_reader(make_input, "make_input", ())
    if out is None:
        raise ExerciseError("make_input returned None -- did you forget `return q, k, v, lam, cu_seqlens`?")
    if not isinstance(out, (tuple, list)) or len(out) != 5:
        raise ExerciseError(f"make_input must return 5 things (q, k, v, lam, cu_seqlens), got {type(out).__name__}"
                            + (f" of length {len(out)}" if isinstance(out, (tuple, list)) else ""))
    q, k, v, lam, cu_seqlens = out
    arrays = {}
    for name, x in (("q", q), ("k", k), ("v", v)):
        try:
            arr = np.asarray(x, dtype=np.float64)
        except Exception as exc:
            raise ExerciseError(f"{name} is {type(x).__name__}, which is not an array of numbers: {exc}") from exc
        if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 1:
            raise ExerciseError(f"{name} has shape {arr.shape}: one head packed, {name} must be 2-D (total, "
                                f"{'d_v' if name == 'v' else 'd_k'}) with total >= 1 tokens")
        if not np.isfinite(arr).all():
            raise ExerciseError(f"{name} holds NaN or inf: use finite numbers -- a NaN makes every comparison fail "
                                "and proves nothing about the suspect")
        arrays[name] = arr
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    if k.shape != q.shape or v.shape[0] != q.shape[0]:
        raise ExerciseError(f"q {q.shape}, k {k.shape}, v {v.shape}: q and k must have the same shape (total, d_k), "
                            "and v the same number of rows (total, d_v)")
    total = q.shape[0]
    try:
        lam = float(validate_decay(lam, 1, name="lam")[0])
    except (TypeError, ValueError) as exc:
        raise ExerciseError(f"{exc} (lam is one decay factor, a float in (0, 1])") from exc
    try:
        bounds = validate_cu_seqlens(cu_seqlens, total)
    except (TypeError, ValueError) as exc:
        raise ExerciseError(f"{exc}. The rule: cu_seqlens holds num_seqs + 1 integers, starts at 0, never "
                            f"decreases (an empty sequence repeats a boundary) and ends at total = {total}; "
                            "sequence i is rows cu_seqlens[i] : cu_seqlens[i + 1]") from exc

    block = 16
    ref = reference_packed_forward(q, k, v, lam, bounds)
    if not np.isfinite(ref).all():
        raise ExerciseError("the right outputs themselves overflow on this input (q, k and v too large): inf - inf "
                            "is NaN, which proves nothing about the suspect. Use values of moderate size")
    sus = suspect_packed_forward(q, k, v, lam, bounds, block)
    # A difference counts when it is more than rounding: measured against the size of the terms summed (the outputs
    # of |q|, |k|, |v|), not of the outputs, which cancellation can make tiny.
    scale = float(np.abs(reference_packed_forward(np.abs(q), np.abs(k), np.abs(v), lam, bounds)).max())
    rows = np.flatnonzero((np.abs(sus - ref) > _RTOL * scale).any(axis=1))
    inner = _inner(bounds, total)
    if rows.size and not any(b % block for b in inner):  # the suspect is exact here: the difference is rounding
        rows = rows[:0]
    if rows.size:
        t = int(rows[0])
        b0 = t - t % block
        crossed = [b for b in inner if b0 < b < b0 + block] or [b for b in inner if b % block]
        why = f"; boundary {crossed[0]} falls inside the block of rows {b0}-{b0 + block - 1}" if crossed else ""
        passed(f"the suspect is wrong on your input: {_token(bounds, t)} is its first wrong output "
               f"({rows.size} of {total} wrong, max |difference| {_max_diff(sus, ref):.2g}){why}")
        return
    shown = ", ".join(str(b) for b in sorted(set(bounds)))
    if not inner:
        raise ExerciseError(f"the suspect is right on this input: cu_seqlens {list(bounds)} holds one sequence with "
                            "tokens, so there is no boundary to cross. Pack at least two non-empty sequences")
    if all(b % block == 0 for b in inner):
        raise ExerciseError(f"the suspect is right on this input: every boundary you chose ({shown}) is a multiple "
                            f"of its block size {block} -- what happens to a boundary inside a block?")
    mid = next(b for b in inner if b % block)
    small = f", or lam = {lam:.3g} so small that lam^distance falls under 1e-9 of the output" if lam < 0.1 else ""
    raise ExerciseError(f"the suspect is right on this input, although boundary {mid} falls inside a block: here "
                        "the rows before it leave nothing for the rows after it to see (zero keys or values before "
                        f"it, or zero queries after it{small}). Use random q, k, v and a decay near 1")


# ----------------------------------------------------------------------------------------------------------
# 3. The reader's packed forward


def _packed_mistake(packed_forward, q, k, v, lam, bounds, got, seed: int = 0) -> str:
    """A hint for a wrong packed forward: the suspect's bug, or a state that runs across boundaries."""
    whole = causal_linear_recurrent(q[None, None], k[None, None], v[None, None], lam)[0, 0]
    if _same(got, whole):
        # Never reset, or reset only at boundaries that start a block? Ask on boundaries that start every block.
        n = 64
        aq, ak, av = _qkv(1099 + seed, n, q.shape[1], v.shape[1])
        aligned = [0, 32, n]
        try:
            probe = _as_array("o", call_reader(packed_forward, "packed_forward", (aq, ak, av, lam, list(aligned))),
                              (n, v.shape[1]))
        except ExerciseError:  # only a hint is at stake here
            probe = None
        if probe is not None and _same(probe, reference_packed_forward(aq, ak, av, lam, aligned)):
            return ("it is right when every boundary starts a block (cu_seqlens [0, 32, 64]) and wrong here: the "
                    "state or the intra-block mask crosses a boundary inside a block. Reset the state and cut the "
                    "mask at every boundary, also mid-block")
        return ("it equals ONE call over the whole packed sequence: the state runs across sequence boundaries: "
                "reset it at every cu_seqlens entry (each sequence starts from zeros)")
    blocks = [b for b in _SUSPECT_BLOCKS if _same(got, suspect_packed_forward(q, k, v, lam, bounds, b))]
    if blocks:
        return (f"it equals suspect_packed_forward with block {' or '.join(map(str, blocks))} here: the state or the "
                "intra-block mask crosses a boundary inside a block. Reset the state and cut the mask at every "
                "boundary, also mid-block")
    if lam != 1.0:
        try:
            at_one = _as_array("o", call_reader(packed_forward, "packed_forward", (q.copy(), k.copy(), v.copy(), 1.0,
                                                                              list(bounds))), got.shape)
        except ExerciseError:  # only a hint is at stake here
            at_one = None
        if at_one is not None and _same(at_one, reference_packed_forward(q, k, v, 1.0, bounds)):
            return ("it is right at lam = 1, so the decay is off: token t of a sequence sees its token s <= t with "
                    "weight lam^(t - s), and the state decays by lam at every token")
    return ("nothing may cross a boundary: each sequence sees only its own tokens, from a zero state, with the "
            "decay lam^(t - s) counted inside the sequence")


def _packed_compare(packed_forward, q, k, v, lam, bounds, where: str, seed: int = 0) -> None:
    total, d_v = v.shape
    got = _as_array(f"o (the output of packed_forward, {where})",
                    call_reader(packed_forward, "packed_forward", (q.copy(), k.copy(), v.copy(), lam, list(bounds)), where),
                    (total, d_v))
    ref = reference_packed_forward(q, k, v, lam, bounds)
    rows = wrong_rows(got, ref, rtol=_RTOL, axis=0)
    if not rows.size:
        return
    t = int(rows[0])
    if not np.isfinite(got).all():
        bad = int(np.flatnonzero(~np.isfinite(got).all(axis=1))[0])
        raise ExerciseError(f"packed_forward has NaN or inf at {_token(bounds, bad)} {where}: with finite inputs "
                            "every output is finite")
    raise ExerciseError(f"packed_forward differs {where} first at {_token(bounds, t)}: {rows.size} of {total} outputs "
                        f"wrong, max |difference| {_max_diff(got, ref):.2g}. Hint: "
                        + _packed_mistake(packed_forward, q, k, v, lam, bounds, got, seed))


# Allowed: single-sequence methods (the statement's lightning_attention on one sequence) and masked_product, whose
# mask the reader builds. Not the suspect: with block=1 every boundary starts a block and it is exact on any packed
# batch, one call and no boundary handled; an allowed function must not be the answer.
@exercise("10.3", reveals=("packed_forward",),
          allowed=("lightning_edu.api.lightning_attention", "lightning_edu.numpy_reference.masked_product"),
          strict=("lightning_edu.packed.packed_forward", "lightning_edu.exercises.ch10.reference_packed_forward",
                  "lightning_edu.exercises.ch10.suspect_packed_forward"))
def check_packed_forward(packed_forward, seed: int = 0) -> None:
    """``packed_forward(q, k, v, lam, cu_seqlens) -> o``: causal linear attention with decay over a packed batch of
    one head, every sequence from a zero state (:func:`reference_packed_forward`).

    q, k: (total, d_k); v: (total, d_v); cu_seqlens: a list of num_seqs + 1 ints; o: (total, d_v).
    """
    for case, (bounds, d_k, d_v, lam) in enumerate(_PACKED_CASES):
        q, k, v = _qkv(1020 + case + seed, bounds[-1], d_k, d_v)
        _packed_compare(packed_forward, q, k, v, lam, bounds, f"for cu_seqlens {bounds}, d_k = {d_k}, d_v = {d_v}, "
                                                              f"lam = {lam}", seed)

    # One boundary at every position of a short packed batch.
    n, d_k, d_v, lam = _SWEEP_N, 5, 3, 0.9
    q, k, v = _qkv(1040 + seed, n, d_k, d_v)
    for p in range(1, n):
        try:
            _packed_compare(packed_forward, q, k, v, lam, [0, p, n], f"for cu_seqlens [0, {p}, {n}]", seed)
        except ExerciseError as exc:
            raise ExerciseError(f"packed_forward is wrong when the one boundary sits at position {p}: {exc}") from exc

    # Isolation: a NaN in the values of sequence 1 stays there.
    bounds, d_k, d_v, lam, nan_at = [0, 6, 9, 20], 5, 3, 0.9, 7
    q, k, v = _qkv(1050 + seed, bounds[-1], d_k, d_v)
    v[nan_at, 1] = np.nan
    got = _as_array("o (the output of packed_forward, with a NaN in v)",
                    call_reader(packed_forward, "packed_forward", (q.copy(), k.copy(), v.copy(), lam, list(bounds))),
                    (bounds[-1], d_v))
    ref = reference_packed_forward(q, k, v, lam, bounds)
    nan_seq = _sequence_of(bounds, nan_at)
    others = np.array([_sequence_of(bounds, t) != nan_seq for t in range(bounds[-1])])
    before = np.arange(bounds[-1]) < nan_at
    for label, rows_kept in (("other", others), ("earlier", ~others & before)):
        rows = np.flatnonzero(rows_kept)
        bad = rows[wrong_rows(got[rows], ref[rows], rtol=_RTOL, axis=0)]
        if not bad.size:
            continue
        t = int(bad[0])
        if label == "other" and not np.isfinite(got[t]).all():
            raise ExerciseError(f"a NaN in sequence {nan_seq} (v at token {nan_at}) reached sequence "
                                f"{_sequence_of(bounds, t)}'s output at token {t}: masks must select "
                                "(np.where(keep, scores, 0)), never multiply -- NaN * 0 is NaN -- and no state "
                                "may carry a token into another sequence")
        if label == "earlier" and not np.isfinite(got[t]).all():
            raise ExerciseError(f"a NaN in v at token {nan_at} reached the output at token {t}, before it in the same "
                                f"sequence {nan_seq}: the causal mask must select (np.where(keep, scores, 0)), never "
                                "multiply -- NaN * 0 is NaN")
        raise ExerciseError(f"with a NaN in v at token {nan_at} (sequence {nan_seq}), packed_forward differs at "
                            f"{_token(bounds, t)}, which must not depend on it: max |difference| "
                            f"{_max_diff(got[rows], ref[rows]):.2g}")
    passed(f"packed_forward matches one call per sequence on {len(_PACKED_CASES)} packed batches (empty and "
                  f"length-1 sequences included), with a boundary at every position 1..{n - 1} of {n} tokens, and a "
                  "NaN stays in its own sequence")
