"""Launch plans (``_tiles.LaunchPlan``, ``_tiles.record_plan``): a call of the backend with the shapes of an earlier
one replays the launches recorded then, and gives the same bits as its launchers; what cannot be replayed is not.

Plans are filed per test (tests/conftest.py clears them), so each test records its own first call."""

import functools
import math

import pytest
import torch
import triton
from kernel_cases import cases, kernel_inputs

from lightning_edu.triton_kernels import _tiles, log2_decay_tensor, ops
from lightning_edu.triton_kernels import plan as kernel_plan

SHAPES = {
    "cpu": [((1, 2, 77, 16, 32), torch.float32), ((2, 1, 130, 32, 16), torch.float16), ((1, 3, 5, 16, 16), torch.float32)],
    "cuda": [((1, 4, 256, 64, 64), torch.bfloat16), ((2, 3, 1000, 128, 128), torch.bfloat16),
             ((1, 2, 333, 64, 32), torch.float16), ((1, 2, 300, 128, 128), torch.float32),
             ((4, 16, 2048, 64, 64), torch.bfloat16)],
}


def _inputs(shape, dtype, device, seed=0):
    """kernel_inputs' q, k, v, do, and one lambda per head, exp(-2^-(h+1)): 0.61 to nearly 1."""
    q, k, v, do, _, _ = kernel_inputs(shape, device, dtype, seed)
    return q, k, v, do, log2_decay_tensor([math.exp(-(2.0 ** -(i + 1))) for i in range(shape[1])], device)


def _call(q, k, v, do, l2):
    o, sn, incoming = ops.forward_impl(q, k, v, l2, None, None, True)
    dq, dk, dv, ds0 = ops.backward_impl(q, k, v, do, l2, None, None, incoming, None, False)
    assert ds0 is None
    return o, sn, incoming, dq, dk, dv


def _same(a, b):
    return all(x.shape == y.shape and x.dtype == y.dtype and x.stride() == y.stride()
               and torch.equal(torch.nan_to_num(x, nan=7.0), torch.nan_to_num(y, nan=7.0))
               and torch.equal(x.isnan(), y.isnan()) for x, y in zip(a, b))


@cases("shape,dtype", SHAPES)
def test_a_replayed_call_gives_the_bits_of_its_launchers(device, shape, dtype, monkeypatch):
    q, k, v, do, l2 = _inputs(shape, dtype, device)
    with kernel_plan.override(replay=False):
        want = _call(q, k, v, do, l2)
    assert not ops._FORWARD_PLANS and not ops._BACKWARD_PLANS
    first = _call(q, k, v, do, l2)  # records
    assert len(ops._FORWARD_PLANS) == len(ops._BACKWARD_PLANS) == 1
    assert all(plan is not None for plan in (*ops._FORWARD_PLANS.values(), *ops._BACKWARD_PLANS.values()))
    planned = []
    real_plan = ops.launch_plan
    monkeypatch.setattr(ops, "launch_plan", lambda *a, **kw: planned.append(a) or real_plan(*a, **kw))
    # new inputs of the same shapes, and a non-finite value: the exact pass is replayed too
    q2, k2, v2, do2, _ = _inputs(shape, dtype, device, seed=1)
    v2[0, 0, shape[2] // 2, 0] = float("nan")
    again = _call(q2, k2, v2, do2, l2)
    assert not planned  # no host code of the launchers ran
    monkeypatch.setattr(ops, "launch_plan", real_plan)
    with kernel_plan.override(replay=False):
        assert _same(first, want) and _same(again, _call(q2, k2, v2, do2, l2))
    assert again[0].isnan().any() and not again[0][:, :, : shape[2] // 2].isnan().any()  # causal


@cases("shape,dtype", {"cuda": [((2, 3, 1000, 128, 128), torch.bfloat16), ((1, 2, 777, 128, 96), torch.float16)]})
def test_a_replayed_call_with_descriptor_tiles_gives_the_bits_of_its_launchers(device, shape, dtype, monkeypatch):
    # The forward and dQ pass through la2_tma's descriptors (kernel_plan.MIN_ROWS lowered so that these short calls take
    # them): each replay builds its descriptors on the replay's tensors and calls the compiled launchers directly.
    monkeypatch.setattr(kernel_plan, "MIN_ROWS", 0)
    q, k, v, do, l2 = _inputs(shape, dtype, device)
    assert kernel_plan.backend_takes(q, v) == (torch.cuda.get_device_capability() >= (9, 0))
    first = _call(q, k, v, do, l2)  # records
    plans = [*ops._FORWARD_PLANS.values(), *ops._BACKWARD_PLANS.values()]
    assert len(plans) == 2 and all(plan is not None and plan._direct is not None for plan in plans)
    if kernel_plan.backend_takes(q, v):  # a descriptor in the forward's plan and in the backward's (dQ)
        assert all(any(kind == 3 for _, template in plan.launches for kind, _ in template) for plan in plans)
    q2, k2, v2, do2, _ = _inputs(shape, dtype, device, seed=1)
    again = _call(q2, k2, v2, do2, l2)  # replayed
    with kernel_plan.override(replay=False):
        assert _same(again, _call(q2, k2, v2, do2, l2)) and _same(first, _call(q, k, v, do, l2))


@cases("mode", {"cpu": ["inference_mode", "no_grad"], "cuda": ["inference_mode"]})
def test_calls_under_inference_mode_record_and_replay(device, mode, monkeypatch):
    # tensors made under torch.inference_mode have no version counter: the record must not ask for one
    q, k, v, _, l2 = _inputs((1, 2, 70, 16, 32), torch.float32, device)
    context = torch.inference_mode if mode == "inference_mode" else torch.no_grad
    with context():
        outs = [ops.forward_impl(q, k, v, l2, None, None, False) for _ in range(3)]
        with kernel_plan.override(replay=False):
            want = ops.forward_impl(q, k, v, l2, None, None, False)
    assert [plan is not None for plan in ops._FORWARD_PLANS.values()] == [True]
    assert all(_same(out, want) for out in outs)


@cases("case", {"cpu": ["strided view", "initial state", "final-state gradient", "bfloat16", "off a boundary"]})
def test_calls_that_cannot_be_replayed_run_their_launchers(device, case):
    q, k, v, do, l2 = _inputs((1, 2, 40, 16, 16), torch.float32, device)
    s0 = dsn = None
    if case == "strided view":
        q = torch.randn(1, 40, 2, 16).transpose(1, 2)
    elif case == "initial state":
        s0 = torch.randn(1, 2, 16, 16)
    elif case == "final-state gradient":
        dsn = torch.randn(1, 2, 16, 16)
    elif case == "bfloat16":
        q, k, v, do = (x.bfloat16() for x in (q, k, v, do))
    else:
        q = torch.randn(q.numel() + 1)[1:].view(q.shape)
    for _ in range(2):
        o, sn, incoming = ops.forward_impl(q, k, v, l2, s0, None, True)
        ops.backward_impl(q, k, v, do, l2, s0, dsn, incoming, None, False)
    assert not any(ops._BACKWARD_PLANS.values())
    if case not in ("initial state", "final-state gradient"):
        assert not any(ops._FORWARD_PLANS.values())


class _Writer:
    """A kernel stand-in that writes its second argument through raw memory, as a GPU kernel does (no version bump)."""

    def __getitem__(self, grid):
        def run(x, out, scale):
            out.numpy()[:] = x.numpy() * scale
        return run


def test_record_plan_maps_inputs_buffers_and_constants():
    x = torch.arange(4.0)

    def launcher(x):
        out = torch.empty_like(x)
        _tiles.launch(_Writer(), (1,))(x, out, 3)
        return out, None

    result, plan = _tiles.record_plan(launcher, (x,), x)
    assert plan is not None and plan.buffers == [((4,), (1,), torch.float32, x.device)]
    assert plan.outputs == ((1, 0), (2, None))
    assert plan._direct is None  # a stand-in's launch, not a compiled kernel's: replayed launch by launch
    y = torch.tensor([1.0, -2.0, 5.0, 0.5])
    out, none = plan.replay((y,))
    assert none is None and torch.equal(out, y * 3) and out.data_ptr() != result[0].data_ptr()


def test_a_replay_allocates_each_buffer_just_before_the_launch_that_first_uses_it(monkeypatch):
    x = torch.arange(4.0)

    def launcher(x):
        a = torch.empty_like(x)
        b = torch.empty_like(x)
        _tiles.launch(_Writer(), (1,))(x, a, 3)
        _tiles.launch(_Writer(), (1,))(a, b, 2)
        _tiles.launch(_Writer(), (1,))(b, a, 5)
        return a, b

    _, plan = _tiles.record_plan(launcher, (x,), x)
    assert plan is not None and plan.before == [1, 2, 2]
    events = []
    real_empty = torch.empty_strided
    monkeypatch.setattr(torch, "empty_strided", lambda *a, **kw: events.append("allocate") or real_empty(*a, **kw))
    plan = _tiles.LaunchPlan(plan.buffers, [(lambda *args, run=run: events.append("launch") or run(*args), template)
                                            for run, template in plan.launches], plan.outputs)
    a, b = plan.replay((x,))
    assert events == ["allocate", "launch", "allocate", "launch", "launch"]
    assert torch.equal(b, x * 6) and torch.equal(a, x * 30)


@pytest.mark.parametrize("mistake", ["written by torch", "a view of an input", "two views of one buffer",
                                     "an output no kernel wrote"])
def test_record_plan_refuses_what_a_replay_could_not_reproduce(mistake):
    x = torch.arange(4.0)

    def launcher(x):
        out = torch.empty_like(x)
        if mistake == "written by torch":
            out.fill_(1.0)  # content from a torch operation: a replay would not have it
            _tiles.launch(_Writer(), (1,))(x, out, 3)
            return out, None
        if mistake == "a view of an input":
            _tiles.launch(_Writer(), (1,))(x[1:], out[1:], 3)
            return out, None
        if mistake == "two views of one buffer":
            both = torch.empty(8)
            _tiles.launch(_Writer(), (1,))(x, both[:4], 3)
            _tiles.launch(_Writer(), (1,))(x, both[4:], 2)
            return both[:4], None
        _tiles.launch(_Writer(), (1,))(x, out, 3)
        return out * 1, None

    result, plan = _tiles.record_plan(launcher, (x,), x)
    assert plan is None


def test_a_plan_rebuilds_tensor_descriptors_on_the_replays_tensors():
    # A descriptor holds its tensor's address (la2_tma's kernel takes them): the plan keeps its shape, strides,
    # tile and padding, and a replay builds it afresh on the replay's input and on the replay's own buffer.
    from triton.tools.tensor_descriptor import TensorDescriptor

    seen = []

    class _Doubler:
        def __getitem__(self, grid):
            def run(x_desc, out_desc, scale):
                seen.append((x_desc, out_desc))
                out_desc.base.numpy()[:] = x_desc.base.numpy() * scale  # numpy: the buffer's version stays 0
            return run

    def launcher(x):
        out = torch.empty_like(x)
        _tiles.launch(_Doubler(), (1,))(TensorDescriptor(x, [8], [1], [4], "nan"), TensorDescriptor(out, [8], [1], [8]), 2.0)
        return out, None

    x = torch.arange(8.0)
    result, plan = _tiles.record_plan(launcher, (x,), x)
    assert plan is not None and torch.equal(result[0], 2 * x)
    y = torch.arange(8.0) + 5
    out, none = plan.replay((y,))
    assert none is None and torch.equal(out, 2 * y) and out is not result[0]
    x_desc, out_desc = seen[-1]
    assert x_desc.base is y and out_desc.base is out and len(seen) == 2
    assert (x_desc.shape, x_desc.strides, x_desc.block_shape, x_desc.padding) == ([8], [1], [4], "nan")
    assert (out_desc.block_shape, out_desc.padding) == ([8], "zero")


def test_record_plan_refuses_a_descriptor_of_a_view_of_an_input():
    # A replay could rebuild a descriptor only on an input or a buffer of the call, not on a view of one.
    from triton.tools.tensor_descriptor import TensorDescriptor

    class _Reader:
        def __getitem__(self, grid):
            return lambda desc, out: out.numpy().__setitem__(slice(None), desc.base.numpy())

    def launcher(x):
        out = torch.empty(4)
        _tiles.launch(_Reader(), (1,))(TensorDescriptor(x[4:], [4], [1], [4]), out)
        return out, None

    x = torch.arange(8.0)
    result, plan = _tiles.record_plan(launcher, (x,), x)
    assert plan is None and torch.equal(result[0], x[4:])


class _Compiled:
    """A compiled kernel stand-in: its launcher records what it is called with."""

    def __init__(self, calls, name):
        self.calls, self.function, self.packed_metadata = calls, f"function {name}", ("metadata", name)

    def run(self, *args):
        self.calls.append(args)

    def launch_metadata(self, grid, stream, *args):
        return ("launch metadata", grid, stream)


@pytest.mark.parametrize("hooks", ["none", "empty chains", "a hook"])
def test_a_plan_of_compiled_kernels_calls_their_launchers_as_triton_does(hooks, monkeypatch):
    # The direct replay (every launch a compiled kernel's, no launch hook) hands each launcher what _run_compiled
    # would, minus the launch metadata and hooks that call nothing; with a hook set, it goes through _run_compiled.
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1000 + device, raising=False)
    if hooks == "empty chains":
        if not hasattr(triton.knobs, "HookChain"):
            pytest.skip("this Triton keeps its launch hooks as plain values")
        enter, leave = triton.knobs.HookChain(), triton.knobs.HookChain(reversed=True)
    else:
        enter, leave = (lambda metadata: None) if hooks == "a hook" else None, None
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", enter)
    monkeypatch.setattr(triton.knobs.runtime, "launch_exit_hook", leave)
    hook = hooks == "a hook"
    calls = []
    first, second = _Compiled(calls, "a"), _Compiled(calls, "b")
    x, y = torch.arange(3.0), torch.arange(5.0)
    launches = [(functools.partial(_tiles._run_compiled, first, (4,), ("rest", 7), 2), ((0, 0), (1, 0), (2, 9))),
                (functools.partial(_tiles._run_compiled, second, (2, 3), (), 2), ((1, 0), (0, 1)))]
    plan = _tiles.LaunchPlan([((3,), (1,), torch.float32, x.device)], launches, ((1, 0),))
    assert plan._direct is not None
    (buffer,) = plan.replay((x, y))
    metadata = (("launch metadata", (4,), 1002), ("launch metadata", (2, 3), 1002)) if hook else (None, None)
    enter, leave = (enter, leave) if hook else (None, None)
    assert calls == [
        (4, 1, 1, 1002, "function a", ("metadata", "a"), metadata[0], enter, leave, x, buffer, 9, "rest", 7),
        (2, 3, 1, 1002, "function b", ("metadata", "b"), metadata[1], enter, leave, buffer, y),
    ]


@cases("shape,dtype", {"cpu": [((1, 2, 77, 16, 32), torch.float32)],
                       "cuda": [((1, 4, 1000, 64, 64), torch.bfloat16), ((1, 2, 300, 128, 128), torch.float32)]})
def test_a_backward_allocates_one_state_sized_buffer_the_reverse_sweeps_last_state(device, shape, dtype):
    # The forward-form passes that run the sequence forwards (dQ) or whose final state nothing reads (la2_fast's dK
    # pass) neither allocate nor store one; the reverse sweep's last state is dL/dS0's (kept whether asked for or not:
    # one compiled kernel for both). The plan lists every buffer the backward allocated.
    q, k, v, do, l2 = _inputs(shape, dtype, device)
    _call(q, k, v, do, l2)
    (plan,) = ops._BACKWARD_PLANS.values()
    batch, heads, _, d_k, d_v = shape
    assert plan is not None and len(plan.buffers) >= 4  # dq, dk, dv and the exact pass's flags at least
    assert [buffer[0] for buffer in plan.buffers].count((batch, heads, d_k, d_v)) == 1
