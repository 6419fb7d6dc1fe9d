"""The chapter 07-08 exercise checks: the model solution passes, and typical mistakes get a message that
names what is wrong and where. Kernels run in the Triton CPU interpreter (conftest sets TRITON_INTERPRET).

Each kernel below takes a ``MISTAKE`` constexpr: 0 is the model solution (as in the notebooks), every other
value plants one typical error. ``_with`` binds it, so the checks launch the kernel exactly as a reader's.
"""

import pytest
import triton
import triton.language as tl

from lightning_edu.exercises import ExerciseError
from lightning_edu.exercises.ch07 import (check_decay_tile, check_inter_block_kernel, check_local_state_from_the_end,
                                         check_one_pass_balance, check_value_slice)
from lightning_edu.exercises.ch08 import check_la1_dq_kernel, check_replay, check_reverse_sweep_kernel


class _with:
    def __init__(self, kernel, **constexprs):
        self.kernel, self.constexprs = kernel, constexprs

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.kernel[grid](*args, **kwargs, **self.constexprs)


@triton.jit
def decay_tile_kernel(OUT, log2_lam, row_start, col_start, n, BLOCK: tl.constexpr, MISTAKE: tl.constexpr):
    r = tl.arange(0, BLOCK)
    rows = row_start + r
    cols = col_start + r
    distance = rows[:, None] - cols[None, :]
    keep = (distance >= 0) & (rows[:, None] < n) & (cols[None, :] < n)
    if MISTAKE == 1:  # no causal mask: negative powers overflow above the diagonal
        tile = tl.exp2(log2_lam * distance.to(tl.float32))
    elif MISTAKE == 2:  # rows past n kept
        tile = tl.where(distance >= 0, tl.exp2(log2_lam * tl.maximum(distance, 0).to(tl.float32)), 0.0)
    elif MISTAKE == 3:  # off by one power
        tile = tl.where(keep, tl.exp2(log2_lam * (tl.maximum(distance, 0) + 1).to(tl.float32)), 0.0)
    elif MISTAKE == 4:  # right values: the negative powers are formed, then selected away
        tile = tl.where(keep, tl.exp2(log2_lam * distance.to(tl.float32)), 0.0)
    else:
        tile = tl.where(keep, tl.exp2(log2_lam * tl.maximum(distance, 0).to(tl.float32)), 0.0)
    tl.store(OUT + r[:, None] * BLOCK + r[None, :], tile)


@triton.jit
def forward_kernel(Q, K, V, O, KV_OUT, LOG2_DECAY, n, H,
                   D_K: tl.constexpr, D_V: tl.constexpr, BLOCK: tl.constexpr, MISTAKE: tl.constexpr):
    bh = tl.program_id(0)
    log2_lam = tl.load(LOG2_DECAY + bh % H)
    r = tl.arange(0, BLOCK)
    ck = tl.arange(0, D_K)
    cv = tl.arange(0, D_V)
    gap = r[:, None] - r[None, :]
    M = tl.where(gap >= 0, tl.exp2(log2_lam * tl.maximum(gap, 0).to(tl.float32)), 0.0)
    kv = tl.zeros((D_K, D_V), dtype=tl.float32)
    for start in range(0, n, BLOCK):
        rows = start + r
        ok = rows < n
        b = tl.minimum(n - start, BLOCK)
        q = tl.load(Q + bh * n * D_K + rows[:, None] * D_K + ck[None, :], mask=ok[:, None], other=0.0)
        k = tl.load(K + bh * n * D_K + rows[:, None] * D_K + ck[None, :], mask=ok[:, None], other=0.0)
        v = tl.load(V + bh * n * D_V + rows[:, None] * D_V + cv[None, :], mask=ok[:, None], other=0.0)
        o = tl.dot(tl.dot(q, tl.trans(k)) * M, v)
        q_power = (r + 1).to(tl.float32)
        if MISTAKE == 1:  # eq. 9's diag(1, ..., lambda^(B-1)) instead of Algorithm 1's lambda^(r+1)
            q_power = r.to(tl.float32)
        b_used = b
        if MISTAKE == 2:  # the full block size even for the partial last block
            b_used = BLOCK
        k_scale = tl.where(ok, tl.exp2(log2_lam * tl.maximum(b_used - 1 - r, 0).to(tl.float32)), 0.0)
        if MISTAKE == 4:  # neither clamped nor masked: padded rows get lambda^-(r - b + 1), and k = 0 there
            k_scale = tl.exp2(log2_lam * (b_used - 1 - r).to(tl.float32))
        o += tl.dot(q * tl.exp2(log2_lam * q_power)[:, None], kv)
        if MISTAKE == 3:  # the carried state is not decayed
            kv = kv + tl.dot(tl.trans(k * k_scale[:, None]), v)
        else:
            kv = kv * tl.exp2(log2_lam * b_used.to(tl.float32)) + tl.dot(tl.trans(k * k_scale[:, None]), v)
        tl.store(O + bh * n * D_V + rows[:, None] * D_V + cv[None, :], o, mask=ok[:, None])
    tl.store(KV_OUT + bh * D_K * D_V + ck[:, None] * D_V + cv[None, :], kv)


@triton.jit
def reverse_kernel(Q, K, V, DO, DK, DV, DKV_OUT, LOG2_DECAY, n, H,
                   D_K: tl.constexpr, D_V: tl.constexpr, BLOCK: tl.constexpr, MISTAKE: tl.constexpr):
    bh = tl.program_id(0)
    log2_lam = tl.load(LOG2_DECAY + bh % H)
    r = tl.arange(0, BLOCK)
    ck = tl.arange(0, D_K)
    cv = tl.arange(0, D_V)
    gap = r[:, None] - r[None, :]
    M = tl.where(gap >= 0, tl.exp2(log2_lam * tl.maximum(gap, 0).to(tl.float32)), 0.0)
    dkv = tl.zeros((D_K, D_V), dtype=tl.float32)
    num_blocks = tl.cdiv(n, BLOCK)
    for i in range(0, num_blocks):
        start = (num_blocks - 1 - i) * BLOCK
        if MISTAKE == 4:  # the wrong direction: first block to last
            start = i * BLOCK
        rows = start + r
        ok = rows < n
        b = tl.minimum(n - start, BLOCK)
        q = tl.load(Q + bh * n * D_K + rows[:, None] * D_K + ck[None, :], mask=ok[:, None], other=0.0)
        k = tl.load(K + bh * n * D_K + rows[:, None] * D_K + ck[None, :], mask=ok[:, None], other=0.0)
        v = tl.load(V + bh * n * D_V + rows[:, None] * D_V + cv[None, :], mask=ok[:, None], other=0.0)
        do = tl.load(DO + bh * n * D_V + rows[:, None] * D_V + cv[None, :], mask=ok[:, None], other=0.0)
        dk = tl.dot(tl.trans(tl.dot(do, tl.trans(v)) * M), q)
        dv = tl.dot(tl.trans(tl.dot(q, tl.trans(k)) * M), do)
        k_scale = tl.where(ok, tl.exp2(log2_lam * tl.maximum(b - 1 - r, 0).to(tl.float32)), 0.0)
        q_power = (r + 1).to(tl.float32)
        if MISTAKE == 2:  # Lambda = diag(1 .. lambda^(B-1)) in the state update
            q_power = r.to(tl.float32)
        new_dkv = dkv * tl.exp2(log2_lam * b.to(tl.float32)) + tl.dot(tl.trans(q * tl.exp2(log2_lam * q_power)[:, None]), do)
        if MISTAKE == 1:  # the state updated with this block before this block uses it
            dkv = new_dkv
        dk += tl.dot(v * k_scale[:, None], tl.trans(dkv))
        if MISTAKE == 3:  # dV's inter term scaled like a query
            dv += tl.dot(k * tl.exp2(log2_lam * (r + 1).to(tl.float32))[:, None], dkv)
        else:
            dv += tl.dot(k * k_scale[:, None], dkv)
        dkv = new_dkv
        tl.store(DK + bh * n * D_K + rows[:, None] * D_K + ck[None, :], dk, mask=ok[:, None])
        tl.store(DV + bh * n * D_V + rows[:, None] * D_V + cv[None, :], dv, mask=ok[:, None])
    tl.store(DKV_OUT + bh * D_K * D_V + ck[:, None] * D_V + cv[None, :], dkv)


def test_decay_tile_solution_passes(capsys):
    check_decay_tile(_with(decay_tile_kernel, MISTAKE=0))
    assert capsys.readouterr().out.startswith("Correct:")


@pytest.mark.parametrize("mistake,message", [
    (1, r"key block 0\) at lambda = 0.9: entries above the diagonal \(key after query\) must be 0"),
    (2, "rows past n = 45 must be 0"),
    (3, r"tile \(query block 0, key block 0\) at lambda = 0.9 differs first in rows 0\.\.15"),
    (4, r"overflowed at lambda = 0.05 .*formed a negative power of lambda.*even if tl.where then threw it away"),
])
def test_decay_tile_mistakes(mistake, message):
    with pytest.raises(ExerciseError, match=message):
        check_decay_tile(_with(decay_tile_kernel, MISTAKE=mistake))


def test_inter_block_solution_passes(capsys):
    check_inter_block_kernel(_with(forward_kernel, MISTAKE=0))
    assert "Correct: forward_kernel matches Algorithm 1" in capsys.readouterr().out


@pytest.mark.parametrize("mistake,message", [
    (1, r"O differs first in block 1 \(rows 16-31\).*the final state is right, so the inter part is off.*not lambda\^r"),
    (2, r"O is right but the final state KV_OUT differs.*b = 5 valid rows of 16"),
    (3, r"O differs first in block 2 \(rows 32-36\).*the state carried from block to block is wrong"),
    (4, r"final state KV_OUT differs for \(batch 1, heads 2, n 33.*k_scale = 0 on padded rows"),
])
def test_inter_block_mistakes(mistake, message):
    with pytest.raises(ExerciseError, match=message):
        check_inter_block_kernel(_with(forward_kernel, MISTAKE=mistake))


def test_reverse_sweep_solution_passes(capsys):
    check_reverse_sweep_kernel(_with(reverse_kernel, MISTAKE=0))
    assert "Correct: reverse_kernel matches Algorithm 2" in capsys.readouterr().out


@pytest.mark.parametrize("mistake,message", [
    (1, r"dk differs in block 3, rows 48-52 .*use dKV before you update it"),
    (4, r"dk differs in block 3, rows 48-52 .*walks the blocks from the first to the last"),
    (2, r"dk differs in block 2, rows 32-47 .*did you use the reverse-sweep state\?"),
    (3, r"dv differs in block 2, rows 32-47 .*the reverse-sweep state is right, so the inter term is off"),
])
def test_reverse_sweep_mistakes(mistake, message):
    with pytest.raises(ExerciseError, match=message):
        check_reverse_sweep_kernel(_with(reverse_kernel, MISTAKE=mistake))


@triton.jit
def la1_dq_kernel(K, V, DO, DQ, LOG2_DECAY, n, H, D_K: tl.constexpr, D_V: tl.constexpr, BLOCK: tl.constexpr,
                  MISTAKE: tl.constexpr):
    i = tl.program_id(0)
    bh = tl.program_id(1)
    log2_lam = tl.load(LOG2_DECAY + bh % H)
    r = tl.arange(0, BLOCK)
    ck = tl.arange(0, D_K)
    cv = tl.arange(0, D_V)
    rows = i * BLOCK + r
    do = tl.load(DO + bh * n * D_V + rows[:, None] * D_V + cv[None, :], mask=(rows < n)[:, None], other=0.0)
    acc = tl.zeros((BLOCK, D_K), dtype=tl.float32)
    end = (i + 1) * BLOCK
    if MISTAKE == 1:  # stops before the diagonal tile
        end = i * BLOCK
    for start in range(0, end, BLOCK):
        cols = start + r
        k = tl.load(K + bh * n * D_K + cols[:, None] * D_K + ck[None, :], mask=(cols < n)[:, None], other=0.0)
        v = tl.load(V + bh * n * D_V + cols[:, None] * D_V + cv[None, :], mask=(cols < n)[:, None], other=0.0)
        distance = rows[:, None] - cols[None, :]
        if MISTAKE == 2:  # distance inside the tile only, as if every tile were on the diagonal
            distance = r[:, None] - r[None, :]
        keep = (rows[:, None] - cols[None, :] >= 0) & (cols[None, :] < n)
        decay = tl.where(keep, tl.exp2(log2_lam * tl.maximum(distance, 0).to(tl.float32)), 0.0)
        if MISTAKE == 3:  # a mask that multiplies: 0 * lambda^(negative) is NaN once the power overflows
            decay = keep.to(tl.float32) * tl.exp2(log2_lam * distance.to(tl.float32))
        acc += tl.dot(tl.dot(do, tl.trans(v)) * decay, k)
    tl.store(DQ + bh * n * D_K + rows[:, None] * D_K + ck[None, :], acc, mask=(rows < n)[:, None])


def test_la1_dq_solution_passes(capsys):
    check_la1_dq_kernel(_with(la1_dq_kernel, MISTAKE=0))
    assert "Correct: dq_kernel matches LA-1's dQ" in capsys.readouterr().out


@pytest.mark.parametrize("mistake,message", [
    (1, r"dq differs first in query block 0, rows 0-15, .*must include the diagonal tile"),
    (2, r"dq differs first in query block 1, rows 16-31, .*absolute positions"),
    (3, r"dq differs first in query block 0"),
])
def test_la1_dq_mistakes(mistake, message):
    with pytest.raises(ExerciseError, match=message):
        check_la1_dq_kernel(_with(la1_dq_kernel, MISTAKE=mistake))


# ---------------------------------------------------------------- fresh inputs, broken kernels, the package's own


@pytest.mark.parametrize("check, kernel", [
    (check_decay_tile, decay_tile_kernel), (check_inter_block_kernel, forward_kernel),
    (check_reverse_sweep_kernel, reverse_kernel), (check_la1_dq_kernel, la1_dq_kernel),
], ids=["7.1", "7.2", "8.1", "8.2"])
def test_model_kernels_pass_on_fresh_inputs(check, kernel, capsys):
    check(_with(kernel, MISTAKE=0), seed=None)
    assert "(fresh inputs, seed " in capsys.readouterr().out


@triton.jit
def tile_not_written(OUT, log2_lam, row_start, col_start, n, BLOCK: tl.constexpr):
    r = tl.arange(0, BLOCK)


@triton.jit
def tile_unimplemented(OUT, log2_lam, row_start, col_start, n, BLOCK: tl.constexpr):
    # YOUR CODE HERE
    raise NotImplementedError()


@triton.jit
def tile_inf(OUT, log2_lam, row_start, col_start, n, BLOCK: tl.constexpr):
    r = tl.arange(0, BLOCK)
    tl.store(OUT + r[:, None] * BLOCK + r[None, :], tl.full((BLOCK, BLOCK), float("inf"), tl.float32))


@triton.jit
def forward_not_written(Q, K, V, O, KV_OUT, LOG2_DECAY, n, H, D_K: tl.constexpr, D_V: tl.constexpr, BLOCK: tl.constexpr):
    bh = tl.program_id(0)


@triton.jit
def reverse_not_written(Q, K, V, DO, DK, DV, DKV_OUT, LOG2_DECAY, n, H, D_K: tl.constexpr, D_V: tl.constexpr,
                        BLOCK: tl.constexpr):
    bh = tl.program_id(0)


@triton.jit
def dq_not_written(K, V, DO, DQ, LOG2_DECAY, n, H, D_K: tl.constexpr, D_V: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)


@pytest.mark.parametrize("check, kernel, message", [
    (check_decay_tile, tile_not_written, "NaN entries: every entry of the tile must be stored"),
    (check_decay_tile, tile_unimplemented, "not implemented yet: it raised NotImplementedError"),
    (check_decay_tile, tile_inf, "inf entries"),
    (check_inter_block_kernel, forward_not_written, "O differs first in block 0"),
    (check_reverse_sweep_kernel, reverse_not_written, "holds NaN or inf"),
    (check_la1_dq_kernel, dq_not_written, "some rows are NaN"),
], ids=["tile-unwritten", "tile-unimplemented", "tile-inf", "forward-unwritten", "reverse-unwritten", "dq-unwritten"])
def test_broken_kernels_get_a_message(check, kernel, message):
    with pytest.raises(ExerciseError, match=message) as info:
        check(kernel)
    assert "the check could not use" not in str(info.value)


from lightning_edu.triton_kernels import la1  # noqa: E402


@triton.jit
def tile_from_the_package(OUT, log2_lam, row_start, col_start, n, BLOCK: tl.constexpr):
    r = tl.arange(0, BLOCK)
    tile = la1._decay_tile(log2_lam, row_start, col_start, n, BLOCK)
    tl.store(OUT + r[:, None] * BLOCK + r[None, :], tile)


def test_a_kernel_calling_the_package_is_refused():
    from lightning_edu.exercises import IntegrityError

    with pytest.raises(IntegrityError, match=r"calls lightning_edu\.triton_kernels\.la1\._decay_tile: write the algorithm yourself"):
        check_decay_tile(tile_from_the_package)


# Exercise 7.4, plain Python: the columns of d_v one program takes, against the backend's kernel_config.
def _waves(programs, sms):
    return -(-programs // (2 * sms))


def value_slice(batch_heads, d_v, sms):  # the model answer, as in the notebook
    return d_v if _waves(batch_heads, sms) < _waves(2 * batch_heads, sms) else 64


def test_value_slice_solution_passes(capsys):
    check_value_slice(value_slice)
    check_value_slice(value_slice, seed=None)
    check_value_slice(value_slice, seed=12345)
    out = capsys.readouterr().out
    assert out.count("Correct: value_slice chooses as the backend does in 54 cases, 30 of them with d_v whole") == 3


@pytest.mark.parametrize("answer, message", [
    (lambda b, d, s: 64, r"chose 64-column slices for 133 \(batch, head\) pairs, d_v = 128, on 132 SMs: 266 programs "
                          r"in 2 waves of 264, where d_v whole makes 133 programs in 1 wave\. Fewest waves first"),
    (lambda b, d, s: d, r"chose d_v whole for 1 \(batch, head\) pair, d_v = 128, on 132 SMs: 1 program, where "
                         r"64-column slices make 2 in the same 1 wave\. On a tie take the more programs"),
    (lambda b, d, s: d if b >= s else 64, r"chose d_v whole for 132 \(batch, head\) pairs"),  # one pair too early
    (lambda b, d, s: d if b > 2 * s else 64, r"chose 64-column slices for 133 "),  # waves of one program per SM
    (lambda b, d, s: 128 if b > s else 64, r"returned 128 for 133 \(batch, head\) pairs, d_v = 96, .*or the whole "
                                           r"d_v \(96\)"),  # a slice of 128 is d_v whole only at d_v = 128
])
def test_value_slice_mistakes(answer, message):
    with pytest.raises(ExerciseError, match=message):
        check_value_slice(answer)


def one_pass_balance(d, seg_len, handoffs):  # the model answer of exercise 7.5
    return 2 * seg_len * d * 2 - handoffs * 2 * d * d * 4


def test_one_pass_balance_solution_passes(capsys):
    for seed in (0, None, 12345):
        check_one_pass_balance(one_pass_balance, seed=seed)
    out = capsys.readouterr().out
    assert out.count("Correct: one_pass_balance agrees with the byte count in") == 3


@pytest.mark.parametrize("answer, message", [
    (lambda d, n, h: n * d * 2 - h * 2 * d * d * 4, r"returned -65536 for d = 128, seg_len = 256, handoffs = 1, "
                                                    r"expected 0: .*counted only K's second read"),
    (lambda d, n, h: 2 * n * d * 2 - h * d * d * 4, r"counted half of each state's cost"),  # a state written, not read
    (lambda d, n, h: 2 * n * d * 2 - h * 2 * d * d * 2, r"counted half of each state's cost"),  # states in 16 bits
    (lambda d, n, h: 2 * n * d * 4 - h * 2 * d * d * 4, r"counted K and V in 4 bytes an element"),
    (lambda d, n, h: 2 * n * d * 2 - 2 * d * d * 4, r"handoffs = 2, expected -131072: .*left out `handoffs`"),
    (lambda d, n, h: h * 2 * d * d * 4 - 2 * n * d * 2, r"seg_len = 512, .*reversed the sign"),
    (lambda d, n, h: 1, r"returned 1 for d = 128, seg_len = 256, handoffs = 1, expected 0$"),  # no slip named
    (lambda d, n, h: None, r"did you forget `return`"),
])
def test_one_pass_balance_mistakes(answer, message):
    with pytest.raises(ExerciseError, match=message):
        check_one_pass_balance(answer)


# Exercise 8.3, plain Python: replay a recorded plan (stand-in kernels check what they are handed).
def replay(buffers, launches, outputs, inputs, allocate):  # the model answer, as in the notebook
    bufs = []

    def value(kind, x):
        return (inputs, bufs)[kind][x] if kind < 2 else x

    for run, template in launches:
        last = max([len(bufs) - 1, *(x for kind, x in template if kind == 1)])
        while len(bufs) <= last:
            bufs.append(allocate(*buffers[len(bufs)]))
        run(*[value(kind, x) for kind, x in template])
    return tuple(value(kind, x) for kind, x in outputs)


def test_replay_solution_passes(capsys):
    check_replay(replay)
    check_replay(replay, seed=None)
    check_replay(replay, seed=4321)
    assert capsys.readouterr().out.count("Correct: replay allocates each buffer just before the launch") == 3


def _all_up_front(buffers, launches, outputs, inputs, allocate):
    bufs = [allocate(*entry) for entry in buffers]
    for run, template in launches:
        run(*[(inputs, bufs)[kind][x] if kind < 2 else x for kind, x in template])
    return tuple((inputs, bufs)[kind][x] if kind < 2 else x for kind, x in outputs)


def _per_use(buffers, launches, outputs, inputs, allocate):
    for run, template in launches:
        run(*[inputs[x] if kind == 0 else allocate(*buffers[x]) if kind == 1 else x for kind, x in template])


def _raw(buffers, launches, outputs, inputs, allocate):
    bufs = []
    for run, template in launches:
        while len(bufs) <= max([len(bufs) - 1, *(x for kind, x in template if kind == 1)]):
            bufs.append(allocate(*buffers[len(bufs)]))
        run(*[(inputs, bufs)[kind][x] if kind < 2 else (kind, x) for kind, x in template])


_KEPT: list = []


def _buffers_kept(buffers, launches, outputs, inputs, allocate):
    bufs = _KEPT  # one set of buffers for every call
    for run, template in launches:
        while len(bufs) <= max([len(bufs) - 1, *(x for kind, x in template if kind == 1)]):
            bufs.append(allocate(*buffers[len(bufs)]))
        run(*[(inputs, bufs)[kind][x] if kind < 2 else x for kind, x in template])
    return tuple((inputs, bufs)[kind][x] if kind < 2 else x for kind, x in outputs)


@pytest.mark.parametrize("answer, message", [
    (_all_up_front, r"allocated buffer 1 before launch 0, which does not use it: allocate each buffer just before"),
    (_per_use, r"asked allocate for buffer 0's entry a second time in one replay"),
    (_raw, r"launch 0's argument 2 is \(2, 3\.0\); its template entry \(2, 3\.0\) stands for the value 3\.0 itself"),
    (_buffers_kept, r"launch 0 names buffer 0, which this replay had not allocated before it ran"),
    (lambda *args: list(replay(*args)), r"replay returned \[tensor.*return a tuple with one entry per entry of outputs"),
    (lambda b, l, o, i, a: replay(b, l, o, i[::-1], a), r"launch 0's argument 0 is tensor.*stands for input 0"),
    (lambda b, l, o, i, a: replay(b, l, o, i, lambda shape, stride, dtype: a(shape, stride[::-1], dtype)),
     r"allocate was called with \(\(2, 3\), \(2, 1\), torch\.float64\), which is no buffer's entry"),
    (lambda *args: tuple(x.clone() if x is not None else x for x in replay(*args)),
     r"output 0 is tensor.*stands for buffer 1, the tensor this replay allocated"),
])
def test_replay_mistakes(answer, message):
    _KEPT.clear()
    with pytest.raises(ExerciseError, match=message):
        check_replay(answer)


# Exercise 7.6, numpy: a segment's local state from its last block back to its first.
def local_state_from_the_end(load, num_blocks, block, lam, mistake=None):  # the model answer, as in the notebook
    import numpy as np

    within = lam ** np.arange(block - 1, -1, -1.0)  # row r of a block: lambda ** (block - 1 - r)
    if mistake == "rows reversed":
        within = lam ** np.arange(block, dtype=float)
    if mistake == "blocks only":
        within = np.ones(block)
    order = range(num_blocks)
    if mistake == "start first":
        order = range(num_blocks - 1, -1, -1)  # i counts from the end, so block num_blocks - 1 - i goes 0, 1, ...
    if mistake == "skips block 0":
        order = range(num_blocks - 1)
    state = 0.0
    for i in order:
        b = num_blocks - 1 - i
        k, v = load(b)
        if mistake == "twice":
            k, v = load(b)
        if mistake == "negative powers":  # weights relative to the segment's start, then scaled back: overflows
            p = b * block + np.arange(block)
            state = state + (k * (lam ** -p.astype(float))[:, None]).T @ v
            continue
        power = (i + 1) * block if mistake == "a block too many" else i * block
        if mistake == "oldest first":
            weights = lam ** (b * block + np.arange(block, dtype=float))
        else:
            weights = within * lam ** power
        state = state + (k * weights[:, None]).T @ v
    if mistake == "negative powers":
        state = state * lam ** (num_blocks * block - 1)
    if mistake == "transposed":
        return state.T
    if mistake == "no return":
        return None
    return state


def test_local_state_from_the_end_solution_passes(capsys):
    for seed in (0, None, 12345):
        check_local_state_from_the_end(local_state_from_the_end, seed=seed)
    out = capsys.readouterr().out
    assert out.count("Correct: local_state_from_the_end sums 4 segments from their last block back") == 3


@pytest.mark.parametrize("mistake, message", [
    ("start first", r"loaded the blocks from the first to the last for num_blocks = 4, .*walk from the last block"),
    ("twice", r"loaded block 3 2 times for num_blocks = 4, block = 16, .*load each block once"),
    ("skips block 0", r"never loaded block 0 .*every block of the segment adds to its state"),
    ("negative powers", r"overflowed for num_blocks = 24, block = 16, d_k = 16, d_v = 16, lam = 0.001: .*"
                        r"negative exponent"),
    ("a block too many", r"wrong for num_blocks = 4, .*lam = 0.9: .*one block too many"),
    ("blocks only", r"wrong for num_blocks = 4, .*whole blocks but not the rows inside them"),
    ("rows reversed", r"wrong for num_blocks = 4, .*rows inside each block the wrong way round"),
    ("oldest first", r"wrong for num_blocks = 4, .*weighted the oldest row by 1"),
    ("transposed", r"returned shape \(32, 16\) for num_blocks = 4, .*expected \(16, 32\).*transposed"),
    ("no return", r"returned None -- did you forget `return`"),
])
def test_local_state_from_the_end_mistakes(mistake, message):
    def answer(load, num_blocks, block, lam):
        return local_state_from_the_end(load, num_blocks, block, lam, mistake)

    with pytest.raises(ExerciseError, match=message):
        check_local_state_from_the_end(answer)


def test_local_state_from_the_end_bad_block_numbers():
    def float_blocks(load, num_blocks, block, lam):
        return load(float(num_blocks - 1))

    with pytest.raises(ExerciseError, match=r"load\(3.0\) for num_blocks = 4, .*a block number is an int from 0 to 3"):
        check_local_state_from_the_end(float_blocks)
