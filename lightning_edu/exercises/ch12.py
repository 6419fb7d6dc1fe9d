"""Checks for the exercises of chapter 12 (one sequence across several devices).

* :func:`check_incoming_states` -- the reader's ``incoming_states(states, counts, lam, initial_state)``: the
  state each rank starts from, given every rank's local state (its slice's state started from zero), the
  number of tokens of each slice, the per-head decay and the state before the first token. The reference is
  independent of any combination formula: the token-by-token recurrence of chapter 02 run over the whole
  sequence and stopped at each rank's first token. Slices are uneven (one token, many tokens), heads have
  lambda = 1, 0.9 and 1e-3, d_k != d_v. It recognises the decay forgotten, a power one too many or too few,
  the local state decayed again, the rank's own token count used instead of the previous rank's, the initial
  state left out, the outgoing state returned instead of the incoming one, and head 0's lambda used for every
  head.

* :func:`check_finish_outputs` -- the reader's ``finish_outputs(o_local, q, incoming, lam)``: a rank's outputs
  from its local ones (its slice run from a zero state) and its incoming state. The reference is again the
  token-by-token recurrence over the whole sequence, its rows of the rank's slice. Every rank of the same
  layouts is checked, rank 0 of a sequence with an initial state among them. It recognises the decay forgotten,
  a power one too many or too few, powers counted from the slice's end, the local outputs left out or decayed
  too, the state transposed (where d_k = d_v lets it pass the shapes), and head 0's lambda used for every head.

Everything is float64 numpy with a heads axis first: states (heads, d_k, d_v), lam (heads,), a slice's rows
(heads, n_r, d).
"""

from __future__ import annotations

import numpy as np

from ..numpy_reference import causal_linear_recurrent
from ._core import ExerciseError, call_reader, exercise, expect_shape, passed

__all__ = ["check_incoming_states", "check_finish_outputs", "local_states", "sequence_states"]

_RTOL = 1e-10
_CASES = [  # (tokens per rank, d_k, d_v, lambda per head, with an initial state)
    ([5, 17, 1, 9], 4, 3, [0.9, 1.0, 1e-3], True),
    ([8, 8], 3, 5, [0.9, 0.5], False),
    ([1, 1, 1, 1, 1], 2, 2, [0.7, 1.0], True),  # d_k = d_v: a transposed state keeps its shape
    ([30, 2, 11], 5, 4, [0.99, 0.8, 0.95, 1e-3], True),
    ([60, 50, 3], 3, 2, [1e-3, 0.9], True),  # 1e-3^-110 overflows: a division by a power of lambda fails
    ([6, 9, 4], 3, 3, [0.9, 1.0, 0.6], True),  # d_k = d_v and slices of several tokens (exercise 12.2 starts here)
]


def _draw(case: int, base: int):
    """(lam, q, k, v, initial_state) of layout ``case`` of :data:`_CASES`, from the stream ``base + 17 * case``; the
    initial state is zeros where the layout has none."""
    counts, d_k, d_v, lams, with_s0 = _CASES[case]
    rng = np.random.default_rng(base + 17 * case)
    heads, n = len(lams), sum(counts)
    q, k = rng.standard_normal((2, heads, n, d_k))
    v = rng.standard_normal((heads, n, d_v))
    s0 = rng.standard_normal((heads, d_k, d_v)) if with_s0 else np.zeros((heads, d_k, d_v))
    return np.array(lams), q, k, v, s0


def _slices(counts):
    ends = np.cumsum(counts)
    return [slice(int(e - c), int(e)) for c, e in zip(counts, ends)]


def local_states(q, k, v, lam, counts) -> list[np.ndarray]:
    """Each rank's local state: the recurrence over its slice alone, started from zero; (heads, d_k, d_v) each.

    q, k: (heads, n, d_k); v: (heads, n, d_v); counts: tokens per rank, summing to n.
    """
    out = []
    for s in _slices(counts):
        _, state = causal_linear_recurrent(q[None, :, s], k[None, :, s], v[None, :, s], lam, return_state=True)
        out.append(state[0])
    return out


def sequence_states(k, v, lam, counts, initial_state) -> list[np.ndarray]:
    """The state of the whole sequence just before each rank's first token (the recurrence over the prefix)."""
    heads, d_k, d_v = k.shape[0], k.shape[-1], v.shape[-1]
    s0 = np.zeros((heads, d_k, d_v)) if initial_state is None else initial_state
    out, start = [], 0
    for c in counts:
        if start == 0:
            out.append(s0.copy())
        else:
            q = np.zeros((heads, start, d_k))
            _, state = causal_linear_recurrent(q[None], k[None, :, :start], v[None, :, :start], lam,
                                               initial_state=s0[None], return_state=True)
            out.append(state[0])
        start += c
    return out


def _variants(states, counts, lam, s0):
    """The usual slips, each as the list of incoming states it produces."""
    heads = lam.shape[0]
    lam3 = lam[:, None, None]

    def combine(power, carry_local=False, lam_used=lam3, own=False, start=s0):
        """[IN_0, ..., IN_R]: the R incoming states and the state after the last slice."""
        out, cur = [start.copy()], start.copy()
        for r in range(len(counts)):
            n = counts[r + 1] if own and r + 1 < len(counts) else counts[r]
            p = lam_used ** power(n)
            cur = p * (cur + states[r]) if carry_local else p * cur + states[r]
            out.append(cur)
        return out

    return {
        "decay forgotten": combine(lambda n: 0)[:-1],
        "one power too few": combine(lambda n: n - 1)[:-1],
        "one power too many": combine(lambda n: n + 1)[:-1],
        "local state decayed again": combine(lambda n: n, carry_local=True)[:-1],
        "own count": combine(lambda n: n, own=True)[:-1],
        "initial state left out": combine(lambda n: n, start=np.zeros_like(s0))[:-1],
        "outgoing": combine(lambda n: n)[1:],
        "head 0": combine(lambda n: n, lam_used=np.full((heads, 1, 1), lam[0]))[:-1],
    }


_HINTS = {
    "decay forgotten": "the carried state is not decayed: everything before rank r-1's slice is n_{r-1} tokens "
                       "older at rank r, so IN_r = lam**n_{r-1} * IN_{r-1} + S_{r-1}",
    "one power too few": "the carried state is decayed by lam**(n_{r-1} - 1): the previous slice has n_{r-1} tokens "
                         "and each multiplies the state by lam once, so the power is n_{r-1}",
    "one power too many": "the carried state is decayed by lam**(n_{r-1} + 1): the previous slice has n_{r-1} "
                          "tokens and each multiplies the state by lam once, so the power is n_{r-1}",
    "local state decayed again": "S_{r-1} was decayed along with IN_{r-1}: the local state already ends at the last "
                                 "token of its slice, so IN_r = lam**n_{r-1} * IN_{r-1} + S_{r-1}, not "
                                 "lam**n_{r-1} * (IN_{r-1} + S_{r-1})",
    "own count": "each rank's carried state is decayed by the next rank's token count: the state crossing rank r-1's "
                 "slice decays once per token of that slice, lam**n_{r-1}",
    "initial state left out": "the initial state is missing: rank 0 starts from it, and it reaches every later "
                              "rank decayed by lam**(tokens before that rank)",
    "outgoing": "you returned the state after each rank's slice (the outgoing state); the exercise asks for the "
                "state each rank starts from: IN_0 is the initial state, IN_r the state after rank r-1's slice",
    "head 0": "every head uses head 0's lambda: lam has one value per head; broadcast it as lam[:, None, None]",
}


def _tolerance(want) -> dict:
    """The tolerances of every comparison here: _RTOL, relative to the larger of want's largest entry and 1."""
    return {"rtol": _RTOL, "atol": _RTOL * max(float(np.max(np.abs(want))), 1.0)}


def _close(got, want) -> bool:
    return np.allclose(got, want, **_tolerance(want))


def _first_wrong(got, ref):
    return next((r for r, (g, e) in enumerate(zip(got, ref)) if not _close(g, e)), None)


def _read(out, ranks, shape, where):
    if out is None:
        raise ExerciseError(f"incoming_states returned None {where} -- did you forget the return?")
    if isinstance(out, np.ndarray) and out.ndim == 4:
        out = list(out)
    if not isinstance(out, (list, tuple)):
        raise ExerciseError(f"incoming_states must return a list with one state per rank {where}, got "
                            f"{type(out).__name__}")
    if len(out) != ranks:
        raise ExerciseError(f"incoming_states returned {len(out)} states {where}: one per rank is {ranks}, "
                            "rank 0's (the initial state) included")
    got = []
    for r, x in enumerate(out):
        try:
            arr = expect_shape(f"the state of rank {r} {where}", x, shape).astype(np.float64)
        except ExerciseError:
            raise
        except Exception as exc:  # a string, a ragged list: reported, never a crash of the check
            raise ExerciseError(f"the state of rank {r} {where} is not an array of numbers: {exc}") from exc
        if not np.isfinite(arr).all():
            raise ExerciseError(f"the state of rank {r} {where} holds NaN or inf: with lambda in (0, 1] every power "
                                "lam**n is in [0, 1]; never divide by a power of lambda")
        got.append(arr)
    return got


@exercise("12.1", reveals=("incoming_states",))
def check_incoming_states(incoming_states, seed: int = 0) -> None:
    """``incoming_states(states, counts, lam, initial_state) -> [IN_0, ..., IN_{R-1}]``.

    states: a list of R local states (heads, d_k, d_v), rank r's slice run from a zero state; counts: the R
    token counts; lam: (heads,); initial_state: (heads, d_k, d_v), the state before rank 0's first token.
    IN_0 = initial_state and IN_r = lam**n_{r-1} IN_{r-1} + S_{r-1}, lam broadcast per head.
    """
    for case, (counts, d_k, d_v, lams, with_s0) in enumerate(_CASES):
        lam, q, k, v, s0 = _draw(case, 1300 + seed)
        heads = len(lams)
        states = local_states(q, k, v, lam, counts)
        ref = sequence_states(k, v, lam, counts, s0)
        where = (f"for {len(counts)} ranks holding {counts} tokens, lambda per head {lams}"
                 + ("" if with_s0 else ", a zero initial state"))
        args = ([x.copy() for x in states], list(counts), lam.copy(), s0.copy())
        out = call_reader(incoming_states, "incoming_states", args, where)
        if any(not np.array_equal(a, b) for a, b in zip(args[0], states)) or not np.array_equal(args[3], s0):
            raise ExerciseError(f"incoming_states changed its inputs in place {where}: build new arrays")
        got = _read(out, len(counts), (heads, d_k, d_v), where)
        r = _first_wrong(got, ref)
        if r is None:
            continue
        for name, variant in _variants(states, counts, lam, s0).items():
            if _first_wrong(got, variant) is None:
                raise ExerciseError(f"the incoming state of rank {r} is wrong {where}: {_HINTS[name]}")
        diff = float(np.max(np.abs(got[r] - ref[r])))
        raise ExerciseError(f"the incoming state of rank {r} is wrong {where} (ranks before it are right): max "
                            f"|difference| {diff:.2g}. It must equal the state of the whole sequence just before "
                            f"rank {r}'s first token: IN_r = lam**n_(r-1) * IN_(r-1) + S_(r-1)")
    passed(f"incoming_states gives every rank the state of the whole sequence before its slice: {len(_CASES)} "
           "layouts, uneven slices, lambda = 1, 0.9 and 1e-3")


def _finished(o_local, q, incoming, lam, power=lambda t, n: t + 1, local=1, scale_local=False, transpose=False):
    """o_local + diag(lam**power(t)) q IN and its usual slips: ``local`` 0 leaves o_local out, ``scale_local``
    decays it with the correction, ``transpose`` uses IN^T, ``power(t, n_r)`` gives row t's exponent."""
    n = q.shape[1]
    scale = lam[:, None] ** power(np.arange(n), n)[None, :]  # (heads, n_r)
    state = incoming.transpose(0, 2, 1) if transpose else incoming
    if scale_local:
        return scale[..., None] * (o_local + q @ state)
    return local * o_local + scale[..., None] * (q @ state)


_FINISH_HINTS = {
    "decay forgotten": "the incoming state is not decayed: row t of the slice is t + 1 tokens after the state IN_r, "
                       "so its correction is lam**(t+1) * (q_t @ IN_r)",
    "one power too few": "row t is decayed by lam**t: the state IN_r ends just before the slice, and row t = 0, the "
                         "slice's first token, already multiplies it by lam once, so the power is t + 1",
    "one power too many": "row t is decayed by lam**(t + 2): the state IN_r ends just before the slice, and row t "
                          "(t = 0, 1, ...) is t + 1 tokens after it, so the power is t + 1",
    "counted from the end": "the powers run backwards: the first row of the slice is the closest to IN_r (lam**1), "
                            "the last the farthest (lam**n_r)",
    "local left out": "the local outputs are missing: return o_local plus the correction, not the correction alone",
    "local decayed too": "o_local was decayed along with the correction: the local outputs already hold their own "
                         "decay (they come from the slice run from a zero state); only the term q_t @ IN_r is "
                         "multiplied by lam**(t+1)",
    "state transposed": "the state is used transposed: IN_r is (d_k, d_v), so the correction of row t is "
                        "q_t @ IN_r, (d_k,) @ (d_k, d_v)",
    "head 0": "every head uses head 0's lambda: lam has one value per head; broadcast it as lam[:, None]",
}


def _finish_variants(o_local, q, incoming, lam):
    heads = lam.shape[0]
    out = {
        "decay forgotten": _finished(o_local, q, incoming, lam, power=lambda t, n: 0 * t),
        "one power too few": _finished(o_local, q, incoming, lam, power=lambda t, n: t),
        "one power too many": _finished(o_local, q, incoming, lam, power=lambda t, n: t + 2),
        "counted from the end": _finished(o_local, q, incoming, lam, power=lambda t, n: n - t),
        "local left out": _finished(o_local, q, incoming, lam, local=0),
        "local decayed too": _finished(o_local, q, incoming, lam, scale_local=True),
        "head 0": _finished(o_local, q, incoming, np.full(heads, lam[0])),
    }
    if incoming.shape[1] == incoming.shape[2]:
        out["state transposed"] = _finished(o_local, q, incoming, lam, transpose=True)
    return out


@exercise("12.2", reveals=("_correct",))
def check_finish_outputs(finish_outputs, seed: int = 0) -> None:
    """``finish_outputs(o_local, q, incoming, lam) -> o``, one rank's outputs.

    o_local: (heads, n_r, d_v), the rank's slice run from a zero state; q: (heads, n_r, d_k); incoming:
    (heads, d_k, d_v), IN_r; lam: (heads,). o = o_local + diag(lam**(t+1)) q IN_r per head, t = 0..n_r - 1.
    """
    # The layouts with d_k = d_v first, longest slices first: there a transposed state keeps its shape and gets its
    # hint (elsewhere its product raises), and a power off by one differs from no decay (a one-token slice has
    # only row 0, where lam**t is lam**0).
    for case in sorted(range(len(_CASES)), key=lambda c: (_CASES[c][1] != _CASES[c][2], -min(_CASES[c][0]))):
        counts, d_k, d_v, lams, with_s0 = _CASES[case]
        lam, q, k, v, s0 = _draw(case, 1400 + seed)
        heads = len(lams)
        whole = causal_linear_recurrent(q[None], k[None], v[None], lam, initial_state=s0[None])[0]
        ins = sequence_states(k, v, lam, counts, s0)
        for r, s in enumerate(_slices(counts)):
            o_local = causal_linear_recurrent(q[None, :, s], k[None, :, s], v[None, :, s], lam)[0]
            where = (f"for rank {r} of {len(counts)} (ranks holding {counts} tokens, d_k = {d_k}, d_v = {d_v}, "
                     f"lambda per head {lams}" + (")" if with_s0 else ", a zero initial state)"))
            args = (o_local.copy(), q[:, s].copy(), ins[r].copy(), lam.copy())
            out = call_reader(finish_outputs, "finish_outputs", args, where)
            if not all(np.array_equal(a, b) for a, b in zip(args, (o_local, q[:, s], ins[r], lam))):
                raise ExerciseError(f"finish_outputs changed its inputs in place {where}: build a new array")
            got = expect_shape(f"the outputs {where}", out, (heads, counts[r], d_v)).astype(np.float64)
            if not np.isfinite(got).all():
                raise ExerciseError(f"the outputs {where} hold NaN or inf: with lambda in (0, 1] every power lam**(t+1) "
                                    "is in [0, 1]; never divide by a power of lambda")
            ref = whole[:, s]
            if _close(got, ref):
                continue
            for name, variant in _finish_variants(o_local, q[:, s], ins[r], lam).items():
                if _close(got, variant):
                    raise ExerciseError(f"the outputs are wrong {where}: {_FINISH_HINTS[name]}")
            bad = np.argwhere(~np.isclose(got, ref, **_tolerance(ref)))[0]
            raise ExerciseError(f"the outputs are wrong {where}, first at head {bad[0]}, row {bad[1]} of the slice: "
                                f"{got[tuple(bad)]:.6g} against {ref[tuple(bad)]:.6g}. Row t must equal the output "
                                "of the whole sequence: o_local[t] + lam**(t+1) * (q[t] @ IN_r), per head")
    passed(f"finish_outputs gives every rank the outputs of the whole sequence: {len(_CASES)} layouts, every rank, "
           "uneven slices, lambda = 1, 0.9 and 1e-3")
