"""Checks for the exercises of chapter 08 (the backward kernel in Triton).

:func:`check_reverse_sweep_kernel` launches the reader's ``@triton.jit`` reverse sweep of Algorithm 2
(in the CPU interpreter without CUDA) on seeded random fp32 inputs with partial last blocks and per-head
decay, and compares dK, dV and the state gradient dKV_0 with ``numpy_blockwise.blockwise_backward``
(float64). Failure messages name the tensor, the block and the rows, and say which part to look at.
"""

from __future__ import annotations

import numpy as np

from ..checks import random_qkv
from ..numpy_blockwise import blockwise_backward
from ._core import ExerciseError, _short, call_reader, exercise, expect_shape, passed, seeded, wrong_rows
from .ch05 import _sweep
from .ch07 import _device, _launch_error, tolerance

__all__ = ["check_reverse_sweep_kernel", "check_la1_dq_kernel", "check_replay"]

_SHAPES = [  # (batch, heads, n, d_k, d_v, decays)
    (1, 2, 53, 16, 32, [0.9, 0.5]),
    (2, 1, 40, 32, 16, [0.99]),
    (1, 1, 16, 16, 16, [0.7]),
]


def _first_wrong_block_from_the_end(got: np.ndarray, ref: np.ndarray, block: int, rtol: float):
    """The block the reverse sweep reaches first among the wrong ones (the highest index), or None."""
    rows = wrong_rows(got, ref, rtol=rtol, axis=2)
    return None if rows.size == 0 else int(rows[-1]) // block


def _known_sweep_mistake(got, inputs, decay, block, rtol) -> str | None:
    """The message for a reverse sweep that matches a classic mistake (in float64 numpy), else None."""
    q, k, v, do = inputs
    lam = np.asarray(decay, dtype=np.float64)
    variants = (
        (dict(forward=True), "the sweep walks the blocks from the first to the last. dK_i and dV_i need the queries "
         "AFTER block i, so the reverse sweep starts at the last block, start = (num_blocks - 1 - i) * BLOCK, and "
         "carries dKV towards the first"),
        (dict(read_after_update=True), "use dKV before you update it: you added this block's own Q_i^T dO_i to dKV "
         "before reading it, so the pairs inside the block are counted twice (and the acausal ones too): compute the "
         "inter terms of dK_i and dV_i first, then update dKV"),
    )
    for options, message in variants:
        dk, dv, dkv0 = _sweep(q, k, v, do, lam, block, **options)
        same = all(not wrong_rows(got[name], ref, rtol=rtol, axis=2).size for name, ref in (("dk", dk), ("dv", dv)))
        if same:
            return message
    return None


@exercise("8.1", reveals=("la2_literal_dkdv_kernel",), kernel=True)
def check_reverse_sweep_kernel(reverse_kernel, block: int = 16, seed: int = 0) -> None:
    """``reverse_kernel[(batch * heads,)](Q, K, V, DO, DK, DV, DKV_OUT, LOG2_DECAY, n, H, D_K=, D_V=, BLOCK=16)``
    must compute dK, dV of Algorithm 2's reverse sweep for contiguous fp32 (batch, heads, n, d) tensors and
    store the final dKV (the gradient of the initial state, (batch, heads, d_k, d_v)) into DKV_OUT."""
    import torch

    dev = _device()
    rtol = tolerance()
    for i, (batch, heads, n, d_k, d_v, decay) in enumerate(_SHAPES):
        q, k, v = random_qkv(batch, heads, n, d_k, d_v, seed=80 + i + seed)
        do = np.random.default_rng(90 + i + seed).standard_normal(v.shape)
        _, dk_ref, dv_ref, dkv_ref = blockwise_backward(q, k, v, do, decay, block_size=block)
        t = [torch.tensor(x, dtype=torch.float32, device=dev) for x in (q, k, v, do)]
        dk = torch.full((batch, heads, n, d_k), float("nan"), dtype=torch.float32, device=dev)
        dv = torch.full((batch, heads, n, d_v), float("nan"), dtype=torch.float32, device=dev)
        dkv = torch.full((batch, heads, d_k, d_v), float("nan"), dtype=torch.float32, device=dev)
        log2_decay = torch.tensor(np.log2(decay), dtype=torch.float32, device=dev)
        try:
            reverse_kernel[(batch * heads,)](*t, dk, dv, dkv, log2_decay, n, heads, D_K=d_k, D_V=d_v, BLOCK=block)
        except Exception as exc:
            raise _launch_error("reverse_kernel", exc) from exc
        case = f"(batch {batch}, heads {heads}, n {n}, d_k {d_k}, d_v {d_v}, lambda {decay})"
        got = {name: expect_shape(name, x, ref.shape) for name, x, ref in (("dk", dk, dk_ref), ("dv", dv, dv_ref), ("dKV_0", dkv, dkv_ref))}
        state_ok = bool(np.allclose(got["dKV_0"], dkv_ref, rtol=0, atol=rtol * np.abs(dkv_ref).max()))
        last = (n - 1) // block
        for name, ref in (("dk", dk_ref), ("dv", dv_ref)):
            blk = _first_wrong_block_from_the_end(got[name], ref, block, rtol)
            if blk is None:
                continue
            rows = f"rows {blk * block}-{min(n, blk * block + block) - 1}"
            other = "v" if name == "dk" else "k"
            mistake = _known_sweep_mistake(got, (q, k, v, do), decay, block, rtol)
            if mistake:
                hint = mistake
            elif not np.isfinite(got[name]).all():
                hint = ("it holds NaN or inf: every row of the block must be stored, and every decay factor is lambda "
                        "to a non-negative power (clamp the exponent at 0 on padded rows)")
            elif blk == last:
                hint = ("the sweep visits this block first, with dKV = 0 (no token comes after the last block), so only "
                        "the intra part (given) may contribute to it: start the sweep at the last block with dKV = 0")
            elif not state_ok:
                hint = ("did you use the reverse-sweep state? After each block, dKV = lambda^b dKV + "
                        "(diag(lambda^(r+1)) Q_i)^T dO_i, with b the block's valid rows (the gradient of the initial "
                        "state differs too)")
            else:
                hint = (f"the reverse-sweep state is right, so the inter term is off: {name}_i += "
                        f"diag(lambda^(b-1-r)) {'V_i dKV^T' if name == 'dk' else 'K_i dKV'} (the same k-side scale as "
                        f"the forward state update, applied to {other})")
            raise ExerciseError(f"{name} differs in block {blk}, {rows} (the sweep runs from block {last} down to 0) "
                                f"for {case}: {hint}")
        if not state_ok:
            raise ExerciseError(
                f"dk and dv are right but DKV_OUT differs for {case}: store dKV after the update of block 0 "
                "(it is dL/dKV_0, the gradient of the initial state)"
            )
    partial = sum(shape[2] % block != 0 for shape in _SHAPES)
    passed(f"reverse_kernel matches Algorithm 2 (numpy, float64) on {len(_SHAPES)} shapes ({partial} with a partial "
           "last block): dK, dV and dKV_0, per-head decay")


_LA1_SHAPES = [  # (batch, heads, n, d_k, d_v, decays)
    # lambda = 1e-3: a mask that multiplies (or a negative power selected away) meets 1e-3^-15, inf in fp32
    (1, 3, 45, 16, 32, [0.9, 0.5, 1e-3]),
    (2, 1, 33, 32, 16, [1.0]),
]


@exercise("8.2", reveals=("la1_backward_dq_kernel",), kernel=True)
def check_la1_dq_kernel(dq_kernel, block: int = 16, seed: int = 0) -> None:
    """``dq_kernel[(cdiv(n, 16), batch * heads)](K, V, DO, DQ, LOG2_DECAY, n, H, D_K=, D_V=, BLOCK=16)`` must
    compute LA-1's dQ_i = sum over key blocks j <= i of [(dO_i V_j^T) * D_ij] K_j for contiguous fp32
    (batch, heads, n, d) tensors, one program per (query block, batch * head)."""
    import torch

    dev = _device()
    rtol = tolerance()
    for i, (batch, heads, n, d_k, d_v, decay) in enumerate(_LA1_SHAPES):
        q, k, v = random_qkv(batch, heads, n, d_k, d_v, seed=60 + i + seed)
        do = np.random.default_rng(65 + i + seed).standard_normal(v.shape)
        dq_ref = blockwise_backward(q, k, v, do, decay, block_size=block)[0]
        t = [torch.tensor(x, dtype=torch.float32, device=dev) for x in (k, v, do)]
        dq = torch.full((batch, heads, n, d_k), float("nan"), dtype=torch.float32, device=dev)
        log2_decay = torch.tensor(np.log2(decay), dtype=torch.float32, device=dev)
        grid = (-(-n // block), batch * heads)
        try:
            dq_kernel[grid](*t, dq, log2_decay, n, heads, D_K=d_k, D_V=d_v, BLOCK=block)
        except Exception as exc:
            raise _launch_error("dq_kernel", exc) from exc
        got = expect_shape("dq", dq, dq_ref.shape)
        rows = wrong_rows(got, dq_ref, rtol=rtol, axis=2)
        if rows.size == 0:
            continue
        blk = int(rows[0]) // block
        case = f"(batch {batch}, heads {heads}, n {n}, d_k {d_k}, d_v {d_v}, lambda {decay})"
        where = f"dq differs first in query block {blk}, rows {blk * block}-{min(n, blk * block + block) - 1}, for {case}"
        if np.isnan(got).any():
            hint = "some rows are NaN: store every valid row of the program's block, and mask loads past n with other=0"
        elif blk == 0:
            hint = ("query block 0 sees only key block 0: the loop must include the diagonal tile j = i, with the "
                    "entries above the diagonal (key after query) set to 0")
        else:
            hint = ("block 0 is right, so the diagonal tile is; the off-diagonal tiles are not: "
                    "D_ij[r, s] = lambda^((i B + r) - (j B + s)) counts the distance in absolute positions, and the "
                    "loop runs over every key block j = 0 .. i")
        raise ExerciseError(f"{where}: {hint}")
    passed(f"dq_kernel matches LA-1's dQ (numpy Algorithm 2, float64) on {len(_LA1_SHAPES)} shapes with partial "
                  "last blocks and per-head decay")


# ------------------------------------------------------------------------------------------ exercise 8.3

def _plan(factors=(3.0, 0.5)):
    """(buffers, launches, outputs): three stand-in kernels on two inputs, each writing its output tensor in place as
    a kernel does (defined here, not in the module, so that the exercise's guard, which switches the package's
    functions off while the reader's code runs, leaves them alone). Buffer 1 is first used by the second launch,
    buffer 2 by the third; buffers 1 and 2 are float64, and buffer 2 is laid out column-major (stride (1, 2))."""
    import torch

    def scale(x, out, factor):
        out.copy_(x * factor)

    def add(a, b, out):
        out.copy_(a + b)

    def outer(a, out, factor):
        out.copy_(factor * a[: out.shape[0], None] * a[None, : out.shape[1]])

    buffers = [((4,), (1,), torch.float32), ((4,), (1,), torch.float64), ((2, 3), (1, 2), torch.float64)]
    launches = [(scale, ((0, 0), (1, 0), (2, factors[0]))),
                (add, ((1, 0), (0, 1), (1, 1))),
                (outer, ((1, 1), (1, 2), (2, factors[1])))]
    outputs = ((1, 1), (1, 2), (2, None))
    return buffers, launches, outputs


def _expected_order(launches) -> list:
    """What a replay must do, in order: buffer b allocated just before the first launch whose template names it."""
    order, seen = [], set()
    for i, (_, template) in enumerate(launches):
        for kind, x in template:
            if kind == 1 and x not in seen:
                seen.add(x)
                order.append(("allocate", x))
        order.append(("launch", i))
    return order


@exercise("8.3", reveals=("replay",))
def check_replay(replay, seed: int = 0) -> None:
    """``replay(buffers, launches, outputs, inputs, allocate)`` must run a recorded plan on new inputs: allocate each
    buffer with ``allocate(shape, stride, dtype)`` just before the first launch that uses it, call each launch's
    ``run`` with its template resolved ((0, i): the i-th input, (1, b): buffer b, (2, value): the value), and return
    the tuple that ``outputs`` describes, resolved the same way."""
    import torch

    rng = seeded(90 + seed)
    factors = (3.0, 0.5) if not seed else tuple(float(x) for x in rng.uniform(-2, 2, size=2))
    buffers, launches, outputs = _plan(factors)
    order = _expected_order(launches)

    # Called while the reader's code runs, so defined here: the guard switches off the module's functions then.
    def same_entry(kind: int, got, want) -> bool:
        """A tensor entry must be the very tensor (an input, or this replay's buffer); a value, the value itself."""
        if kind < 2 or want is None:
            return got is want
        return type(got) is type(want) and got == want

    for call in range(2):  # twice: a second replay allocates afresh
        inputs = tuple(torch.tensor(rng.standard_normal(4), dtype=torch.float32) for _ in range(2))
        events, allocated = [], {}

        def allocate(shape, stride, dtype):
            spec = (tuple(shape), tuple(stride), dtype) if isinstance(shape, (tuple, list, torch.Size)) else None
            if spec not in buffers:
                raise ExerciseError(f"allocate was called with ({_short(shape)}, {_short(stride)}, {_short(dtype)}), "
                                    "which is no buffer's entry of the plan: pass each entry's shape, stride and "
                                    "dtype as it is")
            b = len(allocated)  # buffers are numbered in the order of first use: the next one due
            if b >= len(buffers) or spec != buffers[b]:
                again = buffers.index(spec)
                raise ExerciseError(f"replay asked allocate for buffer {again}'s entry a second time in one replay: "
                                    "allocate each buffer once, just before the first launch that names it; every "
                                    "later launch that names it uses that same tensor")
            due = order[len(events)] if len(events) < len(order) else None
            if due is not None and due[0] == "launch":
                raise ExerciseError(f"replay allocated buffer {b} before launch {due[1]}, which does not use it: "
                                    "allocate each buffer just before the first launch that needs it, so that on a "
                                    "call bound by the host the first kernel is on its way while the rest are allocated")
            events.append(("allocate", b))
            allocated[b] = torch.full(spec[0], float("nan"), dtype=dtype).as_strided(spec[0], spec[1])
            return allocated[b]

        def watched(i, run, template):
            def launch(*args):
                if ("launch", i) in events:
                    raise ExerciseError(f"replay ran launch {i} twice: each launch runs once per replay")
                if len(args) != len(template):
                    raise ExerciseError(f"launch {i} was called with {len(args)} arguments, its template has "
                                        f"{len(template)}: one argument per template entry, in order")
                for j, ((kind, x), arg) in enumerate(zip(template, args)):
                    if kind == 1 and x not in allocated:
                        raise ExerciseError(f"launch {i} names buffer {x}, which this replay had not allocated "
                                            "before it ran: each replay allocates its buffers afresh, with allocate")
                    want = (inputs[x] if kind == 0 else allocated[x]) if kind < 2 else x
                    if not same_entry(kind, arg, want):
                        what = {0: f"input {x}", 1: f"buffer {x}, the tensor allocated for it in this replay",
                                2: f"the value {x!r} itself"}[kind]
                        raise ExerciseError(f"launch {i}'s argument {j} is {_short(arg)}; its template entry "
                                            f"{(kind, x)!r} stands for {what}")
                events.append(("launch", i))
                return run(*args)
            return launch

        plan = [(watched(i, run, template), template) for i, (run, template) in enumerate(launches)]
        got = call_reader(replay, "replay", (buffers, plan, outputs, inputs, allocate), "on a three-launch plan")
        if events != order:
            done = ", ".join(f"{what} {b}" for what, b in events) or "nothing"
            raise ExerciseError(f"replay did {done}; a replay of this plan does {', '.join(f'{w} {b}' for w, b in order)}")
        if not isinstance(got, tuple) or len(got) != len(outputs):
            raise ExerciseError(f"replay returned {_short(got)}: return a tuple with one entry per entry of outputs "
                                f"({len(outputs)} here: buffer 1, buffer 2 and the value None)")
        for j, ((kind, x), out) in enumerate(zip(outputs, got)):
            want = (inputs[x] if kind == 0 else allocated[x]) if kind < 2 else x
            if not same_entry(kind, out, want):
                raise ExerciseError(f"output {j} is {_short(out)}; its entry {(kind, x)!r} stands for "
                                    + (f"buffer {x}, the tensor this replay allocated and the launches wrote" if kind == 1
                                       else f"the value {x!r} itself"))
    passed("replay allocates each buffer just before the launch that first uses it, hands every launch its inputs, "
           "buffers and values, and returns fresh outputs on every call")
