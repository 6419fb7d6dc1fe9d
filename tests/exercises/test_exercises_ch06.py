"""Chapter 06 exercise checks: the model solutions pass, typical mistakes get a message that names them."""

from __future__ import annotations

import pytest
import torch

from lightning_edu.exercises import ExerciseError
from lightning_edu.exercises import ch06


def _q_scale(lam, block, offset=1):
    return (lam[:, None] ** (torch.arange(block, dtype=torch.float64) + offset)[None, :])[:, None, :, None]


def inter_right(qb, states, lam):
    return (_q_scale(lam, qb.shape[3]) * qb) @ states


def inter_lambda_r(qb, states, lam):
    return (_q_scale(lam, qb.shape[3], offset=0) * qb) @ states


def inter_no_decay(qb, states, lam):
    return qb @ states


def inter_next_state(qb, states, lam):
    return (_q_scale(lam, qb.shape[3]) * qb) @ states.roll(-1, dims=2)


def inter_none(qb, states, lam):
    inter_right(qb, states, lam)  # forgot to return


def scan_right(local, block_decay, initial):
    states = [initial]
    for i in range(local.shape[2]):
        states.append(block_decay[:, i, None, None] * states[-1] + local[:, :, i])
    return torch.stack(states, dim=2)


def scan_without_initial(local, block_decay, initial):
    return scan_right(local, block_decay, initial)[:, :, 1:]


def scan_decays_local(local, block_decay, initial):
    states = [initial]
    for i in range(local.shape[2]):
        states.append(block_decay[:, i, None, None] * (states[-1] + local[:, :, i]))
    return torch.stack(states, dim=2)


def scan_no_decay(local, block_decay, initial):
    return scan_right(local, torch.ones_like(block_decay), initial)


def scan_last_block_full(local, block_decay, initial):
    full = block_decay.clone()
    full[:, -1] = block_decay[:, 0]  # every block decays like a full one
    return scan_right(local, full, initial)


def scan_zero_start(local, block_decay, initial):
    return scan_right(local, block_decay, torch.zeros_like(initial))


def dq_right(dob, states, lam):
    return _q_scale(lam, dob.shape[3]) * (dob @ states.transpose(-1, -2))


def dq_untransposed(dob, states, lam):
    return _q_scale(lam, dob.shape[3]) * (dob @ states)


def dq_lambda_r(dob, states, lam):
    return _q_scale(lam, dob.shape[3], offset=0) * (dob @ states.transpose(-1, -2))


def dq_no_decay(dob, states, lam):
    return dob @ states.transpose(-1, -2)


def test_model_solutions_pass(capsys):
    ch06.check_inter_block_outputs(inter_right)
    ch06.check_state_scan(scan_right)
    ch06.check_inter_block_dq(dq_right)
    assert capsys.readouterr().out.count("Correct:") == 3


@pytest.mark.parametrize(
    "check, wrong, message",
    [
        (ch06.check_inter_block_outputs, inter_lambda_r, "lambda^(r+1)"),
        (ch06.check_inter_block_outputs, inter_no_decay, "ignores the decay"),
        (ch06.check_inter_block_outputs, inter_next_state, "used the state of block i + 1"),
        (ch06.check_inter_block_outputs, inter_none, "forget `return`"),
        (ch06.check_state_scan, scan_without_initial, "expected 6"),
        (ch06.check_state_scan, scan_decays_local, "you decayed L_i too"),
        (ch06.check_state_scan, scan_no_decay, "ignores block_decay"),
        (ch06.check_state_scan, scan_last_block_full, "the last block is shorter"),
        (ch06.check_state_scan, scan_zero_start, "entry 0 must be the initial state"),
        (ch06.check_inter_block_dq, dq_untransposed, "transpose the last two axes of states"),
        (ch06.check_inter_block_dq, dq_lambda_r, "scaled row r by lambda^r"),
        (ch06.check_inter_block_dq, dq_no_decay, "ignores the decay"),
    ],
)
def test_wrong_solutions_get_a_teaching_message(check, wrong, message):
    with pytest.raises(ExerciseError, match=message.replace("(", r"\(").replace(")", r"\)").replace("^", r"\^").replace("+", r"\+")):
        check(wrong)


def test_unrecognised_mistake_names_the_first_wrong_block():
    def off_in_block_3(local, block_decay, initial):
        states = scan_right(local, block_decay, initial).clone()
        states[:, :, 3:] += 1.0
        return states

    with pytest.raises(ExerciseError, match="state 3 \\(the one entering block 3\\) differs first"):
        ch06.check_state_scan(off_in_block_3)

    def inter_off_in_block_2(qb, states, lam):
        out = inter_right(qb, states, lam).clone()
        out[:, :, 2] *= 2
        return out

    with pytest.raises(ExerciseError, match="block 2 \\(rows 14-20\\)"):
        ch06.check_inter_block_outputs(inter_off_in_block_2)


def test_nan_answers_get_a_message_not_an_index_error():
    # A NaN compares as equal to nothing: both checkers once crashed with IndexError looking for the first
    # wrong block. Now NaN counts as wrong, and the message names where it starts.
    def scan_nan_from_block_2(local, block_decay, initial):
        states = scan_right(local, block_decay, initial).clone()
        states[:, :, 2:] = float("nan")
        return states

    with pytest.raises(ExerciseError, match="state 2 \\(the one entering block 2\\) holds NaN"):
        ch06.check_state_scan(scan_nan_from_block_2)

    def inter_all_nan(qb, states, lam):
        return torch.full_like(inter_right(qb, states, lam), float("nan"))

    with pytest.raises(ExerciseError, match="contains NaN"):
        ch06.check_inter_block_outputs(inter_all_nan)


def test_a_state_scan_that_divides_by_cumulative_decay_fails():
    # the "log-depth" rewrite S_i = P_i (S_0 + sum_j L_j / P_j): right while P_j stays representable
    def divided(local, block_decay, initial):
        cum = torch.cumprod(block_decay, dim=1)
        pre = torch.cat([torch.ones(block_decay.shape[0], 1, dtype=block_decay.dtype), cum], 1)
        states = pre[None, :, :, None, None] * initial[:, :, None]
        states[:, :, 1:] += cum[None, :, :, None, None] * torch.cumsum(local / cum[None, :, :, None, None], 2)
        return states

    with pytest.raises(ExerciseError, match="NaN or inf"):
        ch06.check_state_scan(divided)


def test_a_python_loop_over_the_blocks_is_named():
    def per_block(qb, states, lam):  # right values, one block at a time
        r = torch.arange(qb.shape[-2], dtype=lam.dtype)
        scale = lam[:, None, None] ** (r + 1)[None, :, None]
        return torch.stack([(scale * qb[:, :, i]) @ states[:, :, i] for i in range(qb.shape[2])], 2)

    with pytest.raises(ExerciseError, match="right values, but your code ran .* Python loop over the blocks"):
        ch06.check_inter_block_outputs(per_block)

    def per_block_dq(dob, states, lam):
        r = torch.arange(dob.shape[-2], dtype=lam.dtype)
        scale = lam[:, None, None] ** (r + 1)[None, :, None]
        return torch.stack([scale * (dob[:, :, i] @ states[:, :, i].transpose(-1, -2)) for i in range(dob.shape[2])], 2)

    with pytest.raises(ExerciseError, match="Python loop over the blocks"):
        ch06.check_inter_block_dq(per_block_dq)


def test_a_float32_buffer_is_named_as_such():
    def float32_buffer(local, block_decay, initial):  # torch.zeros makes float32 unless told otherwise
        b, h, nb, dk, dv = local.shape
        out = torch.zeros(b, h, nb + 1, dk, dv)
        out[:, :, 0] = initial
        for i in range(nb):
            out[:, :, i + 1] = block_decay[:, i, None, None] * out[:, :, i] + local[:, :, i]
        return out

    with pytest.raises(ExerciseError, match="is float32: the check compares with float64"):
        ch06.check_state_scan(float32_buffer)
