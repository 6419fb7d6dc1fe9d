"""The chapter 00 checkers: the model solutions pass, and typical mistakes get the message that explains them."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lightning_edu.exercises import ExerciseError
from lightning_edu.exercises.ch00 import check_block_lengths, check_state_step, check_tensor_bytes

# ---------------------------------------------------------------- 0.1


def test_tensor_bytes_solution_passes(capsys):
    check_tensor_bytes(lambda shape, dtype: math.prod(shape) * dtype.itemsize)
    assert capsys.readouterr().out.startswith("Correct: byte counts right on 5 shapes")


@pytest.mark.parametrize(
    "wrong, message",
    [
        (lambda shape, dtype: math.prod(shape), r"is the number of elements; multiply by the bytes per element \(2 for torch.bfloat16\)"),
        (lambda shape, dtype: math.prod(shape) * dtype.itemsize * 8, r"counts bits; a byte is 8 bits"),
        (lambda shape, dtype: math.prod(shape) * 4, r"uses 4 bytes per element; torch.bfloat16 is a 16-bit type: 2 bytes"),
        (lambda shape, dtype: math.prod(shape) * dtype.itemsize / 1.0, r"returned 4294967296.0 of type float; a byte count is an int"),
        (lambda shape, dtype: None, r"returned None -- did you forget `return`\?"),
        (lambda shape, dtype: math.prod(shape[1:]) * dtype.itemsize, r"= 536870912, expected 4294967296 \(2147483648 elements x 2 bytes\)"),
    ],
    ids=["elements", "bits", "bf16-as-4-bytes", "float", "none", "other"],
)
def test_tensor_bytes_mistakes(wrong, message):
    with pytest.raises(ExerciseError, match=message):
        check_tensor_bytes(wrong)


# ---------------------------------------------------------------- 0.2


def good_step(kv, k_t, v_t, decay):
    return decay[:, None, None] * kv + k_t[..., :, None] * v_t[..., None, :]


def test_state_step_solution_passes(capsys):
    check_state_step(good_step)
    assert "matches one step of causal_linear_recurrent on 4 shapes" in capsys.readouterr().out


def in_place_step(kv, k_t, v_t, decay):
    kv *= decay[:, None, None]
    kv += k_t[..., :, None] * v_t[..., None, :]
    return kv


def test_state_step_ground_truth_is_the_recurrence():
    # The checker's reference is causal_linear_recurrent; pin it to the formula on a 1-head example by hand:
    # KV = 0.5 * [[1, 2]] + [3]^T [1, 1] = [[3.5, 4]].
    from lightning_edu.exercises.ch00 import _reference_step

    out = _reference_step(np.array([[[[1.0, 2.0]]]]), np.array([[[3.0]]]), np.array([[[1.0, 1.0]]]), np.array([0.5]))
    assert np.array_equal(out, np.array([[[[3.5, 4.0]]]]))


@pytest.mark.parametrize(
    "wrong, message",
    [
        (lambda kv, k, v, lam: lam[:, None, None] * kv.swapaxes(-1, -2) + v[..., :, None] * k[..., None, :],
         r"returned shape \(2, 3, 3, 5\), expected \(2, 3, 5, 3\) = \(batch, heads, d_k, d_v\): did you compute v_t\^T k_t\?"),
        (lambda kv, k, v, lam: kv + k[..., :, None] * v[..., None, :],
         r"equals KV_\(t-1\) \+ k_t\^T v_t: the old state must be multiplied by lambda"),
        (lambda kv, k, v, lam: lam[:, None, None] * (kv + k[..., :, None] * v[..., None, :]),
         r"only the old state decays"),
        (lambda kv, k, v, lam: lam * kv + k[..., :, None] * v[..., None, :],
         r"decay was multiplied along the last axis \(d_v = 3 happens to equal heads = 3\)"),
        (lambda kv, k, v, lam: None, r"returned None -- did you forget `return`\?"),
        (in_place_step, r"modified its input kv in place"),
        (lambda kv, k, v, lam: lam[:, None, None] * kv + k[..., :, None] * v[..., None, :] + (lam[:, None, None] < 0.5),
         r"differs from lambda KV_\(t-1\) \+ k_t\^T v_t in heads \[2\] of 3 \(their decay: \[0.05\]\)"),
    ],
    ids=["transposed", "no-decay", "decays-new-token", "decay-on-d_v", "none", "in-place", "one-head"],
)
def test_state_step_mistakes(wrong, message):
    with pytest.raises(ExerciseError, match=message):
        check_state_step(wrong)


def test_state_step_broadcast_error_is_explained():
    # decay[:, None] against (batch, heads, d_k, d_v) fails to broadcast when d_k != heads.
    with pytest.raises(ExerciseError, match=r"raised ValueError: .*Hint: .*decay\[:, None, None\]"):
        check_state_step(lambda kv, k, v, lam: lam[:, None] * kv + k[..., :, None] * v[..., None, :])


def test_state_step_transposed_outer_with_square_state(monkeypatch):
    # With d_k == d_v the shapes agree, so only the values can tell k^T v from v^T k.
    from lightning_edu.exercises import ch00

    def transposed(kv, k, v, lam):
        return lam[:, None, None] * kv + v[..., :, None] * k[..., None, :]

    monkeypatch.setattr(ch00, "_STEP_SHAPES", [(1, 3, 4, 4)])
    with pytest.raises(ExerciseError, match=r"adds v_t\^T k_t: the outer product must be k_t\^T v_t"):
        check_state_step(transposed)


# ---------------------------------------------------------------- 0.3


def test_block_lengths_solution_passes(capsys):
    check_block_lengths(lambda n, B: [min(B, n - s) for s in range(0, n, B)])
    assert capsys.readouterr().out.startswith("Correct: block lengths right on 7")


def test_block_lengths_reference_by_hand():
    # The reference comes from the package's own split; pin it to hand-written answers.
    from lightning_edu.numpy_blockwise import block_slices

    assert [s.stop - s.start for s in block_slices(130, 64)] == [64, 64, 2]
    assert [s.stop - s.start for s in block_slices(1, 64)] == [1]
    assert [s.stop - s.start for s in block_slices(37, 5)] == [5] * 7 + [2]


@pytest.mark.parametrize(
    "wrong, message",
    [
        (lambda n, B: [B] * (n // B), r"block_lengths\(130, 64\) = \[64, 64\] covers 128 of 130 tokens: .*T = ceil\(n/B\) = 3 blocks and the last one holds the remaining 2"),
        (lambda n, B: [B] * math.ceil(n / B), r"block_lengths\(130, 64\) = \[64, 64, 64\]: the last block is shorter \(2 tokens\)"),
        (lambda n, B: None, r"returned None"),
        (lambda n, B: 3, r"must return a list of ints, got 3"),
        (lambda n, B: [n], r"block_lengths\(130, 64\) = \[130\], expected \[64, 64, 2\] \(T = ceil\(130/64\) = 3 blocks\)"),
    ],
    ids=["floor", "padded", "none", "not-a-list", "one-block"],
)
def test_block_lengths_mistakes(wrong, message):
    with pytest.raises(ExerciseError, match=message):
        check_block_lengths(wrong)
