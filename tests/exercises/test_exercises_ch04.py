"""The chapter 04 exercise checks: right answers pass, typical wrong ones get a message that teaches."""

import numpy as np
import pytest

from lightning_edu.exercises import ExerciseError
from lightning_edu.exercises.ch04 import check_blockwise_attention, check_intra_block, check_state_update


def _mask(b, lam):
    r = np.arange(b)
    return np.where(r[:, None] >= r[None, :], lam ** np.maximum(r[:, None] - r[None, :], 0), 0.0)


def intra_right(q, k, v, lam):
    return ((q @ k.T) * _mask(len(q), lam)) @ v


def state_right(kv, k, v, lam):
    b = len(k)
    return lam**b * kv + (lam ** (b - 1 - np.arange(b))[:, None] * k).T @ v


def blockwise_right(q, k, v, lam, block, inter_power_offset=1, update_first=False):
    out = np.empty((len(q), v.shape[1]))
    kv = np.zeros((q.shape[1], v.shape[1]))
    for start in range(0, len(q), block):
        qi, ki, vi = q[start : start + block], k[start : start + block], v[start : start + block]
        r = np.arange(len(qi))[:, None]
        if update_first:
            kv = state_right(kv, ki, vi, lam)
        out[start : start + block] = intra_right(qi, ki, vi, lam) + (lam ** (r + inter_power_offset) * qi) @ kv
        if not update_first:
            kv = state_right(kv, ki, vi, lam)
    return out


def test_right_answers_pass(capsys):
    check_intra_block(intra_right)
    check_state_update(state_right)
    check_blockwise_attention(blockwise_right)
    assert capsys.readouterr().out.count("Correct:") == 3


@pytest.mark.parametrize(
    "wrong,match",
    [
        (lambda q, k, v, lam: (q @ k.T) @ v, "left out the mask M"),
        (lambda q, k, v, lam: ((q @ k.T) * np.tril(np.ones((len(q), len(q))))) @ v, "causal but not decayed"),
        (lambda q, k, v, lam: ((q @ k.T) * _mask(len(q), lam).T) @ v, "M is transposed"),
        (lambda q, k, v, lam: None, "forget `return`"),
        (lambda q, k, v, lam: ((q @ k.T) * _mask(len(q), lam)) @ v * 1.01, r"block 0 \(rows 0-7"),
    ],
)
def test_intra_mistakes_are_named(wrong, match):
    with pytest.raises(ExerciseError, match=match):
        check_intra_block(wrong)


def test_intra_overflow_is_explained():
    def literal(q, k, v, lam):
        r = np.arange(len(q))
        m = np.tril((lam ** r)[:, None] * (lam ** -r)[None, :])  # lambda^r lambda^-s: overflows at lambda = 0.05, b = 300
        return ((q @ k.T) * m) @ v

    with np.errstate(over="ignore", invalid="ignore"):
        with pytest.raises(ExerciseError, match="non-negative powers"):
            check_intra_block(literal)


def test_intra_overflow_thrown_away_by_where_still_fails():
    def discarded(q, k, v, lam):  # right values: the inf of lambda ** (r - s), s > r, is discarded by np.where
        r = np.arange(len(q))
        gap = (r[:, None] - r[None, :]).astype(float)
        return ((q @ k.T) * np.where(gap >= 0, lam**gap, 0.0)) @ v

    with pytest.raises(ExerciseError, match="overflowed.*non-negative powers"):
        check_intra_block(discarded)


def test_intra_wrong_only_in_a_later_block_is_located():
    calls = {"n": 0}

    def wrong_on_third_call(q, k, v, lam):
        calls["n"] += 1
        out = intra_right(q, k, v, lam)
        return out + 1.0 if calls["n"] == 3 else out

    with pytest.raises(ExerciseError, match=r"block 2 \(rows 16-23"):
        check_intra_block(wrong_on_third_call)


@pytest.mark.parametrize(
    "wrong,match",
    [
        (lambda kv, k, v, lam: lam ** len(k) * kv + (lam ** (np.arange(len(k)) + 1)[:, None] * k).T @ v, r"lambda\^\(r\+1\)"),
        (lambda kv, k, v, lam: lam ** len(k) * kv + (lam ** (len(k) - np.arange(len(k)))[:, None] * k).T @ v, "one power too many"),
        (lambda kv, k, v, lam: kv + (lam ** (len(k) - 1 - np.arange(len(k)))[:, None] * k).T @ v, "forgot to decay the old state"),
        (lambda kv, k, v, lam: lam * kv + (lam ** (len(k) - 1 - np.arange(len(k)))[:, None] * k).T @ v, "by lambda instead of lambda\\^b"),
    ],
)
def test_state_mistakes_are_named(wrong, match):
    with pytest.raises(ExerciseError, match=match):
        check_state_update(wrong)


def test_state_with_fixed_block_size_fails_on_the_partial_block():
    def fixed_b(kv, k, v, lam, block=8):
        return lam**block * kv + (lam ** (block - 1 - np.arange(len(k)))[:, None] * k).T @ v

    with pytest.raises(ExerciseError, match=r"block 4 \(rows 32-36, b = 5.*shorter block"):
        check_state_update(fixed_b)


def test_state_literal_paper_formula_overflows_and_is_explained():
    def literal(kv, k, v, lam):
        b = len(k)
        lam_inv = np.diag(lam ** -(np.arange(b) + 1.0))  # Lambda^-1 of Algorithm 1, formed literally
        return lam**b * kv + (lam**b * lam_inv @ k).T @ v

    with np.errstate(over="ignore", invalid="ignore"):
        with pytest.raises(ExerciseError, match=r"0.05\*\*-300, which overflows"):
            check_state_update(literal)


def test_blockwise_with_eq9_lambda_is_located_in_block_1():
    with pytest.raises(ExerciseError, match=r"wrong from block 1 on: .*eq. 9's Lambda"):
        check_blockwise_attention(lambda q, k, v, lam, block: blockwise_right(q, k, v, lam, block, inter_power_offset=0))


def test_blockwise_updating_the_state_too_early_is_located():
    with pytest.raises(ExerciseError, match=r"wrong from block 0 on: you updated the state with block i before"):
        check_blockwise_attention(lambda q, k, v, lam, block: blockwise_right(q, k, v, lam, block, update_first=True))


def test_blockwise_other_errors_are_located_by_block():
    def wrong_in_block_3(q, k, v, lam, block):
        out = blockwise_right(q, k, v, lam, block)
        out[3 * block + 2] += 1.0
        return out

    with pytest.raises(ExerciseError, match=r"block 3 \(rows 24-31\).*inter part"):
        check_blockwise_attention(wrong_in_block_3)
    with pytest.raises(ExerciseError, match=r"block 0 \(rows 0-7\).*intra part"):
        check_blockwise_attention(lambda q, k, v, lam, block: blockwise_right(q, k, v, lam, block) * 2)
