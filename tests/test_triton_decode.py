"""The Triton decode-step kernel (lightning_edu.triton_kernels.decode) in the CPU interpreter against float64:
odd head dims, several state slices per head, in place, 16-bit inputs, non-finite values per head."""

import numpy as np
import pytest
import torch

from lightning_edu.checks import relative_error
from lightning_edu.triton_kernels import log2_decay_tensor
from lightning_edu.triton_kernels.decode import decode_step


def _case(batch, heads, d_k, d_v, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((batch, heads, d_k)), rng.standard_normal((batch, heads, d_k)),
            rng.standard_normal((batch, heads, d_v)), rng.standard_normal((batch, heads, d_k, d_v)))


def _reference(q, k, v, state, decay):
    lam = np.asarray(decay, dtype=np.float64)[None, :, None, None]
    new = k[..., :, None] * v[..., None, :] + (0.0 if state is None else lam * state)
    return np.einsum("bhk,bhkv->bhv", q, new), new


@pytest.mark.parametrize("shape,block_v", [((2, 3, 5, 7), None), ((1, 2, 64, 128), None), ((1, 1, 16, 300), 64),
                                            ((3, 1, 1, 1), None)])
@pytest.mark.parametrize("with_state", [True, False])
def test_decode_step_matches_float64(shape, block_v, with_state):
    q, k, v, s = _case(*shape, seed=sum(shape))
    decay = [0.9, 1.0, 1e-3][: shape[1]]
    s = s if with_state else None
    o_ref, s_ref = _reference(q, k, v, s, decay)
    t = lambda x: None if x is None else torch.tensor(x, dtype=torch.float32)  # noqa: E731
    o, new = decode_step(t(q), t(k), t(v), t(s), log2_decay_tensor(decay, "cpu"), block_v=block_v)
    assert o.dtype == torch.float32 and new.dtype == torch.float32 and new.shape == s_ref.shape
    assert relative_error(new, s_ref) < 1e-6 and relative_error(o, o_ref) < 1e-6


def test_decode_step_in_place_overwrites_the_given_state():
    q, k, v, s = _case(2, 2, 16, 48, seed=1)
    o_ref, s_ref = _reference(q, k, v, s, [0.5, 0.99])
    state = torch.tensor(s, dtype=torch.float32)
    o, new = decode_step(*(torch.tensor(x, dtype=torch.float32) for x in (q, k, v)), state,
                         log2_decay_tensor([0.5, 0.99], "cpu"), out_state=state, block_v=16)
    assert new.data_ptr() == state.data_ptr()
    assert relative_error(state, s_ref) < 1e-6 and relative_error(o, o_ref) < 1e-6


def test_decode_step_in_fp16_keeps_an_fp32_state():
    q, k, v, s = _case(1, 2, 32, 32, seed=2)
    t = [torch.tensor(x, dtype=torch.float16) for x in (q, k, v)]
    o_ref, s_ref = _reference(*(x.double().numpy() for x in t), s, [0.9, 0.9])
    o, new = decode_step(*t, torch.tensor(s, dtype=torch.float32), log2_decay_tensor([0.9, 0.9], "cpu"))
    assert o.dtype == torch.float16 and new.dtype == torch.float32
    assert relative_error(new, s_ref) < 1e-6 and relative_error(o, o_ref) < 3e-3


def test_a_nan_in_one_head_stays_in_that_head():
    q, k, v, s = _case(1, 3, 8, 8, seed=3)
    k[0, 1, 2] = np.nan
    o, new = decode_step(*(torch.tensor(x, dtype=torch.float32) for x in (q, k, v, s)), log2_decay_tensor([0.9] * 3, "cpu"))
    assert torch.isfinite(o[0, [0, 2]]).all() and torch.isfinite(new[0, [0, 2]]).all()
    assert torch.isnan(o[0, 1]).all() and torch.isnan(new[0, 1, 2]).all() and torch.isfinite(new[0, 1, [0, 1, 3]]).all()


def test_decode_step_refuses_bf16_in_the_interpreter():
    x = torch.zeros(1, 1, 16, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="bfloat16"):
        decode_step(x, x, x, None, torch.zeros(1))
