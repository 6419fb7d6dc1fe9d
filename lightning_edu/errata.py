"""The backward equations as printed, run literally, beside the corrected forms. (Chapter 05.)

Three sources are transcribed here: the Lightning Attention-2 paper (Qin et al., 2024), eqs. 11-20 and
Algorithm 2; a design note on a recompute-heavy "Lightning Attention-3" backward (not public; "the LA-3 note");
and the explainer on feature maps and decoding, "Inference: No KV Cache" (its memory table, chunked hybrid,
decoding loop and a citation: :data:`EXPLAINER_ERRATA`; chapters 10-11). Each
printed equation becomes a small function that does exactly what the text says, so the book can run it
and measure how far it lands from float64 autograd (:func:`autograd_gradients`, the judge). The corrected
forms are either here, next to the literal one, or the package's own
:func:`lightning_edu.numpy_blockwise.blockwise_backward`.

Conventions of the literal functions (they follow the paper, not the package): one head, 2-D arrays
q, k (n, d_k), v, do (n, d_v), a scalar decay ``lam`` and a block size ``B`` that divides n (the paper's
T = n / B). Blocks are numbered 1..T as the paper numbers them; block t holds positions (t-1)B+1 .. tB
(1-based), i.e. rows (t-1)B .. tB-1 of the arrays. Inside a block, r = 1..B.

:data:`ERRATA` lists every slip with a literal function, a corrected one and the gradient they are
compared on; :func:`evidence` measures both against autograd. One table is not an equation: the memory table
of the explainer on feature maps and decoding, "Inference: No KV Cache" (:func:`explainer_memory_table`,
chapter 10).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .checks import relative_error
from .numpy_reference import causal_linear_recurrent
from .numpy_reference import decay_mask
from .validation import validate_attention_args, validate_block_size, validate_choice, validate_decay

__all__ = [
    "explainer_memory_table", "autograd_gradients", "finite_difference_gradients", "eq11_eq12_token_gradients",
    "eq13_dkv_definition", "eq20_dkv_recursion", "eq20_dkv_recursion_corrected", "dq_eq15", "dk_eq16", "dk_eq17",
    "dv_eq18_literal", "dv_eq18", "dv_eq19", "algorithm2", "la3_backward", "la3_current_buffer_table",
    "la3_micro_buffer_table", "ERRATA", "evidence",
]


# --------------------------------------------------------------------------------------------------
# The judges: float64 autograd on the quadratic form, and central finite differences.
# --------------------------------------------------------------------------------------------------

def autograd_gradients(q, k, v, do, decay=1.0, initial_state=None, d_final_state=None, with_decay: bool = False):
    """dL/dq, dL/dk, dL/dv, dL/d initial_state by torch float64 autograd through the masked quadratic form.

    L = <o, do> + <KV_n, d_final_state>, where o = [(Q K^T) * M] V + diag(lambda^t) Q KV_0 and
    KV_n = sum_s lambda^(n-s) k_s^T v_s + lambda^n KV_0 (t, s = 1..n). Shapes as in
    :func:`lightning_edu.lightning_attention_backward`: q, k (batch, heads, n, d_k), v, do (batch, heads, n, d_v),
    states (batch, heads, d_k, d_v). Nothing blockwise or recurrent is involved: this is the judge.
    With ``with_decay`` a fifth array follows: dL/dlambda, one value per head (the judge of chapter 06's
    learnable decay: autograd through every power lambda^(t-s) of M, lambda^t and lambda^(n-s)).
    """
    import torch

    args = validate_attention_args(q, k, v, decay, backend="numpy", initial_state=initial_state, do=do, d_final_state=d_final_state)
    t64 = lambda x: torch.tensor(np.asarray(x, dtype=np.float64), dtype=torch.float64)  # noqa: E731
    qt, kt, vt = (t64(x).requires_grad_(True) for x in (args.q, args.k, args.v))
    s0 = t64(np.zeros((args.batch, args.heads, args.d_k, args.d_v)) if initial_state is None else initial_state).requires_grad_(True)
    lam_heads = t64(args.decay).requires_grad_(with_decay)
    lam = lam_heads[:, None, None]
    pos = torch.arange(1, args.seq_len + 1, dtype=torch.float64)
    gap = pos[:, None] - pos[None, :]
    mask = torch.where(gap >= 0, lam ** gap.clamp(min=0), torch.zeros(()))  # (heads, n, n)
    o = ((qt @ kt.transpose(-1, -2)) * mask) @ vt + (lam ** pos[:, None]) * (qt @ s0)
    to_end = lam ** (args.seq_len - pos)[:, None]  # lambda^(n-s), (heads, n, 1)
    kv_n = (to_end * kt).transpose(-1, -2) @ vt + lam**args.seq_len * s0
    loss = (o * t64(do)).sum()
    if d_final_state is not None:
        loss = loss + (kv_n * t64(d_final_state)).sum()
    loss.backward()
    grads = tuple(x.grad.numpy() for x in (qt, kt, vt, s0))
    return grads + (lam_heads.grad.numpy(),) if with_decay else grads


def finite_difference_gradients(q, k, v, do, decay=1.0, initial_state=None, d_final_state=None, h: float = 1e-3):
    """The same four gradients by central differences of L, one entry at a time, with the recurrent scan.

    L is linear in each of q, k, v and KV_0 separately, so central differences carry no truncation
    error at all: only rounding, of order eps * |L| / h. That is why a large step h = 1e-3 is the better one.
    Cost: 2 forward scans per entry; use small shapes.
    """
    arrays = [np.array(x, dtype=np.float64) for x in (q, k, v)]
    b, h_, _, d_k = arrays[0].shape
    state = np.zeros((b, h_, d_k, arrays[2].shape[-1])) if initial_state is None else np.array(initial_state, dtype=np.float64)
    do = np.asarray(do, dtype=np.float64)
    g = None if d_final_state is None else np.asarray(d_final_state, dtype=np.float64)

    def loss(qq, kk, vv, ss):
        o, kv_n = causal_linear_recurrent(qq, kk, vv, decay, initial_state=ss, return_state=True)
        return float(np.sum(o * do) + (0.0 if g is None else np.sum(kv_n * g)))

    inputs = arrays + [state]
    grads = []
    for which, x in enumerate(inputs):
        grad = np.empty_like(x)
        for idx in np.ndindex(x.shape):
            keep = x[idx]
            x[idx] = keep + h
            plus = loss(*inputs)
            x[idx] = keep - h
            minus = loss(*inputs)
            x[idx] = keep
            grad[idx] = (plus - minus) / (2 * h)
        grads.append(grad)
    return tuple(grads)


# --------------------------------------------------------------------------------------------------
# Lightning Attention-2, section 3.2.2, as printed.
# --------------------------------------------------------------------------------------------------

def _single_head(q, k, v, do, lam, B=None):
    q, k, v, do = (np.asarray(x, dtype=np.float64) for x in (q, k, v, do))
    if q.ndim != 2:
        raise ValueError(f"the literal equations take one head: q must be 2-D (n, d_k), got shape {q.shape}")
    validate_attention_args(q[None, None], k[None, None], v[None, None], lam, backend="numpy", do=do[None, None])
    lam = float(validate_decay(lam, 1)[0])
    if B is not None:
        B = validate_block_size(B, "B")
        if q.shape[0] % B:
            raise ValueError(f"the paper's equations assume B divides n (T = n / B): got n = {q.shape[0]}, B = {B}")
    return q, k, v, do, lam, B


def _block(x, t, B):
    """Block t (1-based, the paper's X_t) of x, or zeros of that shape when t lies past either end."""
    n = x.shape[0]
    if t < 1 or t > n // B:
        return np.zeros((B,) + x.shape[1:])
    return x[(t - 1) * B : t * B]


def eq11_eq12_token_gradients(q, k, v, do, lam):
    """Eqs. 11-12 as printed (they are right): dq_t = do_t kv_t^T, dk_t = v_t dkv_t^T, dv_t = k_t dkv_t.

    kv_t comes from the forward recurrence (eq. 4); dkv_t from eq. 12, dkv_{n+1} = 0,
    dkv_{t-1} = lambda dkv_t + q_{t-1}^T do_{t-1}, i.e. dkv_t = sum_{s >= t} lambda^(s-t) q_s^T do_s.
    One head: q, k (n, d_k); v, do (n, d_v). Returns (dq, dk, dv).
    """
    q, k, v, do, lam, _ = _single_head(q, k, v, do, lam)
    n = q.shape[0]
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    kv = np.zeros((q.shape[1], v.shape[1]))
    for t in range(n):
        kv = lam * kv + np.outer(k[t], v[t])
        dq[t] = do[t] @ kv.T
    dkv = np.zeros_like(kv)  # dkv_{n+1}
    for t in reversed(range(n)):
        dkv = lam * dkv + np.outer(q[t], do[t])  # eq. 12 turns dkv_{t+1} into dkv_t
        dk[t] = v[t] @ dkv.T
        dv[t] = k[t] @ dkv
    return dq, dk, dv


def eq13_dkv_definition(q, do, lam, B):
    """Eq. 13's definition, summed directly: dKV_t = sum_{s > tB} lambda^(s - tB) q_s^T do_s, t = 0..T.

    Returns an array of shape (T + 1, d_k, d_v) indexed by t (dKV_T is the empty sum, 0).
    """
    q, _, _, do, lam, B = _single_head(q, q, do, do, lam, B)
    n = q.shape[0]
    s = np.arange(1, n + 1)
    out = []
    for t in range(n // B + 1):
        w = np.where(s > t * B, lam ** np.maximum(s - t * B, 0), 0.0)
        out.append((w[:, None] * q).T @ do)
    return np.stack(out)


def eq20_dkv_recursion(q, do, lam, B):
    """Eq. 20's last line as printed, from eq. 13's start dKV_{T+1} = 0:
    dKV_t = lambda^B dKV_{t+1} + (Lambda Q_t)^T dO_t, Lambda = diag(lambda, ..., lambda^B), t = T..1.

    Returns shape (T + 1, d_k, d_v) indexed by t = 0..T like :func:`eq13_dkv_definition` (t = 0 is NaN:
    the recursion never reaches it, it would need a block Q_0).
    """
    q, _, _, do, lam, B = _single_head(q, q, do, do, lam, B)
    T = q.shape[0] // B
    lam_diag = lam ** np.arange(1, B + 1)[:, None]
    out = np.full((T + 2, q.shape[1], do.shape[1]), np.nan)
    out[T + 1] = 0.0
    for t in range(T, 0, -1):
        out[t] = lam**B * out[t + 1] + (lam_diag * _block(q, t, B)).T @ _block(do, t, B)
    return out[: T + 1]


def eq20_dkv_recursion_corrected(q, do, lam, B):
    """Eq. 20 corrected: dKV_T = 0 and dKV_t = lambda^B dKV_{t+1} + (Lambda Q_{t+1})^T dO_{t+1}.

    The sum its middle line splits off runs over s = tB+1 .. (t+1)B: that is block t+1, not block t.
    Reproduces :func:`eq13_dkv_definition` for t = 0..T.
    """
    q, _, _, do, lam, B = _single_head(q, q, do, do, lam, B)
    T = q.shape[0] // B
    lam_diag = lam ** np.arange(1, B + 1)[:, None]
    out = np.zeros((T + 1, q.shape[1], do.shape[1]))
    for t in range(T - 1, -1, -1):
        out[t] = lam**B * out[t + 1] + (lam_diag * _block(q, t + 1, B)).T @ _block(do, t + 1, B)
    return out


def dq_eq15(q, k, v, do, lam, B, r_range: str = "1..B"):
    """dQ by eq. 15: block t+1 gets [(dO V^T) * M] K + Lambda dO (KV_t)^T, KV_t the forward state (eq. 6).

    ``r_range="1..B"``: Lambda = diag(lambda^r) for r = 1..B (Algorithm 2's Lambda): right.
    ``r_range="0..B-1"``: the range eq. 14 states, 0 <= r < B, which makes Lambda = diag(1, ..., lambda^(B-1))
    (eq. 9's Lambda): wrong by a factor lambda on every inter term.
    """
    r_range = validate_choice("r_range", r_range, ("1..B", "0..B-1"))
    q, k, v, do, lam, B = _single_head(q, k, v, do, lam, B)
    r = {"1..B": np.arange(1, B + 1), "0..B-1": np.arange(0, B)}[r_range]
    lam_diag = lam ** r[:, None]
    M = decay_mask(B, lam)
    dq = np.empty_like(q)
    kv = np.zeros((q.shape[1], v.shape[1]))
    for t in range(q.shape[0] // B):  # block t+1 of the paper
        rows = slice(t * B, (t + 1) * B)
        dq[rows] = ((do[rows] @ v[rows].T) * M) @ k[rows] + lam_diag * (do[rows] @ kv.T)
        kv = lam**B * kv + ((lam ** (B - np.arange(1, B + 1)))[:, None] * k[rows]).T @ v[rows]
    return dq


def _intra_sum_token(p, block_end, weight, left, right):
    """sum_{s = p..block_end} weight(s) * left_s^T right_s, positions 1-based."""
    acc = np.zeros((left.shape[1], right.shape[1]))
    for s in range(p, block_end + 1):
        acc += weight(s) * np.outer(left[s - 1], right[s - 1])
    return acc


def dk_eq16(q, k, v, do, lam, B, exponent: str = "printed", state: str = "eq13"):
    """dK token by token by eq. 16's last line, for block t, positions p = (t-1)B + r, 0 < r <= B:

    dk_p = v_p sum_{s = p..tB} lambda^e do_s^T q_s + lambda^(B-r) v_p dKV_t^T.

    ``exponent="printed"``: e = tB + r - s, as printed (copied from the forward's eq. 14).
    ``exponent="corrected"``: e = s - p = s - (t-1)B - r, as the line above it in eq. 16 says.
    ``state``: which dKV_t: "eq13" (the definition) or "eq20" (the printed recursion, which is shifted).
    """
    exponent = validate_choice("exponent", exponent, ("printed", "corrected"))
    state = validate_choice("state", state, ("eq13", "eq20"))
    q, k, v, do, lam, B = _single_head(q, k, v, do, lam, B)
    T = q.shape[0] // B
    dkv = eq13_dkv_definition(q, do, lam, B) if state == "eq13" else eq20_dkv_recursion(q, do, lam, B)
    dk = np.empty_like(k)
    for t in range(1, T + 1):
        for r in range(1, B + 1):
            p = (t - 1) * B + r
            if exponent == "printed":
                e = lambda s: lam ** (t * B + r - s)  # noqa: E731
            else:
                e = lambda s: lam ** (s - p)  # noqa: E731
            intra = _intra_sum_token(p, t * B, e, do, q)
            dk[p - 1] = v[p - 1] @ intra + lam ** (B - r) * v[p - 1] @ dkv[t].T
    return dk


def _intra_blocks(q, lam, B):
    """The intra decay mask M and the row slices of the T whole blocks (0-based list)."""
    M = decay_mask(B, lam)
    T = q.shape[0] // B
    rows = [slice(i * B, (i + 1) * B) for i in range(T)]
    return M, rows


def dk_eq17(q, k, v, do, lam, B, state: str = "eq20"):
    """dK by eq. 17: dK_{t-1} = [(dO_{t-1} V_{t-1}^T) * M]^T Q_{t-1} + lambda^B Lambda^-1 V_{t-1} dKV_t^T.

    Block t-1 is paired with dKV_t. ``state="eq20"``: dKV_t from the printed recursion (eq. 20 with
    dKV_{T+1} = 0), for which this pairing is right. ``state="eq13"``: dKV_t as eq. 13 defines it, for
    which block t-1 misses the contribution of block t (wrong). lambda^B Lambda^-1 is formed as
    diag(lambda^(B-r)) directly (its literal form overflows: see :func:`algorithm2`).
    """
    state = validate_choice("state", state, ("eq13", "eq20"))
    q, k, v, do, lam, B = _single_head(q, k, v, do, lam, B)
    dkv = eq20_dkv_recursion(q, do, lam, B) if state == "eq20" else eq13_dkv_definition(q, do, lam, B)
    dkv = np.concatenate([dkv, np.zeros((1,) + dkv.shape[1:])])  # index T+1 for the eq13 case
    M, rows = _intra_blocks(q, lam, B)
    k_scale = lam ** (B - np.arange(1, B + 1))[:, None]
    dk = np.empty_like(k)
    for t in range(2, len(rows) + 2):  # block t-1 runs over 1..T
        x = rows[t - 2]
        dk[x] = ((do[x] @ v[x].T) * M).T @ q[x] + k_scale * (v[x] @ dkv[t].T)
    return dk


def dv_eq18_literal(q, k, v, do, lam, B, t: int = 1, r: int = 1):
    """Eq. 18's second line as printed, for one position p = (t-1)B + r:

    dv_p = k_p (sum_{s=p..tB} lambda^(tB+r-s) q_s^T do_s) + lambda^(B-r) (sum_{s>tB} lambda^(s-tB) q_s^T do_s).

    The second term lacks the factor k_p, so it is a d_k x d_v matrix added to a row of d_v numbers:
    numpy broadcasts the row over the matrix and returns shape (d_k, d_v). It is not a gradient of v_p,
    whose shape is (d_v,); eq. 18's last line puts the k_p back.
    """
    q, k, v, do, lam, B = _single_head(q, k, v, do, lam, B)
    p = (t - 1) * B + r
    intra = _intra_sum_token(p, t * B, lambda s: lam ** (t * B + r - s), q, do)
    inter = eq13_dkv_definition(q, do, lam, B)[t]
    return k[p - 1] @ intra + lam ** (B - r) * inter


def dv_eq18(q, k, v, do, lam, B, exponent: str = "printed"):
    """dV token by token by eq. 18's last line (which has the k back):
    dv_p = k_p sum_{s=p..tB} lambda^e q_s^T do_s + lambda^(B-r) k_p dKV_t, with e as in :func:`dk_eq16`."""
    exponent = validate_choice("exponent", exponent, ("printed", "corrected"))
    q, k, v, do, lam, B = _single_head(q, k, v, do, lam, B)
    T = q.shape[0] // B
    dkv = eq13_dkv_definition(q, do, lam, B)
    dv = np.empty_like(v)
    for t in range(1, T + 1):
        for r in range(1, B + 1):
            p = (t - 1) * B + r
            e = (lambda s: lam ** (t * B + r - s)) if exponent == "printed" else (lambda s: lam ** (s - p))
            dv[p - 1] = k[p - 1] @ _intra_sum_token(p, t * B, e, q, do) + lam ** (B - r) * k[p - 1] @ dkv[t]
    return dv


def dv_eq19(q, k, v, do, lam, B, do_block: str = "printed"):
    """dV by eq. 19: dV_{t-1} = [(Q_{t-1} K_{t-1}^T) * M]^T dO_? + lambda^B Lambda^-1 K_{t-1} dKV_t.

    ``do_block="printed"``: dO_t, the next block's (dO_{T+1}, past the end, is zero). ``"corrected"``: dO_{t-1}.
    dKV_t comes from the printed recursion eq. 20, for which eq. 19's inter term is right.
    """
    do_block = validate_choice("do_block", do_block, ("printed", "corrected"))
    q, k, v, do, lam, B = _single_head(q, k, v, do, lam, B)
    dkv = eq20_dkv_recursion(q, do, lam, B)
    dkv = np.concatenate([dkv, np.zeros((1,) + dkv.shape[1:])])
    M, rows = _intra_blocks(q, lam, B)
    k_scale = lam ** (B - np.arange(1, B + 1))[:, None]
    dv = np.empty_like(v)
    for t in range(2, len(rows) + 2):
        x = rows[t - 2]
        d_o = _block(do, t if do_block == "printed" else t - 1, B)
        dv[x] = ((q[x] @ k[x].T) * M).T @ d_o + k_scale * (k[x] @ dkv[t])
    return dv


def algorithm2(q, k, v, do, lam, B, lambda_def: str = "algorithm", inverse: str = "literal", return_states: bool = False):
    """Algorithm 2 line by line, with Lambda and lambda^B Lambda^-1 built as the B x B matrices it names.

    ``lambda_def="algorithm"``: Lambda = diag(lambda, ..., lambda^B) (Algorithm 2's own line): right.
    ``lambda_def="eq9"``: Lambda = diag(1, ..., lambda^(B-1)) (eq. 9) in every place: the gradients are
    still right, because Lambda and lambda^B Lambda^-1 come in pairs and the running states KV, dKV absorb a
    factor lambda and 1/lambda; only the states themselves are off (``return_states=True`` shows them).
    ``inverse="literal"``: lambda^B * inv(Lambda), which holds lambda^-B: inf * 0 = NaN once lambda^B
    underflows (lambda = 0.05, B = 256). ``inverse="direct"``: diag(lambda^(B-r)), the package's way.
    Returns (dq, dk, dv), and with ``return_states`` also the final KV (KV_T, the forward's final state) and
    the final dKV (dL/dKV_0, the gradient of an initial state).
    """
    lambda_def = validate_choice("lambda_def", lambda_def, ("algorithm", "eq9"))
    inverse = validate_choice("inverse", inverse, ("literal", "direct"))
    q, k, v, do, lam, B = _single_head(q, k, v, do, lam, B)
    T = q.shape[0] // B
    power = np.arange(1, B + 1) if lambda_def == "algorithm" else np.arange(0, B)
    Lam = np.diag(lam ** power.astype(np.float64))
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        if inverse == "literal":
            k_factor = lam**B * np.diag(1.0 / np.diag(Lam))
        else:
            k_factor = np.diag(lam ** (B - power).astype(np.float64))
        M = decay_mask(B, lam)
        dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
        kv = np.zeros((q.shape[1], v.shape[1]))
        dkv = np.zeros_like(kv)
        for i in range(1, T + 1):
            Ki, Vi, dOi = _block(k, i, B), _block(v, i, B), _block(do, i, B)
            dq_intra = ((dOi @ Vi.T) * M) @ Ki
            dq_inter = Lam @ dOi @ kv.T
            kv = lam**B * kv + (k_factor @ Ki).T @ Vi
            dq[(i - 1) * B : i * B] = dq_intra + dq_inter
        for i in range(T, 0, -1):
            Qi, Ki, Vi, dOi = _block(q, i, B), _block(k, i, B), _block(v, i, B), _block(do, i, B)
            dk_intra = ((dOi @ Vi.T) * M).T @ Qi
            dk_inter = (k_factor @ Vi) @ dkv.T
            dv_intra = ((Qi @ Ki.T) * M).T @ dOi
            dv_inter = (k_factor @ Ki) @ dkv
            dkv = lam**B * dkv + (Lam @ Qi).T @ dOi
            dk[(i - 1) * B : i * B] = dk_intra + dk_inter
            dv[(i - 1) * B : i * B] = dv_intra + dv_inter
    return (dq, dk, dv, kv, dkv) if return_states else (dq, dk, dv)


# --------------------------------------------------------------------------------------------------
# The "Lightning Attention-3" design note (no decay: lambda = 1), as printed.
# --------------------------------------------------------------------------------------------------

def la3_forward(q, k, v, BLOCK: int, order: str = "printed"):
    """The note's chunked forward sketch, lambda = 1.

    ``order="printed"``: kv_state += K_c^T V_c; O_c = Q_c kv_state; O_c += tril(Q_c K_c^T) V_c -- the state
    already holds chunk c, so every pair inside the chunk is counted (the upper triangle too) and the lower
    triangle twice. ``order="corrected"``: O_c uses the state of the chunks before c, then the update.
    """
    order = validate_choice("order", order, ("printed", "corrected"))
    q, k, v, _, _, BLOCK = _single_head(q, k, v, v, 1.0, BLOCK)
    kv = np.zeros((q.shape[1], v.shape[1]))
    o = np.empty((q.shape[0], v.shape[1]))
    for c in range(q.shape[0] // BLOCK):
        x = slice(c * BLOCK, (c + 1) * BLOCK)
        if order == "printed":
            kv = kv + k[x].T @ v[x]
            o[x] = q[x] @ kv + np.tril(q[x] @ k[x].T) @ v[x]
        else:
            o[x] = q[x] @ kv + np.tril(q[x] @ k[x].T) @ v[x]
            kv = kv + k[x].T @ v[x]
    return o


def la3_backward(q, k, v, do, BLOCK: int, CBLOCK: int, dq: str = "printed", dkv_order: str = "printed"):
    """The note's backward, lambda = 1: micro-chunked intra part (Phase 1 dV, Phase 2 kernel) + inter part.

    ``dq="printed"``: the Phase 2 kernel never stores its dq_acc (``pass``), so dQ holds only the inter-chunk
    term dO_c kv_state[c-1]^T. ``dq="per_j"``: the kernel's dq_acc as it is accumulated (reset when i == j,
    summed over the query micro-chunks i of one key micro-chunk j) stored into micro-chunk j.
    ``dq="finished"``: dQ[c,i] = sum_{j<=i} dA_ij K_j (the note's i-outer Phase 2 pseudocode) plus the inter term.
    ``dkv_order="printed"``: dkv_state += Q_c^T dO_c *before* dK_c, dV_c read it (the chunk's own pairs are
    counted again, acausal ones included); ``"corrected"``: read first, then update. The printed
    ``dK[c] += dkv_state @ V[c].T`` has shape (d_k, BLOCK), the transpose of dK[c]: it is applied as
    V_c dkv_state^T here so that the ordering is the only slip measured.
    Returns (dq, dk, dv).
    """
    dq = validate_choice("dq", dq, ("printed", "per_j", "finished"))
    dkv_order = validate_choice("dkv_order", dkv_order, ("printed", "corrected"))
    q, k, v, do, _, BLOCK = _single_head(q, k, v, do, 1.0, BLOCK)
    CBLOCK = validate_block_size(CBLOCK, "CBLOCK")
    if BLOCK % CBLOCK:
        raise ValueError(f"CBLOCK must divide BLOCK: got BLOCK = {BLOCK}, CBLOCK = {CBLOCK}")
    n, nb = q.shape[0], BLOCK // CBLOCK
    dQ, dK, dV = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    tile = lambda x, c, i: x[c * BLOCK + i * CBLOCK : c * BLOCK + (i + 1) * CBLOCK]  # noqa: E731
    for c in range(n // BLOCK):
        for j in range(nb):  # Phase 1: dV
            acc = np.zeros((CBLOCK, v.shape[1]))
            for i in range(j, nb):
                a = tile(q, c, i) @ tile(k, c, j).T
                if i == j:
                    a = np.tril(a)
                acc += a.T @ tile(do, c, i)
            tile(dV, c, j)[:] = acc
        for j in range(nb):  # Phase 2 kernel: dK (and the dq_acc it never stores)
            dk_acc = np.zeros((CBLOCK, k.shape[1]))
            for i in range(j, nb):
                da = tile(do, c, i) @ tile(v, c, j).T
                if i == j:
                    da = np.tril(da)
                    dq_acc = np.zeros((CBLOCK, q.shape[1]))
                dk_acc += da.T @ tile(q, c, i)
                dq_acc += da @ tile(k, c, j)
            tile(dK, c, j)[:] = dk_acc
            if dq == "per_j":
                tile(dQ, c, j)[:] = dq_acc
        if dq == "finished":
            for i in range(nb):
                for j in range(i + 1):
                    da = tile(do, c, i) @ tile(v, c, j).T
                    tile(dQ, c, i)[:] += np.tril(da) @ tile(k, c, j) if i == j else da @ tile(k, c, j)
    kv_states = [np.zeros((q.shape[1], v.shape[1]))]  # "Forward saved: kv_state at each chunk boundary"
    for c in range(n // BLOCK):
        x = slice(c * BLOCK, (c + 1) * BLOCK)
        kv_states.append(kv_states[-1] + k[x].T @ v[x])
    dkv = np.zeros((q.shape[1], v.shape[1]))
    for c in reversed(range(n // BLOCK)):  # inter-chunk backward
        x = slice(c * BLOCK, (c + 1) * BLOCK)
        dQ[x] += do[x] @ kv_states[c].T  # kv_state[c-1]: the chunks before c
        if dkv_order == "printed":
            dkv = dkv + q[x].T @ do[x]
        dK[x] += v[x] @ dkv.T
        dV[x] += k[x] @ dkv
        if dkv_order != "printed":
            dkv = dkv + q[x].T @ do[x]
    return dQ, dK, dV


def la3_current_buffer_table(BLOCK: int = 64, d: int = 64, CBLOCK: int = 16, bytes_per: int = 4) -> dict:
    """The note's table of the current backward's buffers, recomputed: {buffer: (bytes printed, bytes true)}.

    The note prints 12 KB for q, k, v together (and for dq, dk, dv, 4 KB for do): those are the sizes of
    [CBLOCK, d] tiles, not of the [BLOCK, d] = [64, 64] fp32 tiles its own shape column names.
    """
    kb = 1024
    sq, row = BLOCK * BLOCK * bytes_per, BLOCK * d * bytes_per
    return {
        "qk_trans": (16 * kb, sq), "dqk": (16 * kb, sq), "index": (16 * kb, sq),
        "q, k, v": (12 * kb, 3 * row), "dq, dk, dv": (12 * kb, 3 * row), "do": (4 * kb, row),
        "total": (76 * kb, 3 * sq + 7 * row),
    }


def la3_micro_buffer_table(CBLOCK: int = 16, d: int = 64, bytes_per: int = 4, operand_bytes: int = 2) -> dict:
    """The note's table of the micro-chunk backward's buffers, recomputed: {buffer: (bytes printed, bytes true)}.
    (Chapter 09.)

    The note prints 30 KB at CBLOCK = 16, d = 64, fp32: seven [CBLOCK, d] tiles of 4 KB (q, k, v, do and the
    three gradient accumulators) and two [CBLOCK, CBLOCK] tiles of 1 KB (the scores and their gradient). That
    arithmetic is right. What it leaves out is the d x d state the inter-chunk part reads and updates (16 KB in
    fp32 at d = 64), and its copy as a dot operand in ``operand_bytes`` per element (8 KB in 16 bits): they
    appear with 0 printed bytes. "total" sums each column.
    """
    kb = 1024
    tile, square = CBLOCK * d * bytes_per, CBLOCK * CBLOCK * bytes_per
    table = {
        "q, k, v, do": (4 * 4 * kb, 4 * tile), "dq, dk, dv": (3 * 4 * kb, 3 * tile),
        "scores, score gradients": (2 * kb, 2 * square),
        "state (left out)": (0, d * d * bytes_per), "state as a dot operand (left out)": (0, d * d * operand_bytes),
    }
    table["total"] = (sum(p for p, _ in table.values()), sum(t for _, t in table.values()))
    return table


# --------------------------------------------------------------------------------------------------
# The explainer on feature maps and decoding: its memory table. (Chapter 10.)
# --------------------------------------------------------------------------------------------------

#: The explainer's "Memory Usage: Standard vs Lightning Attention (d=128, FP16)" table as printed, in bytes
#: (its MB, GB and TB are binary units: 32 MB = 4096^2 x 2 bytes). tokens -> (standard, FlashAttention, Lightning).
EXPLAINER_MEMORY_TABLE = {
    4096: (32 * 2**20, 2**19, 2 * 2**20),
    131072: (32 * 2**30, 16 * 2**20, 2 * 2**20),
    1 << 20: (2 * 2**40, 128 * 2**20, 2 * 2**20),
    4 << 20: (32 * 2**40, 512 * 2**20, 2 * 2**20),
}


def explainer_memory_table(d: int = 128, elem_bytes: int = 2) -> list[dict]:
    """The explainer's memory table beside what each quantity is, per head and layer, at head dim ``d``.

    Per row (tokens n): ``printed_*`` from :data:`EXPLAINER_MEMORY_TABLE`, and computed
    ``score_matrix`` n^2 fp16 values (what "standard attention" materialises in a forward pass),
    ``kv_cache`` 2 n d fp16 values (the keys and values a softmax decoder keeps, FlashAttention or not),
    ``flash_workspace`` n float32 values (the log-sum-exp FlashAttention keeps for its backward),
    ``state_fp16`` / ``state_fp32`` the d x d state, and ``printed_flash_over_cache``, the printed
    FlashAttention column as a fraction of the KV cache the text says it stands for.
    """
    rows = []
    for n, (standard, flash, lightning) in EXPLAINER_MEMORY_TABLE.items():
        cache = 2 * n * d * elem_bytes
        rows.append({
            "tokens": n, "printed_standard": standard, "printed_flash": flash, "printed_lightning": lightning,
            "score_matrix": n * n * elem_bytes, "kv_cache": cache, "flash_workspace": 4 * n,
            "state_fp16": d * d * 2, "state_fp32": d * d * 4, "printed_flash_over_cache": flash / cache,
        })
    return rows


# --------------------------------------------------------------------------------------------------
# The list, and the evidence.
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Erratum:
    """One slip: where, what is printed, what is right, and two functions returning the compared gradient.

    ``literal`` and ``corrected`` take (q, k, v, do, lam, B) of one head (see the module docstring) and return
    the array named ``compares`` ("dq", "dk", "dv", or "o" for the forward output); ``decay`` and
    ``block_size`` are the setting that shows the slip.
    """

    key: str
    source: str
    printed: str
    corrected_text: str
    compares: str
    literal: Callable
    corrected: Callable
    decay: float
    block_size: int
    note: str = ""


def _pick(fn, which, **kw):
    index = {"dq": 0, "dk": 1, "dv": 2}[which]
    return lambda q, k, v, do, lam, B: fn(q, k, v, do, lam, B, **kw)[index]


ERRATA: list[Erratum] = [
    Erratum(
        "eq19_dO_block", "LA-2, eq. 19 (intra term of dV)",
        r"\mathbf{dV}_{t-1} = [(\mathbf{Q}_{t-1}\mathbf{K}_{t-1}^\top)\odot\mathbf{M}]^\top \mathbf{dO}_{t} + \dots",
        r"\mathbf{dV}_{t-1} = [(\mathbf{Q}_{t-1}\mathbf{K}_{t-1}^\top)\odot\mathbf{M}]^\top \mathbf{dO}_{t-1} + \dots",
        "dv", lambda q, k, v, do, lam, B: dv_eq19(q, k, v, do, lam, B, "printed"),
        lambda q, k, v, do, lam, B: dv_eq19(q, k, v, do, lam, B, "corrected"), 0.9, 8,
        "The scores of block t-1 must meet the output gradients of the same block; Algorithm 2 has it right.",
    ),
    Erratum(
        "eq16_exponent", "LA-2, eq. 16 (in-block sum of dk)",
        r"\sum_{s=(t-1)B+r}^{tB} \lambda^{tB+r-s}\, \mathbf{do}_s^\top \mathbf{q}_s",
        r"\sum_{s=(t-1)B+r}^{tB} \lambda^{s-(t-1)B-r}\, \mathbf{do}_s^\top \mathbf{q}_s",
        "dk", lambda q, k, v, do, lam, B: dk_eq16(q, k, v, do, lam, B, "printed"),
        lambda q, k, v, do, lam, B: dk_eq16(q, k, v, do, lam, B, "corrected"), 0.9, 8,
        "The exponent is the forward's (eq. 14); it must be the distance s - p from the key forward to the query. "
        "Invisible at lambda = 1.",
    ),
    Erratum(
        "eq18_exponent", "LA-2, eq. 18 (in-block sum of dv)",
        r"\sum_{s=(t-1)B+r}^{tB} \lambda^{tB+r-s}\, \mathbf{q}_s^\top \mathbf{do}_s",
        r"\sum_{s=(t-1)B+r}^{tB} \lambda^{s-(t-1)B-r}\, \mathbf{q}_s^\top \mathbf{do}_s",
        "dv", lambda q, k, v, do, lam, B: dv_eq18(q, k, v, do, lam, B, "printed"),
        lambda q, k, v, do, lam, B: dv_eq18(q, k, v, do, lam, B, "corrected"), 0.9, 8,
        "Same slip as eq. 16. Invisible at lambda = 1.",
    ),
    Erratum(
        "eq20_block_index", "LA-2, eqs. 13 and 20 (the dKV recursion)",
        r"\mathbf{dKV}_t = \lambda^B \mathbf{dKV}_{t+1} + (\Lambda \mathbf{Q}_t)^\top \mathbf{dO}_t,\quad \mathbf{dKV}_{T+1} = 0",
        r"\mathbf{dKV}_t = \lambda^B \mathbf{dKV}_{t+1} + (\Lambda \mathbf{Q}_{t+1})^\top \mathbf{dO}_{t+1},\quad \mathbf{dKV}_{T} = 0",
        "dk", lambda q, k, v, do, lam, B: dk_eq16(q, k, v, do, lam, B, "corrected", state="eq20"),
        lambda q, k, v, do, lam, B: dk_eq16(q, k, v, do, lam, B, "corrected", state="eq13"), 0.9, 8,
        "The middle line of eq. 20 splits off s = tB+1..(t+1)B, block t+1, but the last line writes block t: the "
        "recursion's dKV_t is eq. 13's dKV_{t-1}. Eq. 16 (block t with dKV_t) needs eq. 13's; eqs. 17 and 19 "
        "(block t-1 with dKV_t) silently use the shifted one. Compared here: eq. 16 fed by the printed recursion.",
    ),
    Erratum(
        "eq17_pairing", "LA-2, eq. 17 read with eq. 13's dKV_t",
        r"\mathbf{dK}_{t-1} = \dots + \lambda^B\Lambda^{-1}\mathbf{V}_{t-1}\,\mathbf{dKV}_t^\top,\ \ \mathbf{dKV}_t = \sum_{s>tB}\dots",
        r"\mathbf{dK}_{t} = \dots + \lambda^B\Lambda^{-1}\mathbf{V}_{t}\,\mathbf{dKV}_t^\top",
        "dk", lambda q, k, v, do, lam, B: dk_eq17(q, k, v, do, lam, B, state="eq13"),
        lambda q, k, v, do, lam, B: dk_eq17(q, k, v, do, lam, B, state="eq20"), 0.9, 8,
        "The other face of the same index slip: with dKV_t as eq. 13 defines it, block t-1 misses block t.",
    ),
    Erratum(
        "eq14_range", "LA-2, eqs. 14-15 (range of r, hence Lambda)",
        r"t B + r,\ 0 \le r < B \ \Rightarrow\ \Lambda = \mathrm{diag}\{1, \dots, \lambda^{B-1}\}",
        r"t B + r,\ 1 \le r \le B \ \Rightarrow\ \Lambda = \mathrm{diag}\{\lambda, \dots, \lambda^{B}\}",
        "dq", lambda q, k, v, do, lam, B: dq_eq15(q, k, v, do, lam, B, "0..B-1"),
        lambda q, k, v, do, lam, B: dq_eq15(q, k, v, do, lam, B, "1..B"), 0.9, 8,
        "Eq. 7 (forward) has 1 <= r <= B; eq. 14 switches to 0 <= r < B, the indexing of eq. 9's Lambda.",
    ),
    Erratum(
        "alg2_inverse_overflow", "LA-2, Algorithm 2 (lambda^B Lambda^-1 formed literally)",
        r"\lambda^B \Lambda^{-1},\ \ \Lambda^{-1} = \mathrm{diag}\{\lambda^{-1}, \dots, \lambda^{-B}\}",
        r"\lambda^B \Lambda^{-1} = \mathrm{diag}\{\lambda^{B-1}, \dots, \lambda^{0}\}\ \text{formed directly}",
        "dk", _pick(algorithm2, "dk", inverse="literal"), _pick(algorithm2, "dk", inverse="direct"), 0.05, 256,
        "0.05^256 underflows to 0 and its inverse to inf: 0 * inf = NaN in dK and dV.",
    ),
    Erratum(
        "la3_forward_order", "LA-3 note, chunked forward sketch",
        r"\text{kv} \mathrel{+}= K_c^\top V_c;\ O_c = Q_c\,\text{kv} + \mathrm{tril}(Q_c K_c^\top) V_c",
        r"O_c = Q_c\,\text{kv} + \mathrm{tril}(Q_c K_c^\top) V_c;\ \text{kv} \mathrel{+}= K_c^\top V_c",
        "o", lambda q, k, v, do, lam, B: la3_forward(q, k, v, B, "printed"),
        lambda q, k, v, do, lam, B: la3_forward(q, k, v, B, "corrected"), 1.0, 8,
        "The note itself later writes O_inter[c] = Q[c] @ kv_state[c-1], which is right.",
    ),
    Erratum(
        "la3_dq_unfinished", "LA-3 note, backward kernel: dQ never stored",
        r"\text{dq\_acc} \mathrel{+}= dA_{ij} K_j;\ \texttt{pass}\ \Rightarrow\ dQ_c = dO_c\,\text{kv}_{c-1}^\top\ \text{only}",
        r"dQ_{c,i} = \textstyle\sum_{j \le i} \mathrm{tril}_{i=j}(dO_{c,i} V_{c,j}^\top) K_{c,j} + dO_{c,i}\,\text{kv}_{c-1}^\top",
        "dq", lambda q, k, v, do, lam, B: la3_backward(q, k, v, do, B, 4, dq="printed", dkv_order="corrected")[0],
        lambda q, k, v, do, lam, B: la3_backward(q, k, v, do, B, 4, dq="finished", dkv_order="corrected")[0], 1.0, 8,
        "The intra-chunk term of dQ is the one missing (the inter-chunk section does add dO kv^T).",
    ),
    Erratum(
        "la3_dq_per_j", "LA-3 note, backward kernel: dq_acc stored as accumulated",
        r"\text{dq\_acc}_j = \textstyle\sum_{i \ge j} dA_{ij} K_j \to dQ_{c,j}",
        r"dQ_{c,i} = \textstyle\sum_{j \le i} dA_{ij} K_j",
        "dq", lambda q, k, v, do, lam, B: la3_backward(q, k, v, do, B, 4, dq="per_j", dkv_order="corrected")[0],
        lambda q, k, v, do, lam, B: la3_backward(q, k, v, do, B, 4, dq="finished", dkv_order="corrected")[0], 1.0, 8,
        "In the j-outer loop one dq_acc collects the terms of different queries i: dQ needs its own loop order.",
    ),
    Erratum(
        "la3_dkv_order", "LA-3 note, inter-chunk backward: dkv_state updated before use",
        r"\text{dkv} \mathrel{+}= Q_c^\top dO_c;\ dK_c \mathrel{+}= V_c\,\text{dkv}^\top;\ dV_c \mathrel{+}= K_c\,\text{dkv}",
        r"dK_c \mathrel{+}= V_c\,\text{dkv}^\top;\ dV_c \mathrel{+}= K_c\,\text{dkv};\ \text{dkv} \mathrel{+}= Q_c^\top dO_c",
        "dk", lambda q, k, v, do, lam, B: la3_backward(q, k, v, do, B, 4, dq="finished", dkv_order="printed")[1],
        lambda q, k, v, do, lam, B: la3_backward(q, k, v, do, B, 4, dq="finished", dkv_order="corrected")[1], 1.0, 8,
        "The forward sketch's ordering slip again, now in the reverse sweep (dV is off the same way).",
    ),
]


def evidence(erratum: Erratum, n: int | None = None, d_k: int = 5, d_v: int = 3, seed: int = 0) -> dict:
    """Relative errors of the literal and the corrected form against float64 autograd, on one random head.

    Returns {"literal": err, "corrected": err, "nonfinite": number of NaN/inf entries in the literal result}.
    NaN or inf anywhere makes the literal error inf.
    """
    B = erratum.block_size
    n = n or 4 * B
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, n, d_k))
    v, do = rng.standard_normal((2, n, d_v))
    if erratum.compares == "o":
        truth = causal_linear_recurrent(q[None, None], k[None, None], v[None, None], erratum.decay)[0, 0]
    else:
        grads = autograd_gradients(q[None, None], k[None, None], v[None, None], do[None, None], erratum.decay)
        truth = grads[{"dq": 0, "dk": 1, "dv": 2}[erratum.compares]][0, 0]
    out = {}
    for name, fn in (("literal", erratum.literal), ("corrected", erratum.corrected)):
        with np.errstate(all="ignore"):
            got = fn(q, k, v, do, erratum.decay, B)
        bad = int(np.sum(~np.isfinite(got)))
        out[name] = float("inf") if bad else relative_error(got, truth)
        if name == "literal":
            out["nonfinite"] = bad
    return out



# --------------------------------------------------------------------------------------------------
# The explainer on feature maps and decoding: its chunked hybrid module, its decoding loop, a citation.
# (Chapter 11.) Conventions as the explainer's: one head, q, k (n, d), v (n, d_v), no decay.
# --------------------------------------------------------------------------------------------------

def explainer_feature_weights(d_head: int, d_feature: int | None = None, seed: int = 0) -> np.ndarray:
    """W of the explainer's learned map as it initialises it: N(0, 1) entries times 0.1, shape (d_head, d')."""
    from .validation import validate_positive_int

    d_head = validate_positive_int("d_head", d_head)
    d_feature = d_head if d_feature is None else validate_positive_int("d_feature", d_feature)
    return 0.1 * np.random.default_rng(seed).standard_normal((d_head, d_feature))


def explainer_feature_map(W):
    """The explainer's learned map, literally: phi(x) = ReLU(x W)^2 + 1e-6 (a floor on every feature), numpy."""
    W = np.array(W, dtype=np.float64)

    def phi(x):
        return np.maximum(np.asarray(x, dtype=np.float64) @ W, 0.0) ** 2 + 1e-6

    return phi


def _explainer_map(feature_map, d):
    from .feature_maps import resolve_feature_map

    if feature_map is None:
        return explainer_feature_map(explainer_feature_weights(d))
    return resolve_feature_map(feature_map, "numpy")


def explainer_hybrid_separate(q, k, v, chunk_size: int = 256, feature_map=None) -> np.ndarray:
    """The explainer's chunked hybrid module, its forward transcribed: two parts, each normalised on its own.

    Zero-pad n to a multiple of C = ``chunk_size``; per chunk, the intra part is the causal softmax of
    Q_c K_c^T / sqrt(d) times V_c; the inter part reads the state of the earlier chunks,
    phi(Q_c) S / clamp(phi(Q_c) z, min=1e-6); then S += phi(K_c)^T V_c, z += sum phi(K_c). The output is
    intra + inter, cut back to n rows. Each part's weights sum to 1, so from the second chunk on every row's
    weights sum to 2 (:func:`explainer_hybrid_evidence`); the joint form is
    :func:`lightning_edu.hybrid_attention`. ``feature_map``: None for the explainer's own map
    (:func:`explainer_feature_map` with :func:`explainer_feature_weights`), or a name or numpy callable.
    One head: q, k (n, d), v (n, d_v). Returns (n, d_v) in float64.
    """
    from .validation import validate_single_head

    q, k, v = validate_single_head(q, k, v)
    C = validate_block_size(chunk_size, "chunk_size")
    phi = _explainer_map(feature_map, q.shape[1])
    n, D = q.shape[0], q.shape[1]
    pad = (C - n % C) % C
    Q, K, V = (np.concatenate([x, np.zeros((pad, x.shape[1]))]) for x in (q, k, v))
    num_chunks = Q.shape[0] // C
    Qc, Kc, Vc = (x.reshape(num_chunks, C, x.shape[1]) for x in (Q, K, V))
    scores = Qc @ Kc.swapaxes(-1, -2) * (1.0 / D**0.5)
    scores = np.where(np.triu(np.ones((C, C), dtype=bool), 1), -np.inf, scores)  # causal mask within the chunk
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    intra = (weights / weights.sum(axis=-1, keepdims=True)) @ Vc
    phi_K, phi_Q = phi(Kc), phi(Qc)
    S = np.zeros((phi_K.shape[-1], V.shape[1]))
    z = np.zeros(phi_K.shape[-1])
    inter = []
    for c in range(num_chunks):
        inter_norm = np.maximum(phi_Q[c] @ z, 1e-6)  # inter_norm.clamp(min=1e-6)
        inter.append((phi_Q[c] @ S) / inter_norm[:, None])
        S = S + phi_K[c].T @ Vc[c]
        z = z + phi_K[c].sum(axis=0)
    return (intra + np.stack(inter)).reshape(-1, V.shape[1])[:n]


def explainer_hybrid_evidence(n: int = 75, d: int = 8, chunk_size: int = 16, seed: int = 0, feature_map=None) -> dict:
    """The separate normalisers measured: row sums of the explainer's module, and its distance to the joint form.

    The weights are read off the module itself: run on v = I_n, its output is the (n, n) matrix W with
    o = W v. Returns first_chunk_row_sums and later_row_sums ((min, max) over those rows; 1 and 2 are the
    separate normalisers' values), weights_match (max |W - attention_weights(..., "hybrid_separate")|, the
    package's twin), joint_row_sums ((min, max) for attention_weights(..., "hybrid")), and rel_error_vs_joint:
    the relative error of the module's output against :func:`lightning_edu.hybrid_attention` (numpy,
    lambda = 1, same map and chunk) on random v.
    """
    from .api import hybrid_attention
    from .checks import relative_error
    from .feature_maps import attention_weights

    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((3, n, d))
    phi = _explainer_map(feature_map, d)
    W = explainer_hybrid_separate(q, k, np.eye(n), chunk_size, phi)
    sums = W.sum(axis=1)
    first = sums[: min(chunk_size, n)]
    later = sums[chunk_size:]
    twin = attention_weights(q, k, "hybrid_separate", feature_map=phi, block_size=chunk_size)
    joint = attention_weights(q, k, "hybrid", feature_map=phi, block_size=chunk_size).sum(axis=1)
    literal = explainer_hybrid_separate(q, k, v, chunk_size, phi)
    reference = hybrid_attention(q[None, None], k[None, None], v[None, None], block_size=chunk_size,
                                 feature_map=phi, backend="numpy")[0, 0]
    return {
        "first_chunk_row_sums": (float(first.min()), float(first.max())),
        "later_row_sums": (float(later.min()), float(later.max())) if later.size else None,
        "weights_match": float(np.abs(W - twin).max()),
        "joint_row_sums": (float(joint.min()), float(joint.max())),
        "rel_error_vs_joint": relative_error(literal, reference),
    }


def explainer_decode(q, k, v, feature_map=None, order: str = "printed") -> np.ndarray:
    """The explainer's decoding loop, one token at a time from S = 0, z = 0. One head: q, k (n, d), v (n, d_v).

    ``order="printed"``: the query reads the state, then the token updates it:
    o = phi(q) S / (phi(q) . z + 1e-6); S += phi(k)^T v; z += phi(k). So token t never sees itself and the
    first output is 0. ``order="corrected"``: update first, then read, the order of the explainer's own
    formula O_i (whose sums include j = i), of its chunked module (whose causal mask keeps the diagonal) and
    of :func:`lightning_edu.normalized_attention_step`.
    """
    from .validation import validate_single_head

    order = validate_choice("order", order, ("printed", "corrected"))
    q, k, v = validate_single_head(q, k, v)
    phi = _explainer_map(feature_map, q.shape[1])
    S = np.zeros((phi(k[:1]).shape[-1], v.shape[1]))
    z = np.zeros(S.shape[0])
    out = np.empty_like(v)
    for t in range(q.shape[0]):
        phi_k_new, phi_q_new = phi(k[t]), phi(q[t])
        if order == "corrected":
            S = S + np.outer(phi_k_new, v[t])
            z = z + phi_k_new
        out[t] = (phi_q_new @ S) / (phi_q_new @ z + 1e-6)
        if order == "printed":
            S = S + np.outer(phi_k_new, v[t])
            z = z + phi_k_new
    return out


def explainer_decode_evidence(n: int = 32, d: int = 8, seed: int = 0, feature_map=None) -> dict:
    """The decoding loop against the prefill it should continue: :func:`lightning_edu.normalized_attention`
    (numpy, eps = 1e-6, the same map) over the same tokens. Returns the relative errors of the printed and
    the corrected order, and first_output_printed / first_output_true: the norms of o_1 (0 printed; v_1 true).
    """
    from .api import normalized_attention
    from .checks import relative_error

    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((3, n, d))
    phi = _explainer_map(feature_map, d)
    prefill = normalized_attention(q[None, None], k[None, None], v[None, None], feature_map=phi, eps=1e-6)[0, 0]
    printed = explainer_decode(q, k, v, phi, "printed")
    return {
        "printed": relative_error(printed, prefill),
        "corrected": relative_error(explainer_decode(q, k, v, phi, "corrected"), prefill),
        "first_output_printed": float(np.linalg.norm(printed[0])),
        "first_output_true": float(np.linalg.norm(prefill[0])),
    }


@dataclass(frozen=True)
class Citation:
    """A reference as printed beside the reference it should be, and a check of what it is cited for."""

    key: str
    where: str
    printed: str
    correct: str
    note: str
    check: Callable


def check_elu_plus_one() -> dict:
    """That :func:`lightning_edu.numpy_reference.elu_plus_one` is the map of Katharopoulos et al. (2020),
    phi(x) = elu(x) + 1 (x + 1 for x > 0, e^x otherwise), and positive.

    Returns max_abs_diff_vs_torch (against torch.nn.functional.elu(x) + 1 in float64 on a grid over [-30, 30]
    and a few special points), max_abs_diff_vs_formula, min_on_grid (> 0), and underflow: the values at
    x = -745 and -746, where float64's e^x stops being positive (so "phi > 0" holds in floating point only
    for x > -745.2).
    """
    import torch

    from .numpy_reference import elu_plus_one

    x = np.concatenate([np.linspace(-30.0, 30.0, 6001), [-1e-300, 0.0, 1e-300, -700.0]])
    mine = elu_plus_one(x)
    ref = (torch.nn.functional.elu(torch.from_numpy(x)) + 1.0).numpy()
    formula = np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))
    return {
        "max_abs_diff_vs_torch": float(np.abs(mine - ref).max()),
        "max_abs_diff_vs_formula": float(np.abs(mine - formula).max()),
        "min_on_grid": float(mine.min()),
        "underflow": (float(elu_plus_one(np.array(-745.0))), float(elu_plus_one(np.array(-746.0)))),
    }


#: The explainer's citation of the elu + 1 map.
KATFORMER = Citation(
    "katformer", "the explainer on feature maps and decoding, \"Inference: No KV Cache\", section \"Feature Map Choice\"",
    "Katformer, 2020",
    "A. Katharopoulos, A. Vyas, N. Pappas, F. Fleuret, \"Transformers are RNNs: Fast Autoregressive Transformers "
    "with Linear Attention\", ICML 2020, arXiv:2006.16236",
    "No model or paper is called Katformer; the elu(x) + 1 map, the normaliser phi(q) . z and the recurrent view "
    "with S and z are Katharopoulos et al.'s. lightning_edu.numpy_reference.elu_plus_one is that map "
    "(check_elu_plus_one).",
    check_elu_plus_one,
)


@dataclass(frozen=True)
class ExplainerErratum:
    """A slip of the explainer on feature maps and decoding: where, what is printed, what is right, and a
    function (no arguments) returning the measured evidence as a dict."""

    key: str
    where: str
    printed: str
    corrected_text: str
    evidence: Callable
    note: str = ""


EXPLAINER_ERRATA: list[ExplainerErratum] = [
    ExplainerErratum(
        "hybrid_separate_normalisers", "explainer, ChunkedLightningAttention.forward",
        r"o_t = \mathrm{softmax}_{\text{chunk}}(\cdot)\,V + \frac{\phi(q_t) S}{\max(\phi(q_t)\cdot z,\ 10^{-6})}",
        r"o_t = \frac{\sum_{s\in\text{chunk},\,s\le t} e^{s_{ts}} v_s + \phi(q_t) S}"
        r"{\sum_{s\in\text{chunk},\,s\le t} e^{s_{ts}} + \phi(q_t)\cdot z}",
        explainer_hybrid_evidence,
        "Two normalised averages added: rows past the first chunk weigh the values twice (row sums exactly 2), so "
        "the output's scale doubles at the first chunk boundary. One joint normaliser: lightning_edu.hybrid_attention.",
    ),
    ExplainerErratum(
        "decode_query_before_update", "explainer, \"Inference: No KV Cache\" decoding snippet",
        r"o_t = \frac{\phi(q_t) S_{t-1}}{\phi(q_t)\cdot z_{t-1} + 10^{-6}};\ S_t = S_{t-1} + \phi(k_t)^\top v_t",
        r"S_t = S_{t-1} + \phi(k_t)^\top v_t;\ o_t = \frac{\phi(q_t) S_t}{\phi(q_t)\cdot z_t + 10^{-6}}",
        explainer_decode_evidence,
        "Querying before the update leaves the token out of its own output (the first output is 0), unlike the "
        "explainer's formula and its chunked module: decoding does not continue the prefill.",
    ),
    ExplainerErratum(
        "katformer_citation", "explainer, \"Feature Map Choice\"", KATFORMER.printed, KATFORMER.correct,
        check_elu_plus_one, KATFORMER.note,
    ),
]

__all__ += [
    "explainer_feature_weights", "explainer_feature_map", "explainer_hybrid_separate", "explainer_hybrid_evidence",
    "explainer_decode", "explainer_decode_evidence", "Citation", "check_elu_plus_one", "KATFORMER",
    "ExplainerErratum", "EXPLAINER_ERRATA",
]
