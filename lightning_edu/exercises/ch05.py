"""Checks for the exercises of chapter 05 (the backward recurrences, Algorithm 2).

Each check runs the reader's piece inside a reverse sweep over blocks, compares the gradients with the
package's :func:`~lightning_edu.numpy_blockwise.blockwise_backward` and names the first wrong block. When the
answer matches a known slip (the paper's own among them), the message says which.
"""

from __future__ import annotations

import numpy as np

from ..measure import peak_memory_numpy, peak_memory_torch
from ..numpy_blockwise import block_factors, block_slices, blockwise_backward
from ._core import (ExerciseError, exercise, expect_array, expect_close, expect_shape, is_shape_error, lines_by_size,
                    passed, precision_hint, refuse_low_precision)

__all__ = ["check_dkv_update", "check_dk_inter", "check_reverse_sweep"]

# (batch, heads, n, d_k, d_v, block_size, decay per head): odd lengths, partial last blocks, d_k != d_v
CASES = [
    (1, 2, 37, 5, 3, 8, [0.9, 0.5]),
    (2, 1, 64, 4, 6, 16, [0.97]),
    (1, 3, 23, 3, 2, 5, [1.0, 0.8, 0.05]),
    # 300-row blocks at lambda = 0.05: lambda^-300 overflows float64, so the paper's lambda^B Lambda^-1 built
    # literally (or any negative power) fails here instead of passing on short blocks
    (1, 2, 700, 3, 2, 300, [0.05, 0.9]),
]


def _inputs(case, seed):
    b, h, n, d_k, d_v, block, decay = case
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, b, h, n, d_k))
    v, do = rng.standard_normal((2, b, h, n, d_v))
    return q, k, v, do, np.array(decay, dtype=np.float64), block


def _call(name, fn, *args, shape_hint: str = ""):
    try:
        return fn(*args)
    except ExerciseError:
        raise
    except Exception as exc:  # the reader's code failed: say so with the shapes it was given
        shapes = ", ".join(str(getattr(a, "shape", a)) for a in args)
        hint = f". Hint: {shape_hint}" if shape_hint and is_shape_error(exc) else ""
        raise ExerciseError(f"{name} raised {type(exc).__name__}: {exc} (arguments of shapes {shapes}){hint}") from exc


# What a shape error in each piece means: the transposes, and the axes they swap (x.T reverses all four axes of a
# (batch, heads, rows, d) array, which is why .swapaxes(-1, -2) is asked for).
_UPDATE_SHAPES = ("a transpose is missing or on the wrong axes: (diag(lambda^(r+1)) Q_i)^T dO_i multiplies a (d_k, b) "
                  "matrix by a (b, d_v) one, per batch and head, giving dKV's (d_k, d_v). Swap the last two axes of "
                  "the scaled q block with .swapaxes(-1, -2) (.T reverses all four axes of a (batch, heads, b, d_k) "
                  "array)")
_INTER_SHAPES = ("a transpose is missing or on the wrong axes: V_i dKV^T multiplies the (b, d_v) values by the (d_v, "
                 "d_k) transpose of dKV, per batch and head, giving (b, d_k). Transpose dkv on its last two axes, "
                 "dkv.swapaxes(-1, -2) (.T reverses all four axes of a (batch, heads, d_k, d_v) array)")


def _sweep(q, k, v, do, decay, block, update=None, inter=None, read_after_update=False, dv_next_do=False,
           forward=False):
    """The reverse sweep of Algorithm 2 with pluggable pieces: (dk, dv, dKV before the first block).

    ``forward=True`` walks the blocks in the wrong direction, first to last (a mistake, for diagnosis)."""
    dk, dv = np.empty_like(k), np.empty_like(v)
    dkv = np.zeros(q.shape[:2] + (q.shape[-1], v.shape[-1]))
    blocks = block_slices(q.shape[2], block)
    for index in (range(len(blocks)) if forward else reversed(range(len(blocks)))):
        rows = blocks[index]
        qi, ki, vi, doi = q[:, :, rows], k[:, :, rows], v[:, :, rows], do[:, :, rows]
        mask, q_scale, k_scale, block_decay = block_factors(qi.shape[2], decay)
        new_dkv = block_decay * dkv + (q_scale * qi).swapaxes(-1, -2) @ doi if update is None else update(dkv, qi, doi, decay)
        state = new_dkv if read_after_update else dkv
        dk_inter = k_scale * (vi @ state.swapaxes(-1, -2)) if inter is None else inter(vi, state, decay)
        dk[:, :, rows] = ((doi @ vi.swapaxes(-1, -2)) * mask).swapaxes(-1, -2) @ qi + dk_inter
        do_pair = doi
        if dv_next_do:  # eq. 19 as printed: the next block's dO (zeros past the end, cut to this block's rows)
            nxt = do[:, :, blocks[index + 1]] if index + 1 < len(blocks) else np.zeros_like(doi)
            do_pair = np.zeros_like(doi)
            do_pair[:, :, : nxt.shape[2]] = nxt[:, :, : doi.shape[2]]
        dv[:, :, rows] = ((qi @ ki.swapaxes(-1, -2)) * mask).swapaxes(-1, -2) @ do_pair + k_scale * (ki @ state)
        dkv = new_dkv
    return dk, dv, dkv


def _matches(got, ref):
    return got.shape == ref.shape and bool(np.allclose(got, ref, rtol=1e-9, atol=1e-12))


def _sweep_update(dkv, qi, doi, decay):
    """The right dKV update of 5.1, for one block."""
    _, q_scale, _, block_decay = block_factors(qi.shape[2], decay)
    return block_decay * dkv + (q_scale * qi).swapaxes(-1, -2) @ doi


# ---------------------------------------------------------------------------------------------- 5.1


def _update_variants(dkv, qi, doi, decay):
    b = qi.shape[2]
    lam = decay[None, :, None, None]
    r = np.arange(b, dtype=np.float64)[None, None, :, None]
    qt = lambda scale: (scale * qi).swapaxes(-1, -2) @ doi  # noqa: E731
    return {
        "Your powers on q start at lambda^0 (eq. 9's Lambda). The block's first row is one step after the state "
        "it feeds, so it carries lambda^1: Lambda = diag(lambda, ..., lambda^b)": lam**b * dkv + qt(lam**r),
        "You scaled q with lambda^(b-1-r), the factor that k gets in the forward state update. q_s meets the state "
        "s - (start of block) steps later: lambda^(r+1) for row r": lam**b * dkv + qt(lam ** (b - 1 - r)),
        "The old dKV is not decayed: it must be multiplied by lambda^b, one lambda per row of this block": dkv + qt(lam ** (r + 1)),
        "You decayed after adding: only the old dKV carries lambda^b, the new rows carry their own lambda^(r+1)": lam**b * (dkv + qt(lam ** (r + 1))),
        "You decayed the old dKV by lambda, not lambda^b: it is b steps further back": lam * dkv + qt(lam ** (r + 1)),
    }


@exercise("5.1", reveals=("algorithm2", "blockwise_backward"), allowed=("lightning_edu.numpy_blockwise.block_factors",))
def check_dkv_update(dkv_update, seed: int = 0) -> None:
    """``dkv_update(dkv, q_block, do_block, decay)`` -> dKV before the block, given dKV after it.

    dkv (batch, heads, d_k, d_v); q_block (batch, heads, b, d_k); do_block (batch, heads, b, d_v);
    decay (heads,). Expected: lambda^b dKV + (diag(lambda^1 .. lambda^b) Q_i)^T dO_i.
    """
    for index, case in enumerate(CASES):
        q, k, v, do, decay, block = _inputs(case, 500 + index + seed)
        _, ref_dk, ref_dv, ref_state = blockwise_backward(q, k, v, do, decay, block)
        # one block first, for a precise diagnosis
        rows = block_slices(q.shape[2], block)[0]
        dkv0 = np.random.default_rng(index + seed).standard_normal(ref_state.shape)
        one = _call("dkv_update", dkv_update, dkv0.copy(), q[:, :, rows].copy(), do[:, :, rows].copy(), decay.copy(),
                    shape_hint=_UPDATE_SHAPES)
        refuse_low_precision("dkv_update(...)", one)
        one = expect_shape("dkv_update(...)", one, dkv0.shape)
        hint = "dKV_before = lambda^b dKV_after + (diag(lambda^(r+1)) Q_i)^T dO_i, r = 0..b-1"
        for text, wrong in _update_variants(dkv0, q[:, :, rows], do[:, :, rows], decay).items():
            if _matches(one, wrong):
                hint = text
                break
        # then the whole sweep, to say where the gradients go wrong
        dk, dv, state = _sweep(q, k, v, do, decay, block, update=lambda *a: expect_array(
            "dkv_update(...)", _call("dkv_update", dkv_update, *a, shape_hint=_UPDATE_SHAPES)))
        if hint.startswith("dKV_before"):
            hint = precision_hint(one, _sweep_update(dkv0, q[:, :, rows], do[:, :, rows], decay)) or hint
        expect_close(f"dk (n = {q.shape[2]}, block size {block}, decay {decay.tolist()})", dk, ref_dk, block_size=block, hint=hint)
        expect_close(f"dv (n = {q.shape[2]}, block size {block}, decay {decay.tolist()})", dv, ref_dv, block_size=block, hint=hint)
        expect_close("dKV before the first block (the gradient of the initial state)", state, ref_state, axis=-2, hint=hint)
    passed(f"dKV update right: the reverse sweep built on it gives dk, dv and d initial_state on {len(CASES)} shapes")


# ---------------------------------------------------------------------------------------------- 5.2


@exercise("5.2", reveals=("algorithm2", "blockwise_backward"))
def check_dk_inter(dk_inter, seed: int = 0) -> None:
    """``dk_inter(v_block, dkv, decay)`` -> the inter-block term of dK for one block, (batch, heads, b, d_k).

    v_block (batch, heads, b, d_v); dkv (batch, heads, d_k, d_v), the state of the blocks after this one;
    decay (heads,). Expected: diag(lambda^(b-1-r)) V_i dKV^T (the paper's lambda^B Lambda^-1 V_i dKV^T).
    """
    for index, case in enumerate(CASES):
        q, k, v, do, decay, block = _inputs(case, 700 + index + seed)
        ref_dk = blockwise_backward(q, k, v, do, decay, block)[1]
        lam = decay[None, :, None, None]
        hints = {
            "You used lambda^(r+1), the query's factor (Lambda). Key row r of the block sits b-1-r steps before the "
            "block's end, where dKV takes over: lambda^(b-1-r) (the paper's lambda^B Lambda^-1)": lambda vi, s, d: (lam ** (np.arange(vi.shape[2])[None, None, :, None] + 1)) * (vi @ s.swapaxes(-1, -2)),
            "Off by one: the last row of the block is 0 steps from its end, so its factor is lambda^0 = 1: use "
            "lambda^(b-1-r) for 0-based r": lambda vi, s, d: (lam ** (vi.shape[2] - np.arange(vi.shape[2])[None, None, :, None])) * (vi @ s.swapaxes(-1, -2)),
            "No decay on the inter term: key row r is b-1-r steps from the block's end, scale it by lambda^(b-1-r)": lambda vi, s, d: vi @ s.swapaxes(-1, -2),
        }
        hint = "dK_inter = diag(lambda^(b-1-r)) V_i dKV^T, r = 0..b-1, with dKV the state of the blocks after this one"
        rows = block_slices(q.shape[2], block)[0]
        probe_state = np.random.default_rng(index + seed).standard_normal(q.shape[:2] + (q.shape[-1], v.shape[-1]))
        vi = v[:, :, rows]
        one = _call("dk_inter", dk_inter, vi.copy(), probe_state.copy(), decay.copy(), shape_hint=_INTER_SHAPES)
        refuse_low_precision("dk_inter(...)", one)
        one = expect_shape("dk_inter(...)", one, vi.shape[:3] + (q.shape[-1],))
        for text, wrong in hints.items():
            if np.any(decay != 1.0) and _matches(one, wrong(vi, probe_state, decay)):
                hint = text
                break
        if hint.startswith("dK_inter ="):
            right = block_factors(vi.shape[2], decay)[2] * (vi @ probe_state.swapaxes(-1, -2))
            hint = precision_hint(one, right) or hint
        dk = _sweep(q, k, v, do, decay, block, inter=lambda vi, s, d: expect_array(
            "dk_inter(...)", _call("dk_inter", dk_inter, vi, s, d, shape_hint=_INTER_SHAPES)))[0]
        expect_close(f"dk (n = {q.shape[2]}, block size {block}, decay {decay.tolist()})", dk, ref_dk, block_size=block, hint=hint)
    passed(f"inter term of dK right: full dK matches Algorithm 2 on {len(CASES)} shapes")


# ---------------------------------------------------------------------------------------------- 5.3

_DENSE_N = 1024  # tokens of the memory probe of 5.3: n x n float64 is 8 MiB, a sweep's blocks a few KiB


def _sweep_mistakes(q, k, v, do, decay, block, dk, dv, ref_dk, ref_dv):
    """The hints of the slips a wrong sweep matches, in the order they are tried (each with the gradients it
    explains)."""
    n = q.shape[2]
    early_dk, _, _ = _sweep(q, k, v, do, decay, block, read_after_update=True)
    if _matches(dk, early_dk):
        yield ("did you use the reverse-sweep state dKV of the blocks after this one? You added this block's own "
               "Q_i^T dO_i before reading dKV, so pairs inside the block are counted twice (and acausal ones too): "
               "compute dK_i and dV_i first, then update dKV")
    next_dv = _sweep(q, k, v, do, decay, block, dv_next_do=True)[1]
    full = slice(0, (len(block_slices(n, block)) - 2) * block)  # blocks whose next block is full too
    if full.stop > 0 and _matches(dv[:, :, full], next_dv[:, :, full]):
        yield ("the intra term of dV pairs block i's scores [(Q_i K_i^T) * M]^T with dO_i of the same block; you used "
               "the next block's dO, as the paper's eq. 19 prints it")
    forward_dk, forward_dv, _ = _sweep(q, k, v, do, decay, block, forward=True)
    if _matches(dk, forward_dk) and _matches(dv, forward_dv):
        yield ("the sweep walks the blocks from the first to the last: dKV must hold the blocks AFTER the current one "
               "(they are what its keys and values influence), so the reverse sweep starts at the last block: "
               "for start in reversed(range(0, n, block_size))")
    whole = n - n % block
    if n % block and whole:
        part = slice(0, whole)
        prefix_dk, prefix_dv, _ = _sweep(q[:, :, part], k[:, :, part], v[:, :, part], do[:, :, part], decay, block)
        if _matches(dk[:, :, part], prefix_dk) and _matches(dv[:, :, part], prefix_dv):
            yield (f"the short last block (rows {whole}-{n - 1}, {n % block} of them) is left out: your rows before it are "
                   "those of a sequence that ends at row {whole}. range(0, n, block_size) gives every block's start, the "
                   "short one included (n // block_size counts only the full ones); slice each block to "
                   "min(start + block_size, n)".replace("{whole}", str(whole)))



@exercise("5.3", reveals=("algorithm2", "blockwise_backward"),
          allowed=("lightning_edu.numpy_blockwise.block_factors", "lightning_edu.numpy_blockwise.block_slices"))
def check_reverse_sweep(reverse_sweep, seed: int = 0) -> None:
    """``reverse_sweep(q, k, v, do, decay, block_size)`` -> (dk, dv), Algorithm 2's second loop.

    q, k (batch, heads, n, d_k); v, do (batch, heads, n, d_v); decay (heads,). The last block may be short.
    """
    for index, case in enumerate(CASES):
        q, k, v, do, decay, block = _inputs(case, 900 + index + seed)
        ref_dk, ref_dv = blockwise_backward(q, k, v, do, decay, block)[1:3]
        got = _call("reverse_sweep", reverse_sweep, q.copy(), k.copy(), v.copy(), do.copy(), decay.copy(), block)
        if not isinstance(got, tuple) or len(got) != 2:
            raise ExerciseError(f"reverse_sweep must return the pair (dk, dv), got {type(got).__name__}")
        for name, value in (("dk", got[0]), ("dv", got[1])):
            refuse_low_precision(name, value)
        dk = expect_shape("dk", got[0], ref_dk.shape)
        dv = expect_shape("dv", got[1], ref_dv.shape)
        if _matches(dk, ref_dk) and _matches(dv, ref_dv):
            continue
        where = f"(n = {q.shape[2]}, block size {block}, decay {decay.tolist()})"
        for hint in _sweep_mistakes(q, k, v, do, decay, block, dk, dv, ref_dk, ref_dv):
            expect_close(f"dk {where}", dk, ref_dk, block_size=block, hint=hint)
            expect_close(f"dv {where}", dv, ref_dv, block_size=block, hint=hint)
        hint = (
            "per block, newest first: dK_i = [(dO_i V_i^T) * M]^T Q_i + diag(lambda^(b-1-r)) V_i dKV^T, "
            "dV_i = [(Q_i K_i^T) * M]^T dO_i + diag(lambda^(b-1-r)) K_i dKV, then dKV = lambda^b dKV + (diag(lambda^(r+1)) Q_i)^T dO_i"
        )
        expect_close(f"dk {where}", dk, ref_dk, block_size=block, hint=precision_hint(dk, ref_dk) or hint)
        expect_close(f"dv {where}", dv, ref_dv, block_size=block, hint=precision_hint(dv, ref_dv) or hint)
    # The values are right; now the algorithm. A sweep over the blocks runs its loop body once per block, so its
    # lines of Python grow with the block count; a dense (n x n) formula or autograd runs the same lines at any n.
    def run(blocks):
        q, k, v, do, decay, block = _inputs((1, 1, 8 * blocks, 2, 2, 8, [0.9]), 950 + blocks + seed)
        return _call("reverse_sweep", reverse_sweep, q, k, v, do, decay, block)

    lines = lines_by_size(run, (4, 32))
    if lines[32] - lines[4] < 28:
        raise ExerciseError(
            f"reverse_sweep gives the right values, but your code ran {lines[4]} lines of Python on 4 blocks and "
            f"{lines[32]} on 32: no loop over the blocks. The exercise asks for Algorithm 2's reverse sweep, one "
            "block at a time from the last, carrying dKV; an n x n formula (or autograd) gets the values without it"
        )
    # A loop that runs is not yet a sweep (an empty `for` beside an n x n formula runs one too): the sweep holds one
    # block's b x b tiles and the d_k x d_v state at a time, never an n x n matrix. Measured on numpy's buffers
    # (tracemalloc) and torch's storages alike, at n = 1024, where n x n float64 takes 8 MiB.
    n, block = _DENSE_N, 16
    q, k, v, do, decay, _ = _inputs((1, 1, n, 2, 2, block, [0.9]), 960 + seed)
    box = {}

    def in_torch():
        box["torch"] = peak_memory_torch(lambda: box.setdefault(
            "out", _call("reverse_sweep", reverse_sweep, q, k, v, do, decay, block)))

    peak = max(peak_memory_numpy(in_torch), box.get("torch", 0))
    square = n * n * 8
    if peak > square / 4:
        raise ExerciseError(
            f"reverse_sweep gives the right values and loops, but allocated {peak / 2**20:.1f} MiB at n = {n} (block "
            f"size {block}): an n x n matrix takes {square / 2**20:.0f} MiB in float64. The reverse sweep never forms "
            "the n x n scores or mask: it holds one block's b x b tiles and the d_k x d_v state dKV at a time")
    passed(f"reverse sweep right: dk and dv match Algorithm 2 on {len(CASES)} shapes, partial last blocks included, "
           "one block at a time")
