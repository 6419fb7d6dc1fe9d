"""Each printed slip in lightning_edu.errata is really wrong, and each corrected form really right.

The judge is computed here, independently of the package: torch float64 autograd through a token-by-token
recurrent loop (not the quadratic form that errata.autograd_gradients uses, not the blockwise code).
"""

import numpy as np
import pytest
import torch

from lightning_edu import errata

N_BLOCKS = 4


def judge(q, k, v, do, lam, initial_state=None):
    """dq, dk, dv, d initial_state of L = <o, do> by autograd through KV_t = lam KV_{t-1} + k_t^T v_t; plus o."""
    qt, kt, vt = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v))
    s0 = torch.zeros(q.shape[1], v.shape[1], dtype=torch.float64) if initial_state is None else torch.tensor(initial_state)
    s0.requires_grad_(True)
    kv, rows = s0, []
    for t in range(q.shape[0]):
        kv = lam * kv + torch.outer(kt[t], vt[t])
        rows.append(qt[t] @ kv)
    o = torch.stack(rows)
    (o * torch.tensor(do)).sum().backward()
    return qt.grad.numpy(), kt.grad.numpy(), vt.grad.numpy(), s0.grad.numpy(), o.detach().numpy()


def rel(a, b):
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or not np.all(np.isfinite(a)):
        return np.inf
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def head(n, d_k=5, d_v=3, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, d_k)), rng.standard_normal((n, d_k)), rng.standard_normal((n, d_v)), rng.standard_normal((n, d_v))


@pytest.mark.parametrize("erratum", errata.ERRATA, ids=lambda e: e.key)
def test_literal_is_wrong_and_corrected_is_right(erratum):
    B = erratum.block_size
    q, k, v, do = head(N_BLOCKS * B if B < 64 else 2 * B, seed=3)
    dq, dk, dv, _, o = judge(q, k, v, do, erratum.decay)
    truth = {"dq": dq, "dk": dk, "dv": dv, "o": o}[erratum.compares]
    with np.errstate(all="ignore"):
        literal = erratum.literal(q, k, v, do, erratum.decay, B)
    corrected = erratum.corrected(q, k, v, do, erratum.decay, B)
    assert rel(literal, truth) > 1e-3, f"{erratum.key}: the printed form is not wrong here"
    assert rel(corrected, truth) < 1e-12, f"{erratum.key}: the corrected form is off"


def test_exponent_slips_are_invisible_without_decay():
    # why tests at lambda = 1 never catch eqs. 16 and 18: every power of 1 is 1
    q, k, v, do = head(16, seed=1)
    _, dk, dv, _, _ = judge(q, k, v, do, 1.0)
    assert rel(errata.dk_eq16(q, k, v, do, 1.0, 4, "printed"), dk) < 1e-12
    assert rel(errata.dv_eq18(q, k, v, do, 1.0, 4, "printed"), dv) < 1e-12


def test_eq11_eq12_token_gradients_are_right():
    q, k, v, do = head(13, seed=2)
    for lam in (1.0, 0.7):
        truth = judge(q, k, v, do, lam)[:3]
        for mine, ref in zip(errata.eq11_eq12_token_gradients(q, k, v, do, lam), truth):
            assert rel(mine, ref) < 1e-12


def test_eq13_definition_is_the_gradient_of_the_carried_state():
    # dKV_t must be dL/dKV_t with KV_t the state carried into block t+1: the gradient of the initial state of
    # the suffix s > tB, by autograd on that suffix alone.
    B, lam = 4, 0.8
    q, k, v, do = head(4 * B, seed=4)
    definition = errata.eq13_dkv_definition(q, do, lam, B)
    corrected = errata.eq20_dkv_recursion_corrected(q, do, lam, B)
    printed = errata.eq20_dkv_recursion(q, do, lam, B)
    for t in range(4):
        suffix = slice(t * B, None)
        truth = judge(q[suffix], k[suffix], v[suffix], do[suffix], lam, np.zeros((5, 3)))[3]
        assert rel(definition[t], truth) < 1e-12
        assert rel(corrected[t], truth) < 1e-12
        if t >= 1:
            assert rel(printed[t], truth) > 1e-3  # the printed recursion is one block off ...
            assert rel(printed[t], judge(q[(t - 1) * B :], k[(t - 1) * B :], v[(t - 1) * B :], do[(t - 1) * B :], lam, np.zeros((5, 3)))[3]) < 1e-12
    assert np.allclose(definition[4], 0.0)  # ... and dKV_T is already the empty sum


def test_eq18_second_line_has_the_wrong_shape():
    q, k, v, do = head(8, d_k=5, d_v=3)
    assert errata.dv_eq18_literal(q, k, v, do, 0.9, 4, t=1, r=2).shape == (5, 3)  # a matrix, not a row of dv


def test_algorithm2_as_printed_is_right_and_eq9_lambda_only_moves_the_states():
    B, lam = 4, 0.9
    q, k, v, do = head(3 * B, seed=5)
    dq, dk, dv, d_state, _ = judge(q, k, v, do, lam, np.zeros((5, 3)))
    right = errata.algorithm2(q, k, v, do, lam, B, "algorithm", "literal", return_states=True)
    eq9 = errata.algorithm2(q, k, v, do, lam, B, "eq9", "direct", return_states=True)
    for mine in (right, eq9):
        for got, ref in zip(mine[:3], (dq, dk, dv)):
            assert rel(got, ref) < 1e-12
    assert rel(right[4], d_state) < 1e-12
    assert rel(eq9[4], d_state) > 0.1 - 1e-9 and rel(lam * eq9[4], d_state) < 1e-12  # off by 1/lambda


def test_literal_inverse_overflows_only_when_lambda_to_the_B_underflows():
    q, k, v, do = head(512, seed=6)
    with np.errstate(all="ignore"):
        bad = errata.algorithm2(q, k, v, do, 0.05, 256, inverse="literal")[1]
        fine = errata.algorithm2(q, k, v, do, 0.9, 256, inverse="literal")[1]
    assert np.isnan(bad).any()
    assert np.all(np.isfinite(fine))


def test_la3_finished_backward_is_right():
    q, k, v, do = head(24, seed=7)
    truth = judge(q, k, v, do, 1.0)[:3]
    for got, ref in zip(errata.la3_backward(q, k, v, do, 8, 4, dq="finished", dkv_order="corrected"), truth):
        assert rel(got, ref) < 1e-12


def test_la3_memory_table_is_off_by_the_block_tiles():
    table = errata.la3_current_buffer_table()
    assert table["q, k, v"] == (12 * 1024, 3 * 64 * 64 * 4)
    assert table["total"][1] == 160 * 1024  # vs ~76 KB printed


def test_la3_micro_table_is_right_but_leaves_out_the_state():
    table = errata.la3_micro_buffer_table()
    assert table["total"][0] == 30 * 1024  # the note's 30 KB: seven 4 KB tiles and two 1 KB tiles
    assert all(printed == true for name, (printed, true) in table.items() if "left out" not in name and name != "total")
    assert table["state (left out)"] == (0, 16 * 1024)  # 64 x 64 fp32
    assert table["state as a dot operand (left out)"] == (0, 8 * 1024)
    assert table["total"][1] == 54 * 1024
    assert errata.la3_micro_buffer_table(CBLOCK=16, d=128)["state (left out)"][1] == 64 * 1024


def test_evidence_reports_both_errors():
    row = errata.evidence(errata.ERRATA[0])
    assert row["literal"] > 1e-3 and row["corrected"] < 1e-12 and row["nonfinite"] == 0


def test_literal_functions_refuse_blocks_that_do_not_divide_n():
    q, k, v, do = head(10)
    with pytest.raises(ValueError, match="B divides n"):
        errata.dk_eq17(q, k, v, do, 0.9, 4)


@pytest.mark.parametrize(
    "call",
    [
        lambda a: errata.dk_eq16(*a, 0.9, 4, exponent="typo"),
        lambda a: errata.dq_eq15(*a, 0.9, 4, r_range="1..b"),
        lambda a: errata.algorithm2(*a, 0.9, 4, inverse="inverse"),
        lambda a: errata.la3_backward(*a, 4, 2, dq="done"),
    ],
)
def test_an_unknown_option_is_refused_not_read_as_the_corrected_form(call):
    rng = np.random.default_rng(0)
    args = [rng.standard_normal((1, 1, 8, 3)) for _ in range(4)]
    with pytest.raises(ValueError, match=r"must be one of \("):
        call(args)
