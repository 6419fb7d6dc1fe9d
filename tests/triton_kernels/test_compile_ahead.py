"""The first call compiles side by side: ``_tiles.launch`` turns into a warm-up inside ``_tiles.compile_ahead``, and
on a GPU a configuration's first call compiles every kernel its forward and backward launch before launching
any (Triton's post-compile hook tells a kernel compiled by a warm-up from one compiled at a launch)."""

import functools
import json
import os
import subprocess
import sys

import pytest
import torch
from kernel_cases import marks, on

from benchmarks import first_call
from lightning_edu.triton_kernels import _tiles, ops
from lightning_edu.triton_kernels.plan import override, redo_in_place


class _Kernel:
    """Stands in for a ``@triton.jit`` function: records launches and warm-ups."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **meta: self.calls.append(("launch", grid, args, meta))

    def warmup(self, *args, grid, **meta):
        self.calls.append(("warmup", grid, args, meta))


def test_launch_launches_outside_compile_ahead():
    kernel = _Kernel()
    _tiles.launch(kernel, (3, 2))(1, 2, BLOCK=64)
    assert kernel.calls == [("launch", (3, 2), (1, 2), {"BLOCK": 64})]


def test_compile_ahead_turns_every_launch_into_a_warm_up_and_restores_launching():
    kernel = _Kernel()

    def launcher(x, block):
        _tiles.launch(kernel, (x,))(x, BLOCK=block)
        _tiles.launch(kernel, (1,))(x, BLOCK=block, SAFE=True)
        return "ran"

    assert _tiles.compile_ahead(launcher, 5, block=32) is True
    assert kernel.calls == [("warmup", (5,), (5,), {"BLOCK": 32}), ("warmup", (1,), (5,), {"BLOCK": 32, "SAFE": True})]
    _tiles.launch(kernel, (2,))(2)
    assert kernel.calls[-1][0] == "launch"


def test_every_kernel_of_the_package_launches_through_launch():
    """No launcher indexes a kernel (``kernel[grid](...)``): every launch goes through ``_tiles.launch``, so that
    ``compile_ahead`` sees it (the backend's first call, and the GPU tests, compile side by side)."""
    import pathlib
    import re

    import lightning_edu.triton_kernels as package

    sources = {path.name: path.read_text() for path in pathlib.Path(package.__file__).parent.glob("*.py")}
    indexed = {name: re.findall(r"\b\w+_kernel\[", text) for name, text in sources.items()}
    assert not any(indexed.values()), {name: hits for name, hits in indexed.items() if hits}
    launched = {name for name, text in sources.items()
                if re.search(r"\blaunch\(\w+_kernel, |\blaunch_keyed\(\w+, \w+_kernel, ", text)}
    assert {"la1.py", "la2_literal.py", "la2_fast.py", "la3.py", "decode.py"} <= launched, launched


def test_compile_ahead_restores_launching_when_the_launcher_raises():
    def broken():
        raise RuntimeError("bad launcher")

    with pytest.raises(RuntimeError, match="bad launcher"):
        _tiles.compile_ahead(broken)
    kernel = _Kernel()
    _tiles.launch(kernel, (1,))()
    assert kernel.calls[0][0] == "launch"


def test_the_key_separates_what_changes_the_compiled_kernels():
    q = torch.zeros(1, 2, 64, 16)
    key = ops.ahead_key(q, q, q, None, None, True, 2)
    assert key == ops.ahead_key(q.clone(), q, q, None, None, True, 2)
    strided = torch.zeros(1, 64, 2, 16).transpose(1, 2)  # rows 32 elements apart, as a view of a projection
    others = [ops.ahead_key(strided, q, q, None, None, True, 2), ops.ahead_key(q.half(), q, q, None, None, True, 2),
              ops.ahead_key(q, q, q, torch.zeros(1, 2, 16, 16), None, True, 2),
              ops.ahead_key(q, q, q, None, None, False, 2), ops.ahead_key(q, q, q, None, None, True, 1),
              ops.ahead_key(q[:, :, :50], q[:, :, :50], q[:, :, :50], None, None, True, 2)]
    assert all(other != key for other in others)


def test_the_interpreter_compiles_nothing_ahead(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("compile_ahead ran on the CPU")

    monkeypatch.setattr(ops, "compile_ahead", refuse)
    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    o, _, _ = ops.forward_impl(q, k, v, torch.full((2,), -0.1))
    assert o.shape == v.shape


def _signature(x):
    """What Triton specialises a launch on, roughly: a tensor's dtype, an int's value, a constexpr's value."""
    return ("tensor", x.dtype) if isinstance(x, torch.Tensor) else x


@pytest.mark.parametrize("dtype,d_k,d_v,n", [(torch.float32, 32, 32, 200), (torch.float16, 64, 64, 129),
                                           (torch.float32, 16, 48, 97)])
def test_the_ahead_pass_makes_the_launches_of_a_forward_and_backward(dtype, d_k, d_v, n, monkeypatch):
    """On the CPU, through the interpreter: every launch of a real forward + backward (with an initial state),
    with its grid, arguments and constants, is one the ahead pass of ops._first_call makes, and no other."""
    from lightning_edu.triton_kernels import la2_fast, la3

    launches = {"real": [], "ahead": []}
    mode = ["real"]
    real_launch = _tiles.launch

    def recording_launch(kernel, grid):
        def call(*args, **meta):
            launches[mode[0]].append((kernel.fn.__name__, grid, tuple(map(_signature, args)),
                                      tuple(sorted(meta.items()))))
            if mode[0] == "real":
                return real_launch(kernel, grid)(*args, **meta)
        return call

    monkeypatch.setattr(la2_fast, "launch", recording_launch)
    monkeypatch.setattr(la3, "launch", recording_launch)
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 3, n, d_k, generator=gen).to(dtype).requires_grad_() for _ in range(2))
    v = torch.randn(2, 3, n, d_v, generator=gen).to(dtype).requires_grad_()
    s0 = torch.randn(2, 3, d_k, d_v, generator=gen).requires_grad_()
    log2_decay = torch.tensor([-0.1, 0.0, -3.0])
    o, sn, incoming = ops.EagerLA2.apply(q, k, v, log2_decay, s0, None, True)
    (o.float().sum() + sn.sum()).backward()
    mode[0] = "ahead"
    monkeypatch.setattr(ops, "compile_ahead", lambda run: run())
    ops._COMPILED.clear()
    ops._first_call(q.detach(), k.detach(), v.detach(), log2_decay, s0.detach(), None, True,
                    ops.launch_plan(q, v)[2])
    # the forward, the dQ pass and the dK/dV pass(es), each followed by its exact pass unless that runs in place
    assert len(launches["real"]) >= (3 if redo_in_place(dtype, d_k, d_v) else 6)
    assert sorted(launches["ahead"], key=repr) == sorted(launches["real"], key=repr)


@pytest.mark.parametrize("dtype,d", [pytest.param(t, d, marks=marks("cuda")) for t, d in
                                     (("bfloat16", 64), ("bfloat16", 128), ("float32", 64))])
def test_a_first_call_compiles_every_kernel_ahead(dtype, d, tmp_path):
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", first_call._CHILD, dtype, str(d), "ahead"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    row = json.loads(run.stdout.strip().splitlines()[-1])
    # at least the forward's pre-pass and main kernel, the dQ pass, the dK/dV passes and a reverse pre-pass
    assert row["compiled"] >= 5 and row["at_launch"] == 0, row


def test_the_fast_launch_key_separates_what_triton_specialises_on():
    """``_tiles._fast_launch`` reuses a compiled kernel for a launch whose key it has seen: the key must differ
    wherever Triton would compile another kernel (an argument's dtype, a pointer's 16-byte alignment, an integer's
    divisibility by 16, the value 1, the integer's width), or a launch would run a kernel compiled for other
    arguments."""
    spec = _tiles._spec
    buffer = torch.zeros(64)
    pairs_apart = [(16, 17), (1, 2), (1, 17), (2**31 - 16, 2**31), (2**63 - 16, 2**63), (0, 1), (True, False),
                   (buffer, buffer[1:]), (buffer, buffer.half()), (buffer, buffer.double()), (None, 0), (1.0, 1)]
    for a, b in pairs_apart:
        assert spec(a) != spec(b), (a if not isinstance(a, torch.Tensor) else "tensor", b)
    pairs_together = [(16, 32), (17, 19), (buffer, buffer[4:]), (buffer, torch.ones(8)), (0.5, 2.0), (None, None)]
    for a, b in pairs_together:
        assert spec(a) == spec(b)
    # tensor descriptors (la2_tma): apart by their tensor's dtype or alignment, tile shape, padding, or an
    # integer of their shape or strides; together for another tensor of the same kind and layout
    from triton.tools.tensor_descriptor import TensorDescriptor

    def desc(x, block=(1, 16), shape=None, padding="zero"):
        shape = shape or list(x.shape)
        return TensorDescriptor(x, shape, list(x.stride()), list(block), padding)

    grid = torch.zeros(4, 64)
    for a, b in [(desc(grid), desc(grid.half())), (desc(grid), desc(grid, block=(2, 16))),
                 (desc(grid), desc(grid, shape=[4, 17])), (desc(grid), desc(grid, padding="nan")),
                 (desc(grid), grid)]:
        assert spec(a) != spec(b)
    assert spec(desc(grid)) == spec(desc(torch.ones(4, 64))) == spec(desc(torch.zeros(8, 64), shape=[4, 64]))


def test_launch_takes_the_fast_path_only_for_compiled_kernels(monkeypatch):
    """A stand-in (or an interpreted function) is launched as ``kernel[grid]``; with the setting fast_launch off, so
    is every kernel."""
    kernel = _Kernel()
    assert not isinstance(_tiles.launch(kernel, (1,)), functools.partial)
    with override(fast_launch=False):
        _tiles.launch(kernel, (1,))(3)
    assert kernel.calls == [("launch", (1,), (3,), {})]


@on("cuda")
def test_the_fast_launch_gives_the_bits_of_tritons_launch(device, monkeypatch):
    """The backend's forward and backward launched through ``_fast_launch`` (after a first call that fills its
    table) and through Triton's ``kernel[grid]``: the same bits, at one segment and at several, with an initial
    state."""
    from lightning_edu import lightning_attention

    def run(shape, dtype):
        b, h, n, d_k, d_v = shape
        g = torch.Generator(device="cuda").manual_seed(2)
        q, k = (torch.randn(b, h, n, d_k, device="cuda", generator=g).to(dtype).div(4).requires_grad_() for _ in "qk")
        v = torch.randn(b, h, n, d_v, device="cuda", generator=g).to(dtype).requires_grad_()
        s0 = torch.randn(b, h, d_k, d_v, device="cuda", generator=g).requires_grad_()
        decay = torch.linspace(0.5, 1.0, h, device="cuda")
        o, sn = lightning_attention(q, k, v, decay, backend="triton", initial_state=s0, return_state=True)
        torch.autograd.backward([o, sn], [torch.ones_like(o), torch.ones_like(sn)])
        torch.cuda.synchronize()
        return [o, sn, q.grad, k.grad, v.grad, s0.grad]

    for shape, dtype in (((1, 4, 256, 64, 64), torch.bfloat16), ((2, 3, 1000, 128, 128), torch.bfloat16),
                         ((1, 2, 333, 64, 32), torch.float16), ((1, 2, 300, 32, 48), torch.float32)):
        with override(fast_launch=False):
            want = run(shape, dtype)
        run(shape, dtype)
        before = len(_tiles._LAUNCHED)
        got = run(shape, dtype)
        assert len(_tiles._LAUNCHED) == before, "a repeated call met launch keys it had not seen"
        assert before > 0
        for a, b, name in zip(got, want, ("o", "final state", "dq", "dk", "dv", "d initial state")):
            assert torch.equal(a, b), f"{name} at {shape}, {dtype}: fast launch and Triton's launch disagree"


def test_the_fast_launch_key_holds_every_constexpr_by_value():
    """The row strides of la2_fast's kernels are constexprs passed by position: launches on two layouts that differ
    only there (rows 32 and 48 elements apart; every other stride divisible by 16 in both) must not share a key,
    or the second would run the kernel compiled for the first one's strides (wrong addresses: wrong results, or an
    illegal memory access). Launches recorded on the CPU (the interpreter's kernels), keyed as on a GPU."""
    from lightning_edu.triton_kernels import la2_fast

    recorded = []

    def recording_launch(kernel, grid):
        def call(*args, **meta):
            recorded.append((kernel, args, meta))
            return _tiles.launch(kernel, grid)(*args, **meta)
        return call

    def keys(row_stride, shift=0.0):
        recorded.clear()
        q, k, v = ((torch.randn(1, 2, 48, row_stride) + shift)[..., :16] for _ in range(3))
        la2_fast.la2_fast_forward(q, k, v, torch.full((2,), -0.1), block=16, num_warps=4, num_stages=1)
        return [_tiles.launch_key(kernel, args, meta, 0) for kernel, args, meta in recorded]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(la2_fast, "launch", recording_launch)
        rows_32, rows_48, rows_32_again = keys(32), keys(48), keys(32, shift=1.0)
    assert len(rows_32) == len(rows_48) >= 2
    assert all(a != b for a, b in zip(rows_32, rows_48)), "launches with other row strides share a key"
    assert rows_32_again == rows_32, "the same layout and dtypes should share their launch keys"
