"""Packed variable-length batches (lightning_edu.packed, ``cu_seqlens``): equal to one call per sequence on every
backend, forward and backward; nothing crosses a boundary, at every boundary position; bad boundaries refused."""

import numpy as np
import pytest
import torch

import lightning_edu as le
from lightning_edu.checks import relative_error

HEADS, D_K, D_V = 2, 5, 3
DECAY = [0.9, 1.0]
BACKENDS = {  # backend -> (array converter, tolerance)
    "numpy": (lambda x: x, 1e-12),
    "torch": (lambda x: torch.tensor(x, dtype=torch.float64), 1e-12),
    "triton": (lambda x: torch.tensor(x, dtype=torch.float32), 1e-5),
}


def _packed(cu, seed=0):
    rng = np.random.default_rng(seed)
    total, seqs = cu[-1], len(cu) - 1
    q, k = rng.standard_normal((1, HEADS, total, D_K)), rng.standard_normal((1, HEADS, total, D_K))
    v, do = rng.standard_normal((1, HEADS, total, D_V)), rng.standard_normal((1, HEADS, total, D_V))
    s0, dsn = rng.standard_normal((seqs, HEADS, D_K, D_V)), rng.standard_normal((seqs, HEADS, D_K, D_V))
    return q, k, v, do, s0, dsn


def _np(x):
    return x if isinstance(x, np.ndarray) else x.detach().double().cpu().numpy()


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("cu", [[0, 4, 4, 11, 12], [0, 0, 7], [0, 20], [0, 1, 2, 3, 3]], ids=str)
@pytest.mark.parametrize("with_state", [True, False])
def test_packed_call_equals_one_call_per_sequence(backend, cu, with_state):
    conv, tol = BACKENDS[backend]
    q, k, v, do, s0, dsn = _packed(cu, seed=len(cu))
    s0 = s0 if with_state else None
    t = lambda x: None if x is None else conv(x)  # noqa: E731
    o, states = le.lightning_attention(t(q), t(k), t(v), DECAY, backend=backend, initial_state=t(s0),
                                       return_state=True, cu_seqlens=cu)
    grads = le.lightning_attention_backward(t(q), t(k), t(v), t(do), DECAY, backend=backend, initial_state=t(s0),
                                            d_final_state=t(dsn), return_state_grad=True, cu_seqlens=cu)
    assert tuple(o.shape) == (1, HEADS, cu[-1], D_V) and tuple(states.shape) == (len(cu) - 1, HEADS, D_K, D_V)
    for i in range(len(cu) - 1):
        a, b = cu[i], cu[i + 1]
        init = None if s0 is None else s0[i : i + 1]
        if a == b:  # no tokens: the state passes through, and so does its gradient
            assert np.allclose(_np(states[i]), 0.0 if init is None else init[0])
            assert np.allclose(_np(grads[3][i]), dsn[i])
            continue
        rows = slice(a, b)
        ref_o, ref_s = le.lightning_attention(q[:, :, rows], k[:, :, rows], v[:, :, rows], DECAY, initial_state=init,
                                              return_state=True)
        ref_g = le.lightning_attention_backward(q[:, :, rows], k[:, :, rows], v[:, :, rows], do[:, :, rows], DECAY,
                                                initial_state=init, d_final_state=dsn[i : i + 1],
                                                return_state_grad=True)
        assert relative_error(o[:, :, rows], ref_o) < tol and relative_error(states[i : i + 1], ref_s) < tol
        for got, want in zip((grads[0][:, :, rows], grads[1][:, :, rows], grads[2][:, :, rows], grads[3][i : i + 1]),
                             ref_g):
            assert relative_error(got, want) < tol


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_autograd_through_a_packed_call_equals_per_sequence_gradients(backend):
    conv, tol = BACKENDS[backend]
    cu = [0, 6, 6, 13]
    q, k, v, do, s0, _ = _packed(cu, seed=3)
    leaves = [conv(x).requires_grad_() for x in (q, k, v, s0)]
    o, states = le.lightning_attention(*leaves[:3], DECAY, backend=backend, initial_state=leaves[3], return_state=True,
                                       cu_seqlens=torch.tensor(cu))
    (o * conv(do)).sum().backward()
    ref = le.lightning_attention_backward(q, k, v, do, DECAY, initial_state=s0, return_state_grad=True, cu_seqlens=cu)
    for leaf, want in zip(leaves, ref):
        assert relative_error(leaf.grad, want) < tol


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_nothing_crosses_a_boundary_at_any_position(backend):
    """Two sequences split at every position of 10 tokens; a NaN on the last token of the first one (in q, k,
    v and do) must leave every output, state and gradient of the second finite and equal to its own call."""
    conv, tol = BACKENDS[backend]
    n = 10
    for split in range(1, n):
        cu = [0, split, n]
        q, k, v, do, s0, dsn = _packed(cu, seed=split)
        for x in (q, k, v, do):
            x[0, 0, split - 1, 0] = np.nan
        o, states = le.lightning_attention(conv(q), conv(k), conv(v), DECAY, backend=backend, initial_state=conv(s0),
                                           return_state=True, cu_seqlens=cu)
        dq, dk, dv, ds0 = le.lightning_attention_backward(conv(q), conv(k), conv(v), conv(do), DECAY, backend=backend,
                                                          initial_state=conv(s0), d_final_state=conv(dsn),
                                                          return_state_grad=True, cu_seqlens=cu)
        second = slice(split, n)
        ref_o = le.lightning_attention(q[:, :, second], k[:, :, second], v[:, :, second], DECAY, initial_state=s0[1:])
        assert np.isnan(_np(o[0, 0, split - 1])).any(), f"split {split}: the NaN did not reach its own row"
        for name, x in (("o", o[:, :, second]), ("state", states[1]), ("dq", dq[:, :, second]),
                        ("dk", dk[:, :, second]), ("dv", dv[:, :, second]), ("d_initial_state", ds0[1])):
            assert np.isfinite(_np(x)).all(), f"split {split}: {name} of the second sequence is not finite"
        assert relative_error(o[:, :, second], ref_o) < tol, f"split {split}"


BAD = [
    ([1, 12], ValueError, "start at 0"),
    ([0, 7, 5, 12], ValueError, "never decrease"),
    ([0, 11], ValueError, "end at the packed length 12"),
    ([0], ValueError, "at least 2 boundaries"),
    (np.array([[0, 12]]), ValueError, "1-D"),
    ([[0, 12]], ValueError, "1-D"),
    ([0.0, 12.0], TypeError, "integers"),
    (np.array([0.0, 12.0]), TypeError, "integers"),
    (torch.tensor([0.0, 12.0]), TypeError, "integers"),
    ([0, True], TypeError, "integers"),
    ("0,12", TypeError, "cu_seqlens must be"),
    (torch.tensor([0, 12], device="meta"), ValueError, "synchronise"),
]


@pytest.mark.parametrize("cu,error,message", BAD, ids=[str(b[0]).replace("\n", "") for b in BAD])
def test_bad_cu_seqlens_is_refused_with_the_rule_it_breaks(cu, error, message):
    q, k, v, *_ = _packed([0, 12])
    with pytest.raises(error, match=message):
        le.lightning_attention(q, k, v, DECAY, cu_seqlens=cu)


def test_packed_shapes_are_checked():
    q, k, v, do, s0, dsn = _packed([0, 5, 12])
    with pytest.raises(ValueError, match="one batch row"):
        le.lightning_attention(np.concatenate([q, q]), np.concatenate([k, k]), np.concatenate([v, v]), DECAY,
                               cu_seqlens=[0, 5, 12])
    with pytest.raises(ValueError, match=r"initial_state must have shape \(2, 2, 5, 3\)"):
        le.lightning_attention(q, k, v, DECAY, cu_seqlens=[0, 5, 12], initial_state=s0[:1])
    with pytest.raises(ValueError, match=r"d_final_state must have shape \(2, 2, 5, 3\)"):
        le.lightning_attention_backward(q, k, v, do, DECAY, cu_seqlens=[0, 5, 12], d_final_state=dsn[:1])
