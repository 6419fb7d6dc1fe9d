"""Planted mistakes that the checks once answered with the wrong diagnosis: each now gets a message naming it.

(8.1's sweep in the wrong direction is in test_exercises_ch07_08.py, 3.3's unguarded closed form in
test_exercises_ch01_03.py, NaN answers to 6.2 in test_exercises_ch06.py.)
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from lightning_edu.exercises import ExerciseError
from lightning_edu.exercises.ch01 import check_normalized_linear_attention, check_right_product
from lightning_edu.exercises.ch03 import check_decayed_recurrence
from lightning_edu.exercises.ch04 import check_blockwise_attention
from lightning_edu.exercises.ch06 import check_inter_block_dq, check_inter_block_outputs


def _message(check, fn) -> str:
    with pytest.raises(ExerciseError) as info:
        check(fn)
    return str(info.value)


# ---------------------------------------------------------------- 1.1: n^2 work without n^2 memory


def row_by_row_left_product(q, k, v):
    out = np.empty(q.shape[:-1] + (v.shape[-1],))
    for i in range(q.shape[2]):
        scores = q[:, :, i, None, :] @ k.swapaxes(-1, -2)  # (batch, heads, 1, n): one row of Q K^T
        out[:, :, i] = (scores @ v)[:, :, 0]
    return out


def test_a_row_by_row_left_product_is_caught_by_its_time():
    message = _message(check_right_product, row_by_row_left_product)
    assert "its time grows like n^2" in message and "Form K^T V once" in message


def row_by_row_normalized(q, k, v):
    from lightning_edu.numpy_reference import elu_plus_one

    pq, pk = elu_plus_one(q), elu_plus_one(k)
    out = np.empty(q.shape[:-1] + (v.shape[-1],))
    for i in range(q.shape[2]):
        w = pq[:, :, i, None, :] @ pk.swapaxes(-1, -2)  # (batch, heads, 1, n): one row of the weights
        out[:, :, i] = (w @ v)[:, :, 0] / w.sum(-1)
    return out


def test_1_3_a_row_by_row_normalised_attention_is_caught_by_its_time():
    message = _message(check_normalized_linear_attention, row_by_row_normalized)
    assert "normalized_linear_attention" in message and "its time grows like n^2" in message
    assert "Form S = phi(K)^T V" in message


def test_a_row_loop_over_the_right_product_is_linear_and_passes(capsys):
    def rows_of_the_right_product(q, k, v):
        kv = k.swapaxes(-1, -2) @ v
        return np.stack([(q[:, :, i, None, :] @ kv)[:, :, 0] for i in range(q.shape[2])], axis=2)

    check_right_product(rows_of_the_right_product)
    assert "Correct" in capsys.readouterr().out


def test_the_time_check_counts_work_not_waiting(capsys):
    # A grader's machine is shared: while another process holds the core, a call waits. The check times CPU
    # work, so a linear answer that waits at the long length (here: sleeps, as a preempted call would) passes,
    # and the row loop, whose work is quadratic, is caught whatever the wall clock says.
    def waits_at_the_long_length(q, k, v):
        if q.shape[2] > 1000:
            time.sleep(0.2)  # 0.2 s of wall time: against ~1 ms at n = 256 that is a ratio far above the limit
        return q @ (k.swapaxes(-1, -2) @ v)

    check_right_product(waits_at_the_long_length)
    assert "Correct" in capsys.readouterr().out
    assert "its time grows like n^2" in _message(check_right_product, row_by_row_left_product)


# ---------------------------------------------------------------- 3.2: powers counted from the start, lambda^2


def _recurrence(q, k, v, decay, *, step=None, weight=None):
    lam = np.asarray(decay)[None, :, None, None]
    kv = np.zeros(q.shape[:2] + (q.shape[-1], v.shape[-1]))
    o = np.empty(q.shape[:-1] + (v.shape[-1],))
    for t in range(q.shape[2]):
        a = lam if step is None else step(lam, t)
        w = 1.0 if weight is None else weight(lam, t)
        kv = a * kv + w * (k[:, :, t, :, None] * v[:, :, t, None, :])
        o[:, :, t] = np.einsum("bhk,bhkv->bhv", q[:, :, t], kv)
    return o


@pytest.mark.parametrize("wrong, words", [
    (lambda q, k, v, d: _recurrence(q, k, v, d, step=lambda lam, t: lam**t), "lambda^t at step t"),
    (lambda q, k, v, d: _recurrence(q, k, v, d, step=lambda lam, t: lam ** (t + 1)), "lambda^t at step t"),
    (lambda q, k, v, d: _recurrence(q, k, v, d, step=lambda lam, t: 1.0, weight=lambda lam, t: lam**t),
     "weight lambda^s, counted from the start"),
    (lambda q, k, v, d: _recurrence(q, k, v, d, step=lambda lam, t: lam**2), "lambda^2 per step"),
], ids=["lambda^t-per-step", "lambda^(t+1)-per-step", "lambda^s-from-the-start", "lambda^2-per-step"])
def test_decay_counted_wrongly_is_named_not_blamed_on_broadcasting(wrong, words):
    message = _message(check_decayed_recurrence, wrong)
    assert words in message, message
    assert "broadcast" not in message, message


def test_decay_per_batch_instead_of_per_head_is_named():
    def per_batch(q, k, v, decay):  # decay[:, None, None, None] lines up with the batch axis
        lam = np.asarray(decay)[:, None, None, None]
        kv = np.zeros(q.shape[:2] + (q.shape[-1], v.shape[-1]))
        o = np.empty(q.shape[:-1] + (v.shape[-1],))
        for t in range(q.shape[2]):
            kv = lam * kv + k[:, :, t, :, None] * v[:, :, t, None, :]
            o[:, :, t] = np.einsum("bhk,bhkv->bhv", q[:, :, t], kv)
        return o

    with pytest.raises(ExerciseError):  # case 1 (batch 1, three heads) cannot broadcast: a shape error is reported
        check_decayed_recurrence(per_batch)


# ---------------------------------------------------------------- 4.3: the keys' decay, NaN answers


def _algorithm1(q, k, v, lam, block, *, k_scale=True):
    out = np.empty((len(q), v.shape[1]))
    kv = np.zeros((q.shape[1], v.shape[1]))
    for start in range(0, len(q), block):
        qi, ki, vi = q[start:start + block], k[start:start + block], v[start:start + block]
        b = len(qi)
        r = np.arange(b)
        gap = r[:, None] - r[None, :]
        mask = np.where(gap >= 0, lam ** np.maximum(gap, 0), 0.0)
        out[start:start + b] = ((qi @ ki.T) * mask) @ vi + (lam ** (r + 1)[:, None] * qi) @ kv
        scale = lam ** (b - 1 - r)[:, None] if k_scale else 1.0
        kv = lam**b * kv + (scale * ki).T @ vi
    return out


def test_a_forgotten_key_scale_is_named_not_blamed_on_the_inter_factor():
    message = _message(check_blockwise_attention, lambda q, k, v, lam, b: _algorithm1(q, k, v, lam, b, k_scale=False))
    assert "leaves out the keys' decay (k_scale)" in message, message
    assert "lambda^(r+1) on the queries is right" in message


def test_an_all_nan_answer_is_called_nan_not_an_inter_part_mistake():
    message = _message(check_blockwise_attention, lambda q, k, v, lam, b: np.full((len(q), v.shape[1]), np.nan))
    assert "contains NaN in block 0 first" in message and "inter part" not in message, message


def test_a_mistake_in_4_1_does_not_cost_4_3(capsys):
    # 4.3's check runs the reader's function with the book's intra_block and update_state in their place.
    namespace = {"np": np}
    exec(  # noqa: S102 - a reader's notebook namespace, with a wrong 4.1 and a right 4.3 that calls it
        "def intra_block(q, k, v, decay):\n"
        "    return (q @ k.T) @ v\n"
        "def update_state(kv, k, v, decay):\n"
        "    b = len(k)\n"
        "    return decay**b * kv + (decay ** (b - 1 - np.arange(b))[:, None] * k).T @ v\n"
        "def blockwise_attention(q, k, v, decay, block_size):\n"
        "    out, kv = np.empty((len(q), v.shape[1])), np.zeros((q.shape[1], v.shape[1]))\n"
        "    for s in range(0, len(q), block_size):\n"
        "        rows = slice(s, min(s + block_size, len(q)))\n"
        "        r = np.arange(rows.stop - s)[:, None]\n"
        "        out[rows] = intra_block(q[rows], k[rows], v[rows], decay) + (decay ** (r + 1) * q[rows]) @ kv\n"
        "        kv = update_state(kv, k[rows], v[rows], decay)\n"
        "    return out\n",
        namespace,
    )
    wrong_intra = namespace["intra_block"]
    check_blockwise_attention(namespace["blockwise_attention"])
    assert "Correct" in capsys.readouterr().out
    assert namespace["intra_block"] is wrong_intra  # put back after the check


# ---------------------------------------------------------------- 6.1, 6.3: NaN answers


@pytest.mark.parametrize("check, shape_of", [
    (check_inter_block_outputs, lambda a, s, lam: a.shape[:-1] + (s.shape[-1],)),
    (check_inter_block_dq, lambda a, s, lam: a.shape[:-1] + (s.shape[-2],)),
], ids=["6.1", "6.3"])
def test_nan_answers_to_chapter_06_name_the_block(check, shape_of):
    def nan_from_block_2(a, s, lam):
        out = torch.zeros(shape_of(a, s, lam), dtype=torch.float64)
        out[:, :, 2:] = float("nan")
        return out

    message = _message(check, nan_from_block_2)
    assert "contains NaN in block 2 first" in message, message
