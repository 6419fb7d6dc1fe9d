"""The chapter 05 checkers: right answers pass, the usual wrong ones fail with a message that locates them."""

import numpy as np
import pytest

from lightning_edu.exercises import ExerciseError
from lightning_edu.exercises.ch05 import check_dk_inter, check_dkv_update, check_reverse_sweep
from lightning_edu.numpy_blockwise import block_factors


def _lam(decay):
    return np.asarray(decay)[None, :, None, None]


def update(dkv, q_block, do_block, decay, first_power=1, old_power=None, after=False):
    b = q_block.shape[-2]
    lam = _lam(decay)
    r = np.arange(b)[:, None]
    new = (lam ** (r + first_power) * q_block).swapaxes(-1, -2) @ do_block
    if after:
        return lam**b * (dkv + new)
    return lam ** (b if old_power is None else old_power) * dkv + new


def test_dkv_update_right_passes(capsys):
    check_dkv_update(update)
    assert "Correct" in capsys.readouterr().out


@pytest.mark.parametrize(
    "wrong, message",
    [
        (lambda d, q, o, lam: update(d, q, o, lam, first_power=0), "eq. 9's Lambda"),
        (lambda d, q, o, lam: update(d, q, o, lam, old_power=0), "not decayed"),
        (lambda d, q, o, lam: update(d, q, o, lam, old_power=1), "by lambda, not lambda^b"),
        (lambda d, q, o, lam: update(d, q, o, lam, after=True), "decayed after adding"),
    ],
)
def test_dkv_update_wrong_is_located(wrong, message):
    with pytest.raises(ExerciseError) as info:
        check_dkv_update(wrong)
    text = str(info.value)
    assert message in text
    assert "differs first in block" in text and "rows" in text


def test_dkv_update_returning_none_is_named():
    with pytest.raises(ExerciseError, match="returned None"):
        check_dkv_update(lambda *a: None)


def inter(v_block, dkv, decay, powers="right"):
    b = v_block.shape[-2]
    r = np.arange(b)[:, None]
    lam = _lam(decay)
    scale = {"right": lam ** (b - 1 - r), "query": lam ** (r + 1), "none": 1.0}[powers]
    return scale * (v_block @ dkv.swapaxes(-1, -2))


def test_dk_inter_right_passes(capsys):
    check_dk_inter(inter)
    assert "Correct" in capsys.readouterr().out


@pytest.mark.parametrize("powers, message", [("query", "the query's factor"), ("none", "No decay on the inter term")])
def test_dk_inter_wrong_is_located(powers, message):
    with pytest.raises(ExerciseError) as info:
        check_dk_inter(lambda v, s, d: inter(v, s, d, powers))
    assert message in str(info.value)
    assert "dk " in str(info.value) and "differs first in block" in str(info.value)


def test_dk_inter_shape_error_is_reported():
    # forgetting the transpose: v (b, d_v) @ dkv (d_k, d_v) fails when d_k != d_v
    with pytest.raises(ExerciseError, match="dk_inter raised ValueError"):
        check_dk_inter(lambda v, s, d: v @ s)


def sweep(q, k, v, do, decay, block_size, read_after_update=False, next_do=False):
    from lightning_edu.numpy_blockwise import block_factors

    n = q.shape[2]
    dk, dv = np.empty_like(k), np.empty_like(v)
    dkv = np.zeros(q.shape[:2] + (q.shape[-1], v.shape[-1]))
    starts = list(range(0, n, block_size))
    for start in reversed(starts):
        rows = slice(start, min(start + block_size, n))
        qi, ki, vi, doi = q[:, :, rows], k[:, :, rows], v[:, :, rows], do[:, :, rows]
        mask, q_scale, k_scale, block_decay = block_factors(qi.shape[2], decay)
        new = block_decay * dkv + (q_scale * qi).swapaxes(-1, -2) @ doi
        state = new if read_after_update else dkv
        pair = doi
        if next_do:  # eq. 19 as printed
            nxt = do[:, :, start + block_size : start + 2 * block_size]
            pair = np.zeros_like(doi)
            pair[:, :, : nxt.shape[2]] = nxt[:, :, : doi.shape[2]]
        dk[:, :, rows] = ((doi @ vi.swapaxes(-1, -2)) * mask).swapaxes(-1, -2) @ qi + k_scale * (vi @ state.swapaxes(-1, -2))
        dv[:, :, rows] = ((qi @ ki.swapaxes(-1, -2)) * mask).swapaxes(-1, -2) @ pair + k_scale * (ki @ state)
        dkv = new
    return dk, dv


def test_reverse_sweep_right_passes(capsys):
    check_reverse_sweep(sweep)
    assert "Correct" in capsys.readouterr().out


def test_reverse_sweep_update_before_read_is_named():
    with pytest.raises(ExerciseError) as info:
        check_reverse_sweep(lambda *a: sweep(*a, read_after_update=True))
    text = str(info.value)
    assert text.startswith("dk (n = 37, block size 8")
    assert "differs first in block 0 (rows 0-7)" in text  # every block but the last one (which meets dKV = 0 first)
    assert "did you use the reverse-sweep state dKV of the blocks after this one?" in text


def test_reverse_sweep_eq19_slip_is_named():
    with pytest.raises(ExerciseError) as info:
        check_reverse_sweep(lambda *a: sweep(*a, next_do=True))
    text = str(info.value)
    assert text.startswith("dv ") and "differs first in block 0 (rows 0-7)" in text
    assert "eq. 19" in text


def test_reverse_sweep_must_return_a_pair():
    with pytest.raises(ExerciseError, match="pair"):
        check_reverse_sweep(lambda *a: sweep(*a)[0])


def test_dk_inter_from_the_papers_lambda_b_lambda_inverse_fails_on_long_blocks():
    # lambda^B Lambda^-1 built literally: right on short blocks, lambda^-300 overflows at lambda = 0.05
    def literal(v_block, dkv, decay):
        r = np.arange(v_block.shape[-2])[:, None]
        lam = np.asarray(decay)[None, :, None, None]
        with np.errstate(over="ignore", invalid="ignore"):
            return lam ** v_block.shape[-2] * lam ** (-(r + 1.0)) * (v_block @ dkv.swapaxes(-1, -2))

    with pytest.raises(ExerciseError, match="block size 300.*NaN"):
        check_dk_inter(literal)


def _dense_dk_dv(q, k, v, do, decay):
    """dK and dV from the n x n masked formulas, the answer a reader who skips the blocks would write."""
    i = np.arange(q.shape[2])
    gap = i[:, None] - i[None, :]
    lam = np.asarray(decay)[:, None, None]
    mask = np.where(gap >= 0, lam ** np.maximum(gap, 0), 0.0)
    return (((do @ v.swapaxes(-1, -2)) * mask).swapaxes(-1, -2) @ q,
            ((q @ k.swapaxes(-1, -2)) * mask).swapaxes(-1, -2) @ do)


def test_a_reverse_sweep_without_the_sweep_is_refused():
    # right values from the n x n masked formulas: no loop over blocks, which the exercise asks for
    def dense(q, k, v, do, decay, block_size):
        return _dense_dk_dv(q, k, v, do, decay)

    with pytest.raises(ExerciseError, match="right values, but your code ran .* no loop over the blocks"):
        check_reverse_sweep(dense)


# ---------------------------------------------------------------- slips the checks name (the cohort's findings)


def sweep_variant(q, k, v, do, decay, block_size, order="reverse", dtype=np.float64, drop_short=False):
    """The reverse sweep with one slip: the blocks walked first to last, the short last block dropped, or every
    buffer in ``dtype``."""
    n = q.shape[2]
    dk, dv = np.empty_like(k, dtype=dtype), np.empty_like(v, dtype=dtype)
    dkv = np.zeros(q.shape[:2] + (q.shape[-1], v.shape[-1]), dtype=dtype)
    starts = list(range(0, n - (n % block_size if drop_short else 0), block_size))
    for start in (reversed(starts) if order == "reverse" else starts):
        rows = slice(start, min(start + block_size, n))
        qi, ki, vi, doi = q[:, :, rows], k[:, :, rows], v[:, :, rows], do[:, :, rows]
        mask, q_scale, k_scale, block_decay = block_factors(qi.shape[2], decay)
        dk[:, :, rows] = ((doi @ vi.swapaxes(-1, -2)) * mask).swapaxes(-1, -2) @ qi + k_scale * (vi @ dkv.swapaxes(-1, -2))
        dv[:, :, rows] = ((qi @ ki.swapaxes(-1, -2)) * mask).swapaxes(-1, -2) @ doi + k_scale * (ki @ dkv)
        dkv = block_decay * dkv + (q_scale * qi).swapaxes(-1, -2) @ doi
    return dk, dv


def test_reverse_sweep_in_the_wrong_direction_is_named():
    with pytest.raises(ExerciseError) as info:
        check_reverse_sweep(lambda *a: sweep_variant(*a, order="forward"))
    assert "the sweep walks the blocks from the first to the last" in str(info.value)
    assert "reversed(range(0, n, block_size))" in str(info.value)


def test_reverse_sweep_without_its_short_last_block_is_named():
    with pytest.raises(ExerciseError) as info:
        check_reverse_sweep(lambda *a: sweep_variant(*a, drop_short=True))
    text = str(info.value)
    assert "the short last block (rows 32-36, 5 of them) is left out" in text, text  # n = 37, blocks of 8


def test_reverse_sweep_into_float32_buffers_is_named_for_its_dtype():
    with pytest.raises(ExerciseError, match="dk is float32: the check compares with float64"):
        check_reverse_sweep(lambda *a: sweep_variant(*a, dtype=np.float32))

    def float32_inside(*a):  # accumulated in float32, handed back as float64: off by float32's rounding only
        dk, dv = sweep_variant(*a, dtype=np.float32)
        return dk.astype(np.float64), dv.astype(np.float64)

    with pytest.raises(ExerciseError) as info:
        check_reverse_sweep(float32_inside)
    assert "that is the rounding of float32" in str(info.value) and "not a mistake in the algorithm" in str(info.value)
    assert "per block, newest first" not in str(info.value)  # not the hint that blames the algorithm


def test_an_empty_loop_beside_an_n_by_n_formula_is_refused_for_its_memory():
    def dense_with_a_loop(q, k, v, do, decay, block_size):
        for _ in range(0, q.shape[2], block_size):  # lines of Python per block, and nothing done in them
            pass
        return _dense_dk_dv(q, k, v, do, decay)

    with pytest.raises(ExerciseError, match=r"right values and loops, but allocated .* MiB at n = 1024.*n x n matrix"):
        check_reverse_sweep(dense_with_a_loop)


def test_the_same_through_torch_autograd_is_refused_for_its_memory():
    import torch

    def autograd_with_a_loop(q, k, v, do, decay, block_size):
        for _ in range(0, q.shape[2], block_size):
            pass
        qt, kt, vt = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
        i = torch.arange(q.shape[2])
        gap = (i[:, None] - i[None, :]).double()
        lam = torch.tensor(np.asarray(decay))[:, None, None]
        mask = torch.where(gap >= 0, lam ** gap.clamp(min=0), torch.zeros(()).double())
        o = ((qt @ kt.transpose(-1, -2)) * mask) @ vt
        o.backward(torch.tensor(do))
        return kt.grad.numpy(), vt.grad.numpy()

    with pytest.raises(ExerciseError, match=r"allocated .* MiB at n = 1024"):
        check_reverse_sweep(autograd_with_a_loop)


def test_dkv_update_may_use_block_factors(capsys):
    def with_block_factors(dkv, q_block, do_block, decay):
        _, q_scale, _, block_decay = block_factors(q_block.shape[2], decay)
        return block_decay * dkv + (q_scale * q_block).swapaxes(-1, -2) @ do_block

    check_dkv_update(with_block_factors)
    assert "Correct: dKV update right" in capsys.readouterr().out


@pytest.mark.parametrize("transpose", [lambda x: x.T, lambda x: x], ids=["dot-T", "none"])
def test_dkv_update_with_a_transpose_missing_gets_a_hint(transpose):
    def update_t(dkv, q_block, do_block, decay):
        _, q_scale, _, block_decay = block_factors(q_block.shape[2], decay)
        return block_decay * dkv + transpose(q_scale * q_block) @ do_block

    with pytest.raises(ExerciseError) as info:
        check_dkv_update(update_t)
    assert "dkv_update raised ValueError" in str(info.value)
    assert "Hint: a transpose is missing or on the wrong axes" in str(info.value)
    assert ".swapaxes(-1, -2)" in str(info.value)


def test_dk_inter_with_a_transpose_missing_gets_a_hint():
    with pytest.raises(ExerciseError) as info:
        check_dk_inter(lambda v, s, d: v @ s)
    assert "Hint: a transpose is missing or on the wrong axes: V_i dKV^T" in str(info.value)
    assert "dkv.swapaxes(-1, -2)" in str(info.value)
