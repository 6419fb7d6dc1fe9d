"""Checks for the exercises of chapter 07 (the forward kernel in Triton).

Each check launches the reader's ``@triton.jit`` kernel (in the CPU interpreter without CUDA) on seeded
random fp32 inputs of odd lengths and compares with the float64 numpy rung:

* :func:`check_decay_tile` -- a kernel that writes one BLOCK x BLOCK tile of the decay mask M
  (the ingredient of the Lightning Attention-1 kernel), against ``numpy_reference.decay_mask``;
* :func:`check_inter_block_kernel` -- a Lightning Attention-2 forward kernel whose inter-block part and
  state update the reader writes, against ``numpy_blockwise.blockwise_forward`` (output and final state);
* :func:`check_value_slice` -- plain Python, no kernel: how many columns of d_v one program of the backend's
  forward takes for a number of (batch, head) pairs on a GPU, against the backend's own ``kernel_config``;
* :func:`check_one_pass_balance` -- plain Python: the bytes a one-pass forward saves per segment, against
  ``costs.one_pass_balance``;
* :func:`check_local_state_from_the_end` -- numpy: a segment's local state summed from its last block back to its
  first, as the pre-pass can (the setting ``prepass_tail_first`` of ``plan.Settings``), against the float64 sum, the blocks' load order
  recorded.

Kernels receive fp32 tensors; tiles are >= 16 (the GPU rejects smaller ``tl.dot`` shapes).
"""

from __future__ import annotations

import numpy as np

from ..checks import random_qkv
from ..numpy_blockwise import blockwise_forward
from ..numpy_reference import causal_linear_recurrent, decay_mask
from ._core import (
    ExerciseError,
    call_reader,
    exception_chain,
    exercise,
    expect_array,
    expect_close,
    expect_count,
    expect_shape,
    passed,
    seeded,
    wrong_rows,
)

__all__ = ["check_decay_tile", "check_inter_block_kernel", "check_value_slice", "check_one_pass_balance",
           "check_local_state_from_the_end", "tolerance"]


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def tolerance() -> float:
    """Relative error allowed: fp32 in the interpreter is exact to ~1e-7; a GPU's default fp32 tl.dot is tf32."""
    return 1e-5 if _device() == "cpu" else 3e-3


def _launch_error(what: str, exc: Exception) -> ExerciseError:
    if any(isinstance(e, NotImplementedError) or "NotImplementedError" in str(e) for e in exception_chain(exc)):
        return ExerciseError(f"{what} is not implemented yet: it raised NotImplementedError. Write your code in "
                             "place of `raise NotImplementedError()`")
    return ExerciseError(
        f"{what} failed to run: {type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}. "
        "Check the kernel's signature against the exercise statement, and that every tl.dot side is >= 16"
    )


@exercise("7.1", reveals=("_decay_tile", "decay_tile"), kernel=True)
def check_decay_tile(decay_tile_kernel, seed: int = 0) -> None:
    """``decay_tile_kernel[(1,)](out, log2_lambda, row_start, col_start, n, BLOCK=16)`` must write the tile
    D[r, s] = lambda^((row_start + r) - (col_start + s)) for row >= col, both < n, else 0, into the
    contiguous (BLOCK, BLOCK) float32 tensor ``out``."""
    import torch

    block = 16
    n = 45  # three tiles, the last one partial (rows 32..44 valid)
    lams = (0.9, 0.05, 1.0)
    if seed:
        rng = seeded(seed)
        n = int(rng.integers(33, 48))
        lams = (float(np.round(rng.uniform(0.5, 0.99), 3)), float(np.round(rng.uniform(0.01, 0.1), 3)), 1.0)
    for lam in lams:
        full = decay_mask(n, lam)
        padded = np.zeros((48, 48))
        padded[:n, :n] = full
        for bi, bj in ((0, 0), (1, 0), (2, 1), (2, 2), (0, 1)):
            out = torch.full((block, block), float("nan"), dtype=torch.float32, device=_device())
            try:
                # In the interpreter a kernel's arithmetic is numpy's: float overflow raises, so a negative power
                # formed and then selected away (tl.where) is caught as well as one that reaches the tile.
                with np.errstate(over="raise"):
                    decay_tile_kernel[(1,)](out, float(np.log2(lam)), bi * block, bj * block, n, BLOCK=block)
            except Exception as exc:  # the interpreter raises plain Python errors from the kernel body
                if any(isinstance(e, FloatingPointError) for e in exception_chain(exc)):
                    raise ExerciseError(
                        f"decay_tile_kernel overflowed at lambda = {lam} (tile: query block {bi}, key block {bj}): it "
                        "formed a negative power of lambda, exp2(log2_lambda * distance) with distance < 0, even if "
                        "tl.where then threw it away. Clamp first: tl.maximum(distance, 0), then select with tl.where"
                    ) from exc
                raise _launch_error("decay_tile_kernel", exc) from exc
            got = expect_shape("the tile", out, (block, block))
            want = padded[bi * block:(bi + 1) * block, bj * block:(bj + 1) * block]
            where = f"tile (query block {bi}, key block {bj}) at lambda = {lam}"
            if np.isnan(got).any():
                raise ExerciseError(f"{where} has NaN entries: every entry of the tile must be stored (0 where masked)")
            if np.isinf(got).any():
                raise ExerciseError(
                    f"{where} has inf entries: a negative power of lambda overflowed. Clamp the distance at 0 "
                    "(tl.maximum(distance, 0)) before exp2 and zero those entries with tl.where"
                )
            if bj > bi and np.any(got != 0):
                raise ExerciseError(f"{where} lies wholly above the diagonal and must be all 0 (causality: key after query)")
            upper = np.triu(np.ones((block, block), dtype=bool), 1)
            if bi == bj and np.any(got[upper] != 0):
                raise ExerciseError(
                    f"{where}: entries above the diagonal (key after query) must be 0: select them away with "
                    "tl.where on distance >= 0 (and never raise lambda to a negative power there)"
                )
            if bi == 2 and np.any(got[n - 2 * block:, :] != 0):
                raise ExerciseError(f"{where}: rows past n = {n} must be 0 (mask rows >= n)")
            expect_close(
                where, got, want, rtol=1e-5, axis=0,
                hint="D[r, s] = lambda^((row_start + r) - (col_start + s)) = exp2(log2_lambda * distance): "
                     "distance counts from the key to the query, in absolute positions",
            )
    which = "two fresh lambdas (one below 0.1) and 1" if seed else "lambda = 0.9, 0.05 and 1"
    passed(f"decay_tile_kernel writes M's tiles on and below the diagonal, zeros above it and past n, for {which}")


_FORWARD_SHAPES = [  # (batch, heads, n, d_k, d_v, decays): odd n (a partial last block), and one full block
    (1, 2, 37, 16, 32, [0.9, 0.5]),
    (2, 1, 50, 32, 16, [0.99]),
    (1, 2, 16, 16, 16, [0.05, 1.0]),
    # a 1-row last block at lambda = 1e-3: a padded row's unclamped k_scale, lambda^-(r - b + 1), is inf in fp32 and
    # 0 * inf = NaN reaches the state; keep k_scale = 0 on padded rows (tl.where) with a clamped exponent
    (1, 2, 33, 16, 16, [1e-3, 1.0]),
]


@exercise("7.2", reveals=("la2_literal_forward_kernel",), kernel=True)
def check_inter_block_kernel(forward_kernel, block: int = 16, seed: int = 0) -> None:
    """``forward_kernel[(batch * heads,)](Q, K, V, O, KV_OUT, LOG2_DECAY, n, H, D_K=, D_V=, BLOCK=16)`` must
    compute Algorithm 1 for contiguous fp32 (batch, heads, n, d) tensors: O (batch, heads, n, d_v) and the
    final state KV_OUT (batch, heads, d_k, d_v); LOG2_DECAY holds log2(lambda) per head."""
    import torch

    dev = _device()
    rtol = tolerance()
    for i, (batch, heads, n, d_k, d_v, decay) in enumerate(_FORWARD_SHAPES):
        q, k, v = random_qkv(batch, heads, n, d_k, d_v, seed=70 + i + seed)
        o_ref, kv_ref = blockwise_forward(q, k, v, decay, block_size=block)
        t = [torch.tensor(x, dtype=torch.float32, device=dev) for x in (q, k, v)]
        o = torch.full((batch, heads, n, d_v), float("nan"), dtype=torch.float32, device=dev)
        kv = torch.full((batch, heads, d_k, d_v), float("nan"), dtype=torch.float32, device=dev)
        log2_decay = torch.tensor(np.log2(decay), dtype=torch.float32, device=dev)
        try:
            forward_kernel[(batch * heads,)](*t, o, kv, log2_decay, n, heads, D_K=d_k, D_V=d_v, BLOCK=block)
        except Exception as exc:
            raise _launch_error("forward_kernel", exc) from exc
        case = f"(batch {batch}, heads {heads}, n {n}, d_k {d_k}, d_v {d_v}, lambda {decay})"
        got_o = expect_shape("O", o, o_ref.shape)
        bad_rows = wrong_rows(got_o, o_ref, rtol=rtol, axis=2)
        kv_ok = np.allclose(kv.cpu().double().numpy(), kv_ref, rtol=0, atol=rtol * np.abs(kv_ref).max())
        if bad_rows.size:
            first_block = int(bad_rows[0]) // block
            rows = f"rows {first_block * block}-{min(n, first_block * block + block) - 1}"
            if first_block == 0:
                hint = ("with KV = 0 before the first block, the inter part adds nothing there: the intra part "
                        "(given) must stay as it was, and nothing may be added that is not q_i times the state")
            elif not kv_ok:
                hint = ("the state carried from block to block is wrong (the final state differs too): "
                        "KV = lambda^b KV + (diag(lambda^(b-1-r)) K_i)^T V_i, updated AFTER this block's output used the old KV")
            else:
                hint = ("the final state is right, so the inter part is off: O_i += diag(lambda^(r+1)) Q_i KV with the "
                        "state from the previous blocks (lambda^(r+1), not lambda^r: row r is r+1 steps after the "
                        "previous block's end)")
            raise ExerciseError(f"O differs first in block {first_block} ({rows}) for {case}. Hint: {hint}")
        if not kv_ok:
            b_last = n - (n - 1) // block * block
            raise ExerciseError(
                f"O is right but the final state KV_OUT differs for {case}. Hint: the last block has b = {b_last} "
                f"valid rows of {block}: decay the state by lambda^b and scale k by lambda^(b-1-r) with that b, with "
                "k_scale = 0 on padded rows, and store KV after the last update"
            )
    partial = sum(shape[2] % block != 0 for shape in _FORWARD_SHAPES)
    passed(f"forward_kernel matches Algorithm 1 (numpy, float64) on {len(_FORWARD_SHAPES)} shapes ({partial} with a "
           "partial last block) and per-head decay: O and the final state")


def _waves(programs: int, sms: int) -> int:
    """Waves of programs at two per SM (the backend's 16-bit kernels fit two on an SM at once)."""
    return -(-programs // (2 * sms))


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


@exercise("7.4", reveals=("kernel_config",))
def check_value_slice(value_slice, seed: int = 0) -> None:
    """``value_slice(batch_heads, d_v, sms)`` must give the columns of d_v that one program of the backend's 16-bit
    forward takes, for 64 < d_v <= 128 and one segment: 64 (two slices per (batch, head) pair) or d_v (whole), as
    the backend's ``kernel_config`` chooses: the fewest waves of programs at two per SM, and on a tie the more
    programs."""
    import torch

    from ..triton_kernels import kernel_config

    sm_counts, widths = (132, 108, 16), (128, 96)
    if seed:
        rng = seeded(seed)
        sm_counts = tuple(int(x) for x in rng.choice(np.arange(8, 200), size=3, replace=False))
        widths = (int(rng.integers(65, 128)), 128)
    cases = [(pairs, d_v, sms) for sms in sm_counts for d_v in widths
             for pairs in sorted({1, sms // 2, sms - 1, sms, sms + 1, 2 * sms - 1, 2 * sms, 2 * sms + 1, 3 * sms + 7})]
    whole = 0
    for pairs, d_v, sms in cases:
        where = f"for {_count(pairs, '(batch, head) pair')}, d_v = {d_v}, on {sms} SMs"
        got = expect_count("value_slice", call_reader(value_slice, "value_slice", (pairs, d_v, sms), where),
                           what="a number of columns")
        want = min(kernel_config(d_v, d_v, torch.bfloat16, batch_heads=pairs, sms=sms)["block_dv"], d_v)
        whole += want == d_v
        if got not in (64, d_v):
            raise ExerciseError(f"value_slice returned {got} {where}: a program takes 64 columns (two slices per "
                                f"pair) or the whole d_v ({d_v})")
        if got == want:
            continue
        sliced, full = (2 * pairs, _waves(2 * pairs, sms)), (pairs, _waves(pairs, sms))
        if got == 64:
            raise ExerciseError(
                f"value_slice chose 64-column slices {where}: {_count(sliced[0], 'program')} in "
                f"{_count(sliced[1], 'wave')} of {2 * sms}, where d_v whole makes {_count(full[0], 'program')} in "
                f"{_count(full[1], 'wave')}. Fewest waves first: in a last, partial wave a few programs run while "
                "most SMs wait")
        raise ExerciseError(
            f"value_slice chose d_v whole {where}: {_count(full[0], 'program')}, where 64-column slices make "
            f"{sliced[0]} in the same {_count(full[1], 'wave')}. On a tie take the more programs: more loads in "
            "flight (chapter 14, section 14.2, measured the slices faster at 8K to 128K tokens)")
    passed(f"value_slice chooses as the backend does in {len(cases)} cases, {whole} of them with d_v whole: pair "
           f"counts around one and two waves, two widths of d_v, {len(sm_counts)} GPUs of different sizes")


@exercise("7.5", reveals=("one_pass_balance",))
def check_one_pass_balance(one_pass_balance, seed: int = 0) -> None:
    """``one_pass_balance(d, seg_len, handoffs)`` must give the bytes of DRAM traffic a one-pass forward saves per
    segment and (batch, head), bf16 K and V, float32 states, as :func:`lightning_edu.costs.one_pass_balance`
    counts them; a wrong answer that matches a usual slip is named."""
    from ..costs import one_pass_balance as model

    cases = [(128, 256, 1), (128, 512, 1), (128, 256, 2), (128, 1024, 2), (64, 128, 1), (64, 1024, 1), (64, 512, 2)]
    if seed:
        rng = seeded(seed)
        cases = [(int(rng.choice([16, 32, 64, 128, 256])), 16 * int(rng.integers(1, 129)), int(rng.integers(1, 3)))
                 for _ in range(8)]
    for d, rows, handoffs in cases:
        where = f"for d = {d}, seg_len = {rows}, handoffs = {handoffs}"
        got = expect_count("one_pass_balance", call_reader(one_pass_balance, "one_pass_balance", (d, rows, handoffs),
                                                           where), what="a number of bytes")
        want = model(d, rows, handoffs)
        if got == want:
            continue
        saved, paid = 2 * rows * d * 2, handoffs * 2 * d * d * 4
        slips = {  # what a slip gives -> what it is (later entries win where two slips give one number)
            rows * d * 2 - paid: "counted only K's second read; V is read a second time too",
            2 * rows * d * 4 - paid: "counted K and V in 4 bytes an element; they are bf16, 2 bytes",
            # a state counted once, or in 2 bytes an element: the same number
            saved - handoffs * d * d * 4: ("counted half of each state's cost: a d x d float32 state (4 bytes an "
                                           "element) is written, then read back by the next segment"),
            saved - 2 * d * d * 4: "left out `handoffs`: the look-back hands on two states per segment, the chained scan one",
            paid - saved: "reversed the sign: positive means one pass moves fewer bytes",
        }
        slip = slips.get(got)
        raise ExerciseError(f"one_pass_balance returned {got} {where}, expected {want}"
                            + (f": it looks as if you {slip}" if slip else ""))
    passed(f"one_pass_balance agrees with the byte count in {len(cases)} cases: head dims, segment lengths, and the "
           "hand-offs of the chained scan and of the look-back")


def _weighted_state(k, v, row_weights) -> np.ndarray:
    """sum_p w_p k_p^T v_p in float64: what a slip's weights give."""
    return (k * row_weights[:, None]).T @ v


@exercise("7.6", reveals=("_local_state",))
def check_local_state_from_the_end(local_state_from_the_end, seed: int = 0) -> None:
    """``local_state_from_the_end(load, num_blocks, block, lam)`` must return A = sum_p lambda^(L-1-p) k_p^T v_p,
    (d_k, d_v), for one segment of L = num_blocks * block rows, calling ``load(b)`` (block b's rows of K and V) for
    b = num_blocks - 1 down to 0, each once, and never overflowing: lambda = 0.001 over 24 blocks is among the
    inputs, where a power with a negative exponent carried from block to block overflows float64."""
    cases = [(4, 16, 16, 32, 0.9), (3, 16, 32, 16, 1.0), (24, 16, 16, 16, 0.001), (5, 8, 3, 5, 0.5)]
    if seed:
        rng = seeded(seed)
        cases = [(int(rng.integers(2, 9)), int(rng.choice([4, 8, 16])), int(rng.integers(1, 33)),
                  int(rng.integers(1, 33)), float(np.round(rng.uniform(0.3, 0.999), 3))) for _ in range(3)]
        cases.append((int(rng.integers(20, 30)), 16, int(rng.integers(4, 17)), int(rng.integers(4, 17)),
                      float(np.round(rng.uniform(1e-4, 1e-3), 6))))
    gen = np.random.default_rng(abs(seed or 0) + 11)
    for num_blocks, block, d_k, d_v, lam in cases:
        rows = num_blocks * block
        k, v = gen.standard_normal((rows, d_k)), gen.standard_normal((rows, d_v))
        where = f"for num_blocks = {num_blocks}, block = {block}, d_k = {d_k}, d_v = {d_v}, lam = {lam}"
        order: list = []

        def load(b, k=k, v=v, block=block, num_blocks=num_blocks, order=order):
            if isinstance(b, (bool, np.bool_)) or not isinstance(b, (int, np.integer)) or not 0 <= b < num_blocks:
                raise ExerciseError(f"load({b!r}) {where}: a block number is an int from 0 to {num_blocks - 1}")
            order.append(int(b))
            return k[b * block:(b + 1) * block].copy(), v[b * block:(b + 1) * block].copy()

        try:
            with np.errstate(over="raise"):
                got = call_reader(local_state_from_the_end, "local_state_from_the_end",
                                  (load, num_blocks, block, lam), where)
        except ExerciseError as exc:
            if any(isinstance(e, (FloatingPointError, OverflowError)) for e in exception_chain(exc)):
                raise ExerciseError(
                    f"local_state_from_the_end overflowed {where}: it formed a power of lambda with a negative "
                    f"exponent (lambda ** -{block} = {lam ** -min(block, 64):.0e}, compounded from block to block, "
                    "leaves float64). Weight block i (counted from the end) by lambda ** (i * block) directly: every "
                    "weight is at most 1") from exc
            raise
        want_order = list(range(num_blocks - 1, -1, -1))
        if order != want_order:
            if order == want_order[::-1]:
                raise ExerciseError(f"local_state_from_the_end loaded the blocks from the first to the last {where}: "
                                    "walk from the last block (num_blocks - 1) back to block 0, so that the rows "
                                    "read last are the ones the main pass reads first")
            twice = [b for b in dict.fromkeys(order) if order.count(b) > 1]  # in the order it loaded them
            if twice:
                raise ExerciseError(f"local_state_from_the_end loaded block {twice[0]} {order.count(twice[0])} times "
                                    f"{where}: load each block once (a kernel that loads a block twice reads it "
                                    "twice from memory)")
            missing = sorted(set(want_order) - set(order))
            if missing:
                raise ExerciseError(f"local_state_from_the_end never loaded block {missing[0]} {where} (it loaded "
                                    f"{order}): every block of the segment adds to its state")
            raise ExerciseError(f"local_state_from_the_end loaded the blocks in the order {order} {where}, expected "
                                f"{want_order}")
        p = np.arange(rows)
        # the ground truth: the recurrence KV_t = lambda KV_{t-1} + k_t^T v_t over the segment, from zero
        _, want = causal_linear_recurrent(np.zeros((1, 1, rows, d_k)), k[None, None], v[None, None], lam,
                                          return_state=True)
        want = want[0, 0]
        got_arr = expect_array("local_state_from_the_end", got)
        if got_arr.shape == (d_v, d_k) and d_k != d_v:
            raise ExerciseError(f"local_state_from_the_end returned shape {got_arr.shape} {where}, expected "
                                f"{(d_k, d_v)}: A is K^T V, d_k rows by d_v columns (it looks transposed)")
        r = p % block
        slips = {  # what a slip gives -> what it is
            "a block too many": (_weighted_state(k, v, lam ** (rows - 1 - p + block)),
                                 "weighted every block by one block too many: the last block's weight is "
                                 "lambda ** 0 = 1, block i from the end lambda ** (i * block)"),
            "blocks only": (_weighted_state(k, v, lam ** (rows - block - (p - r))),
                            "weighted whole blocks but not the rows inside them: row r of a block also carries "
                            "lambda ** (block - 1 - r)"),
            "rows reversed": (_weighted_state(k, v, lam ** (rows - block - (p - r) + r)),
                              "weighted the rows inside each block the wrong way round: the block's last row "
                              "(r = block - 1) has weight lambda ** 0 within its block"),
            "oldest first": (_weighted_state(k, v, lam ** p.astype(float)),
                             "weighted the oldest row by 1: the newest row (the segment's last) has weight 1, and "
                             "each older row one more factor lambda"),
        }
        if got_arr.shape == want.shape and np.isfinite(got_arr).all() and not np.allclose(got_arr, want, rtol=1e-9,
                                                                                          atol=1e-12):
            for ref, message in slips.values():
                if np.allclose(got_arr, ref, rtol=1e-9, atol=1e-12):
                    raise ExerciseError(f"local_state_from_the_end is wrong {where}: it looks as if you {message}")
        expect_close("local_state_from_the_end", got_arr, want, rtol=1e-9, axis=-2)
    passed(f"local_state_from_the_end sums {len(cases)} segments from their last block back to the first, each "
           "block loaded once, as the float64 sum does, with lambda = 1 and lambda near 0 over many blocks")
