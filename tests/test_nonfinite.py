"""Causality holds for non-finite values too: a NaN or inf reaches exactly the outputs that depend on it.

A mask that multiplies (scores * M, with M = 0 above the diagonal) turns a NaN at a later token into
NaN x 0 = NaN in every earlier row of its block; a dense tile product P @ V does the same with a NaN in
a later row of V. Every backend and kernel variant is run here on inputs with one NaN or inf planted at
a random (tensor, batch, head, token, column), and the set of non-finite outputs must equal the set the
algebra says depends on it, element by element, forward and backward.

The expected sets are derived by hand from the formulas (not computed by the code under test):
o_r = sum_{s<=r} lambda^(r-s) (q_r . k_s) v_s + lambda^(r+1) q_r S0, and the gradients
dq_r = sum_{s<=r} lambda^(r-s) (do_r . v_s) k_s + ...,  dk_s = sum_{r>=s} lambda^(r-s) (do_r . v_s) q_r + ...,
dv_s = sum_{r>=s} lambda^(r-s) (q_r . k_s) do_r + ...,   dS0 = sum_t lambda^(t+1) q_t^T do_t + lambda^n dSN.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_edu import lightning_attention, lightning_attention_backward
from lightning_edu import numpy_reference as nr
from lightning_edu import torch_chunked as tc
from lightning_edu.checks import to_numpy
from lightning_edu.triton_kernels import VARIANTS, log2_decay_tensor
from lightning_edu.triton_kernels.la1 import la1_backward, la1_forward
from lightning_edu.triton_kernels.lookback import lookback_forward

# The kernels run on the GPU where there is one, else in Triton's CPU interpreter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# On a GPU the kernel tests below belong to the GPU suite too (``pytest -m gpu``, README).
gpu_too = pytest.mark.gpu if DEVICE == "cuda" else (lambda test: test)

# NaN and inf are the inputs here: numpy may warn about them, and that is expected.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def expected_nonfinite(where: str, b: int, h: int, s: int, c: int, shapes: dict) -> dict:
    """Which outputs depend on input ``where``[b, h, s, c], from the formulas in the module docstring."""
    e = {name: np.zeros(shape, dtype=bool) for name, shape in shapes.items()}
    if where == "q":  # o_s; dk_s'[c] and dv_s' for s' <= s (q_s meets every earlier key); dS0 row c
        e["o"][b, h, s, :] = True
        e["dk"][b, h, : s + 1, c] = True
        e["dv"][b, h, : s + 1, :] = True
        e["ds0"][b, h, c, :] = True
    elif where == "k":  # o_r and dq_r[c] for r >= s; row c of the final state; dv_s
        e["o"][b, h, s:, :] = True
        e["state"][b, h, c, :] = True
        e["dq"][b, h, s:, c] = True
        e["dv"][b, h, s, :] = True
    elif where == "v":  # o_r[c] for r >= s; column c of the final state; dq_r for r >= s; dk_s
        e["o"][b, h, s:, c] = True
        e["state"][b, h, :, c] = True
        e["dq"][b, h, s:, :] = True
        e["dk"][b, h, s, :] = True
    elif where == "do":  # dq_s; dk_s' and dv_s'[c] for s' <= s; column c of dS0
        e["dq"][b, h, s, :] = True
        e["dk"][b, h, : s + 1, :] = True
        e["dv"][b, h, : s + 1, c] = True
        e["ds0"][b, h, :, c] = True
    else:  # pragma: no cover - the strategy draws only the four names above
        raise AssertionError(where)
    return e


# ------------------------------------------------------------------------------------------------
# Every implementation, as run(q, k, v, do, s0, dsn, decay, block) -> {output name: float64 array}.
# Inputs arrive as float64 numpy arrays; each runner converts them to what it takes.


def _named(o=None, state=None, grads=None):
    out = {}
    if o is not None:
        out["o"] = to_numpy(o)
    if state is not None:
        out["state"] = to_numpy(state)
    if grads is not None:
        out.update({name: to_numpy(g) for name, g in zip(("dq", "dk", "dv", "ds0"), grads) if g is not None})
    return out


def run_numpy_backend(q, k, v, do, s0, dsn, decay, block):
    o, sn = lightning_attention(q, k, v, decay, backend="numpy", block_size=block, initial_state=s0, return_state=True)
    grads = lightning_attention_backward(q, k, v, do, decay, backend="numpy", block_size=block, initial_state=s0,
                                         d_final_state=dsn, return_state_grad=True)
    return _named(o, sn, grads)


def run_numpy_references(q, k, v, do, s0, dsn, decay, block):
    o, sn = nr.causal_linear_recurrent(q, k, v, decay, initial_state=s0, return_state=True)
    masked = nr.causal_linear_masked(q, k, v, decay)
    cumsum = nr.causal_linear_cumsum(q, k, v, decay)
    # Without an initial state the masked and cumsum forms must show the recurrence's pattern (S0 is finite).
    pattern = np.isfinite(nr.causal_linear_recurrent(q, k, v, decay))
    assert np.array_equal(np.isfinite(masked), pattern) and np.array_equal(np.isfinite(cumsum), pattern)
    return _named(o, sn)


def _torch_autograd(forward, q, k, v, do, s0, dsn, dtype, device="cpu"):
    leaves = [torch.tensor(x, dtype=dtype, device=device).requires_grad_() for x in (q, k, v, s0)]
    o, sn = forward(*leaves)
    torch.autograd.backward([o, sn], [torch.tensor(do, dtype=dtype, device=device), torch.tensor(dsn, dtype=sn.dtype, device=device)])
    return _named(o, sn, [leaf.grad for leaf in leaves])


def run_torch_backend(q, k, v, do, s0, dsn, decay, block):
    def forward(q_, k_, v_, s0_):
        return lightning_attention(q_, k_, v_, decay, backend="torch", block_size=block, initial_state=s0_, return_state=True)

    out = _torch_autograd(forward, q, k, v, do, s0, dsn, torch.float64)
    t = [torch.from_numpy(x) for x in (q, k, v, do, s0, dsn)]
    direct = lightning_attention_backward(*t[:4], decay, backend="torch", block_size=block, initial_state=t[4],
                                          d_final_state=t[5], return_state_grad=True)
    for name, g in _named(grads=direct).items():  # the public backward entry point agrees with autograd's
        assert np.array_equal(np.isfinite(g), np.isfinite(out[name])), name
    return out


def run_torch_forms(q, k, v, do, s0, dsn, decay, block):
    t = [torch.from_numpy(x) for x in (q, k, v, s0)]
    o, sn = tc.loop_forward(*t[:3], decay, block, initial_state=t[3])
    for other, _ in (tc.recurrent_forward(*t[:3], decay, initial_state=t[3]),
                     tc.chunked_forward(*t[:3], decay, block, initial_state=t[3], scan="log")):
        assert np.array_equal(np.isfinite(to_numpy(other)), np.isfinite(to_numpy(o)))
    plain = np.isfinite(to_numpy(tc.recurrent_forward(*t[:3], decay)[0]))
    assert np.array_equal(np.isfinite(to_numpy(tc.masked_forward(*t[:3], decay))), plain)
    return _named(o, sn)


def run_triton_backend(q, k, v, do, s0, dsn, decay, block):
    def forward(q_, k_, v_, s0_):
        return lightning_attention(q_, k_, v_, decay, backend="triton", block_size=16, initial_state=s0_, return_state=True)

    return _torch_autograd(forward, q, k, v, do, s0, dsn, torch.float32, DEVICE)


def _variant_runner(name, dtype=torch.float32, **options):
    def run(q, k, v, do, s0, dsn, decay, block):
        forward, backward = VARIANTS[name]
        t = [torch.tensor(x, dtype=dtype, device=DEVICE) for x in (q, k, v, do)]
        t += [torch.tensor(x, dtype=torch.float32, device=DEVICE) for x in (s0, dsn)]  # states are float32
        l2 = log2_decay_tensor(decay, DEVICE)
        fwd_options = {key: val for key, val in options.items() if key == "seg_len"}
        o, sn = forward(*t[:3], l2, t[4], block=16, **fwd_options)
        grads = backward(*t[:4], l2, t[4], t[5], block=16, **options)
        return _named(o, sn, grads)

    return run


def run_la1(q, k, v, do, s0, dsn, decay, block):
    t = [torch.tensor(x, dtype=torch.float32, device=DEVICE) for x in (q, k, v, do)]
    o = la1_forward(*t[:3], decay, block_size=16)
    return _named(o, grads=la1_backward(*t, decay, block_size=16))


def _one_pass_runner(lookback):
    def run(q, k, v, do, s0, dsn, decay, block):
        t = [torch.tensor(x, dtype=torch.float32, device=DEVICE) for x in (q, k, v, s0)]
        o, sn = lookback_forward(*t[:3], log2_decay_tensor(decay, DEVICE), t[3], seg_len=16, lookback=lookback,
                                 block=16)  # one block per segment: every hand-off exercised
        return _named(o, sn)

    return run


FAST = {"numpy backend": run_numpy_backend, "numpy references": run_numpy_references,
        "torch backend": run_torch_backend, "torch forms": run_torch_forms}
KERNELS = {
    "triton backend": run_triton_backend,
    "la1": run_la1,
    "la2_literal": _variant_runner("la2_literal"),
    "la2_fast": _variant_runner("la2_fast", seg_len=16),  # several segments: the Horner start is exercised
    "la2_fast fused dK/dV": _variant_runner("la2_fast", seg_len=32, fused_dkdv=True),
    "la3": _variant_runner("la3", seg_len=32, chunk=32, micro=16),  # two micro-chunks per chunk, several segments
    # 16-bit tiles: the flagged programs are redone in the fast kernel itself (plan.redo_in_place)
    "la2_fast fp16": _variant_runner("la2_fast", torch.float16, seg_len=16),
    "la3 fp16": _variant_runner("la3", torch.float16, seg_len=32, chunk=32, micro=16),
    "one pass, look-back": _one_pass_runner(True),  # forward only
    "one pass, chained": _one_pass_runner(False),
}


# On a GPU each new shape compiles every kernel again (Triton specialises a length or stride on being 1 or a
# multiple of 16), and compiling is most of a case's time. These shapes cover those classes: lengths 37 (neither),
# 16 and 1; head dims 1 and others; batches and heads of 1 and 2. Where the poison sits, its value, the decay and
# the block still vary from example to example.
GPU_SHAPES = [(2, 2, 37, 3, 5), (1, 1, 16, 1, 4), (2, 1, 1, 5, 1)]


@st.composite
def poisoned_problems(draw):
    if DEVICE == "cuda":  # a few shapes, so that the examples share compiled kernels (see GPU_SHAPES)
        batch, heads, n, d_k, d_v = draw(st.sampled_from(GPU_SHAPES))
    else:
        batch, heads = draw(st.integers(1, 2)), draw(st.integers(1, 2))
        n, d_k, d_v = draw(st.integers(1, 40)), draw(st.integers(1, 5)), draw(st.integers(1, 5))
    decay = np.array(draw(st.lists(st.sampled_from([1.0, 0.9, 0.5, 1e-3]), min_size=heads, max_size=heads)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    arrays = {
        "q": rng.standard_normal((batch, heads, n, d_k)), "k": rng.standard_normal((batch, heads, n, d_k)),
        "v": rng.standard_normal((batch, heads, n, d_v)), "do": rng.standard_normal((batch, heads, n, d_v)),
        "s0": rng.standard_normal((batch, heads, d_k, d_v)), "dsn": rng.standard_normal((batch, heads, d_k, d_v)),
    }
    where = draw(st.sampled_from(["q", "k", "v", "do"]))
    b, h, s = draw(st.integers(0, batch - 1)), draw(st.integers(0, heads - 1)), draw(st.integers(0, n - 1))
    c = draw(st.integers(0, arrays[where].shape[-1] - 1))
    arrays[where][b, h, s, c] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    block = draw(st.integers(1, 17))
    shapes = {"o": (batch, heads, n, d_v), "state": (batch, heads, d_k, d_v), "dq": (batch, heads, n, d_k),
              "dk": (batch, heads, n, d_k), "dv": (batch, heads, n, d_v), "ds0": (batch, heads, d_k, d_v)}
    return arrays, decay, block, expected_nonfinite(where, b, h, s, c, shapes), (where, b, h, s, c)


def _check(run, problem):
    arrays, decay, block, expected, planted = problem
    got = run(arrays["q"], arrays["k"], arrays["v"], arrays["do"], arrays["s0"], arrays["dsn"], decay, block)
    assert got, "the runner returned nothing"
    for name, value in got.items():
        wrong = ~np.isfinite(value) != expected[name]
        if wrong.any():
            idx = tuple(int(i) for i in np.argwhere(wrong)[0])
            state = "non-finite" if expected[name][idx] else "finite"
            raise AssertionError(f"{planted}: {name}{list(idx)} should be {state} ({int(wrong.sum())} entries wrong)")


@pytest.mark.parametrize("name", sorted(FAST))
@given(problem=poisoned_problems())
def test_nonfinite_reaches_exactly_its_dependents(name, problem):
    _check(FAST[name], problem)


@gpu_too
@pytest.mark.parametrize("name", sorted(KERNELS))
@settings(max_examples=12)  # the CPU interpreter runs each kernel slowly; 12 examples x 10 variants
@given(problem=poisoned_problems())
def test_nonfinite_reaches_exactly_its_dependents_in_kernels(name, problem):
    _check(KERNELS[name], problem)


@gpu_too
def test_issue_example_later_nan_leaves_earlier_rows_alone():
    # One NaN in k at the last of 8 tokens: only row 7 depends on it, on every backend.
    q = np.ones((1, 1, 8, 2))
    k = q.copy()
    k[0, 0, 7, 0] = np.nan
    want = np.array([True] * 7 + [False])
    assert np.array_equal(np.isfinite(lightning_attention(q, k, q)).all(-1)[0, 0], want)
    for backend in ("torch", "triton"):
        t = [torch.tensor(x, dtype=torch.float32, device=DEVICE if backend == "triton" else "cpu") for x in (q, k, q)]
        o = lightning_attention(*t, backend=backend, block_size=16)
        assert np.array_equal(torch.isfinite(o).all(-1)[0, 0].cpu().numpy(), want), backend


@gpu_too
@pytest.mark.parametrize("dtype, d, in_place", [
    (torch.float16, 32, True),    # 16-bit tiles, a state of at most 64 x 64: the fast kernels redo in place
    (torch.float32, 32, False),   # float32 tiles: the exact pass is a launch of its own
    (torch.float16, 96, False),   # a 96 (padded 128) x 64 state: too large to redo in place
])
def test_the_exact_pass_runs_in_place_only_where_redo_in_place_says(dtype, d, in_place, monkeypatch):
    from lightning_edu.triton_kernels import la2_fast, la3, ops
    from lightning_edu.triton_kernels.plan import redo_in_place

    seen = []  # (kernel, SAFE, REDO) of every launch of one forward + backward through the backend
    for module in (la2_fast, la3):
        def spy(kernel, grid, real=module.launch):
            run = real(kernel, grid)

            def call(*args, **meta):
                seen.append((getattr(kernel, "fn", kernel).__name__, meta.get("SAFE", False), meta.get("REDO", False)))
                return run(*args, **meta)
            return call
        monkeypatch.setattr(module, "launch", spy)
    ops.forget_plans()  # no replay: every launcher runs
    q, k, v = (torch.randn(1, 2, 40, d, device=DEVICE, dtype=dtype, requires_grad=True) for _ in range(3))
    lightning_attention(q, k, v, [0.9, 0.5], backend="triton", block_size=16).sum().backward()
    assert redo_in_place(dtype, d, min(d, 64)) == in_place
    fast = [(name, redo) for name, safe, redo in seen if not safe and "segment_state" not in name]
    exact = [name for name, safe, _ in seen if safe]
    assert len(fast) >= 3, seen  # the forward, the dQ pass and the dK/dV pass(es)
    if in_place:
        assert not exact and all(redo for _, redo in fast), seen
    else:
        assert len(exact) == len(fast) and not any(redo for _, redo in fast), seen
