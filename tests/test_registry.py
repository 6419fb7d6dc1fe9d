"""Every registered implementation against the one it is checked against, on odd shapes, on every device.

One loop over :data:`lightning_edu.registry.IMPLEMENTATIONS` and one tolerance table
(:data:`lightning_edu.registry.TOLERANCES`): on a machine without CUDA the Triton kernels run in the CPU
interpreter, on a GPU machine the same tests run them on the GPU as well. The reference is always run in
float64 on the CPU, on the same inputs rounded to the dtype under test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lightning_edu as le
from lightning_edu import registry
from lightning_edu.checks import relative_error
from lightning_edu.validation import validate_attention_args

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# batch, heads, n, d_k, d_v, decay per head, block size (None: the implementation's default)
SHAPES = [
    (1, 2, 37, 16, 32, [1.0, 0.9], None),
    (2, 1, 50, 32, 16, [0.05], 16),
    (1, 3, 130, 16, 16, [0.999, 1e-3, 0.5], 32),
]


def _cases():
    for impl in registry.IMPLEMENTATIONS.values():
        if impl.checked_against is None or impl.op != "attention":
            continue  # the decoding-step records ("step") are checked in tests/test_step.py
        for device in DEVICES:
            if device == "cuda" and impl.rung == "numpy":
                continue
            if device == "cpu" and impl.rung == "triton" and "cuda" in DEVICES:
                continue  # with CUDA present the interpreter is off: kernels take CUDA tensors only
            for dtype in impl.dtypes:
                if impl.rung == "triton" and device == "cpu" and dtype == "float16" and impl.name != "triton.la2_fast":
                    continue  # the interpreter is slow: one 16-bit check on the CPU is enough
                # the CUDA cases join the GPU suite (pytest -m gpu)
                yield pytest.param(impl.name, device, dtype, id=f"{impl.name}-{device}-{dtype}",
                                   marks=[pytest.mark.gpu] if device == "cuda" else [])


def _inputs(shape, dtype, seed=0):
    batch, heads, n, d_k, d_v, decay, block = shape
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(s) for s in [(batch, heads, n, d_k)] * 2 + [(batch, heads, n, d_v)] * 2
              + [(batch, heads, d_k, d_v)] * 2]
    # Round to the dtype under test first: the reference then sees exactly the inputs the implementation sees.
    return [torch.from_numpy(x).to(getattr(torch, dtype)).double().numpy() for x in arrays], np.array(decay), block


def _run(impl, arrays, decay, block, device, dtype, backward):
    q, k, v, do, s0, dsn = arrays
    if not impl.initial_state:
        s0 = None
    if not impl.final_state:
        dsn = None
    if impl.rung == "numpy":
        data = [q, k, v, do, s0, dsn]
    else:
        data = [None if x is None else torch.from_numpy(x).to(device, getattr(torch, dtype)) for x in (q, k, v, do, s0, dsn)]
        if data[5] is not None and dtype in ("float16", "bfloat16"):
            data[5] = data[5].float()  # states and their gradients are float32 at least
    q, k, v, do, s0, dsn = data
    block = block if block is not None and (impl.rung != "triton" or block >= 16) else None
    args = validate_attention_args(q, k, v, decay, backend=impl.rung, block_size=block, initial_state=s0,
                                   do=do if backward else None, d_final_state=dsn if backward else None)
    registry.check_supports(impl, args, backward=backward and impl.has_backward, d_final_state=dsn)
    if not backward:
        return impl.forward(args)
    if impl.has_backward:
        return impl.backward(args, dsn)
    # Differentiable by autograd: the gradients of <o, do> + <final state, dsn>.
    leaves = [x.clone().requires_grad_() if x is not None else None for x in (q, k, v, s0)]
    args = validate_attention_args(*leaves[:3], decay, backend=impl.rung, block_size=block, initial_state=leaves[3])
    o, sn = impl.forward(args)
    outs, grads = [o], [do]
    if sn is not None and dsn is not None:
        outs.append(sn)
        grads.append(dsn.to(sn.dtype))
    torch.autograd.backward(outs, grads)
    return tuple(None if x is None else x.grad for x in leaves)


HALF_SHAPE = {"float16": 1, "bfloat16": 2}  # on the GPU, the one index into SHAPES each 16-bit dtype runs at


def _shape_cases():
    # On the GPU, float32 (where the kernels' error is measured against the tightest bound) runs at every shape and
    # each 16-bit dtype at one shape of its own: every shape then meets a 16-bit dtype, and each kernel compiles five
    # specialisations rather than nine (compiling is most of a GPU case's time).
    for params in _cases():
        name, device, dtype = params.values
        for i, shape in enumerate(SHAPES):
            if device == "cuda" and dtype in HALF_SHAPE and HALF_SHAPE[dtype] != i:
                continue
            yield pytest.param(name, device, dtype, shape, marks=params.marks,
                               id=f"n{shape[2]}-dk{shape[3]}-dv{shape[4]}-{params.id}")


@pytest.mark.parametrize("name, device, dtype, shape", list(_shape_cases()))
def test_matches_the_implementation_it_is_checked_against(name, device, dtype, shape):
    impl = registry.get(name)
    ref = registry.get(impl.checked_against)
    arrays, decay, block = _inputs(shape, dtype)
    tol = registry.TOLERANCES[dtype]
    o, sn = _run(impl, arrays, decay, block, device, dtype, backward=False)
    ref_arrays = arrays if impl.initial_state else arrays[:4] + [None, None]
    ro, rs = _run(ref, ref_arrays, decay, block, "cpu", "float64", backward=False)
    assert relative_error(o, ro) < tol, "o"
    if impl.final_state:
        assert relative_error(sn, rs) < tol, "final state"
    if impl.has_backward or impl.differentiable:
        grads = _run(impl, arrays, decay, block, device, dtype, backward=True)
        if not (ref.has_backward or ref.differentiable):
            # The numpy references have no gradient: float64 autograd through the per-token recurrence judges.
            ref = registry.get("torch.recurrent")
        want = _run(ref, ref_arrays, decay, block, "cpu", "float64", backward=True)
        for label, got, expected in zip(("dq", "dk", "dv", "d_initial_state"), grads, want):
            if got is None or not impl.initial_state and label == "d_initial_state":
                continue
            assert relative_error(got, expected) < tol, label


def test_every_chain_of_checks_ends_at_the_ground_truth():
    # Each implementation is checked against one of the same op on its own rung or the rung below, and
    # following the chain always ends at the per-token recurrence in float64 (one step of it for "step").
    order = {rung: i for i, rung in enumerate(registry.RUNGS)}
    truth = {"attention": "numpy.recurrent", "step": "numpy.step"}
    for impl in registry.IMPLEMENTATIONS.values():
        seen, current = [], impl
        while current.checked_against is not None:
            below = registry.get(current.checked_against)
            assert order[below.rung] in (order[current.rung], order[current.rung] - 1), (current.name, below.name)
            assert below.op == current.op, (current.name, below.name)
            assert below.name not in seen, f"a cycle through {below.name}"
            seen.append(below.name)
            current = below
        assert current.name == truth[impl.op]


def test_one_backend_per_rung_and_the_api_runs_it(monkeypatch):
    from lightning_edu import numpy_blockwise

    for rung in registry.RUNGS:
        assert registry.backend_for(rung).rung == rung
        assert registry.backend_for(rung).op == "attention"
    calls = []
    real = numpy_blockwise.algorithm1
    monkeypatch.setattr(numpy_blockwise, "algorithm1", lambda args, **kw: calls.append(args) or real(args, **kw))
    q = np.ones((1, 1, 4, 2))
    le.lightning_attention(q, q, q)  # backend "auto" -> numpy -> numpy.blockwise
    assert len(calls) == 1 and calls[0].seq_len == 4


def test_register_refuses_duplicates_unknown_rungs_and_missing_references():
    impl = registry.get("numpy.masked")
    with pytest.raises(ValueError, match="registered twice"):
        registry.register(impl)
    with pytest.raises(ValueError, match="rung must be one of"):
        registry.register(registry.Implementation(**{**impl.__dict__, "name": "x", "rung": "jax"}))
    with pytest.raises(ValueError, match="which is not registered"):
        registry.register(registry.Implementation(**{**impl.__dict__, "name": "y", "checked_against": "nope"}))
    with pytest.raises(ValueError, match=r"implementation must be one of \["):
        registry.get("numpy.nope")


def test_check_supports_refuses_what_an_implementation_cannot_do():
    q = torch.ones(1, 1, 4, 16)
    args = validate_attention_args(q, q, q, backend="triton", initial_state=torch.zeros(1, 1, 16, 16))
    with pytest.raises(ValueError, match=r"^implementation 'triton.la1' takes no initial_state"):
        registry.check_supports(registry.get("triton.la1"), args)
    args = validate_attention_args(q, q, q, backend="torch")
    with pytest.raises(ValueError, match=r"^implementation 'torch.loop' has no backward"):
        registry.check_supports(registry.get("torch.loop"), args, backward=True)
    wide = torch.ones(1, 1, 4, 192)
    args = validate_attention_args(wide, wide, wide, backend="triton")
    with pytest.raises(ValueError, match=r"^implementation 'triton.la2_literal' supports d_k, d_v <= 128"):
        registry.check_supports(registry.get("triton.la2_literal"), args)
