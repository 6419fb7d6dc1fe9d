"""Sequence parallelism (lightning_edu.distributed) against the single-process lightning_attention.

Each spawned run is a gloo group of CPU processes; several checks share one run, since starting the
processes is the slow part. Every rank computes the single-process reference itself (same seed, whole
sequence) and returns its largest errors, which the test process then asserts on.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from lightning_edu import lightning_attention
from lightning_edu.distributed import communication_bytes, run_on_cpu_ranks, sequence_parallel_attention

TOL = 1e-10
F64 = torch.float64


def _data(counts, heads, d_k, d_v, seed, batch=2):
    """The whole sequence (every rank draws the same): q, k, v, initial state, output and state weights."""
    g = torch.Generator().manual_seed(seed)
    n = sum(counts)
    draw = lambda *shape: torch.randn(*shape, generator=g, dtype=F64)  # noqa: E731
    return dict(q=draw(batch, heads, n, d_k), k=draw(batch, heads, n, d_k), v=draw(batch, heads, n, d_v),
                init=draw(batch, heads, d_k, d_v), w_out=draw(batch, heads, n, d_v),
                w_state=draw(len(counts), batch, heads, d_k, d_v))


def _reference(d, lam, use_init, learn_decay):
    """Single process: o, final state, and the gradients of sum_r L_r (each rank weights the final state
    with its own w_state[r], so the reference weights it with their sum)."""
    leaves = {name: d[name].clone().requires_grad_() for name in ("q", "k", "v", "init")}
    decay = torch.tensor(lam, dtype=F64, requires_grad=True) if learn_decay else lam
    o, state = lightning_attention(leaves["q"], leaves["k"], leaves["v"], decay, backend="torch",
                                   initial_state=leaves["init"] if use_init else None, return_state=True)
    ((o * d["w_out"]).sum() + (state * d["w_state"].sum(0)).sum()).backward()
    grads = {name: x.grad for name, x in leaves.items()}
    if learn_decay:
        grads["decay"] = decay.grad
    return o.detach(), state.detach(), grads


def _case(rank, counts, lam, *, exchange, use_init=True, learn_decay=False, return_state=True, d_k=3, d_v=5,
          seed=0):
    """One configuration on this rank: the largest error of each output and gradient."""
    heads = len(lam)
    d = _data(counts, heads, d_k, d_v, seed)
    o_ref, state_ref, g_ref = _reference(d, lam, use_init, learn_decay)
    start = sum(counts[:rank])
    rows = slice(start, start + counts[rank])
    mine = {name: d[name][:, :, rows].clone().requires_grad_() for name in ("q", "k", "v")}
    init = d["init"].clone().requires_grad_() if use_init and rank == 0 else None
    decay = torch.tensor(lam, dtype=F64, requires_grad=True) if learn_decay else lam
    result = sequence_parallel_attention(mine["q"], mine["k"], mine["v"], decay, initial_state=init,
                                         return_state=return_state, exchange=exchange, offset=start)
    o, state = result if return_state else (result, None)
    loss = (o * d["w_out"][:, :, rows]).sum()
    if return_state:
        loss = loss + (state * d["w_state"][rank]).sum()
    loss.backward()
    err = lambda a, b: (a - b).abs().max().item()  # noqa: E731
    errors = {"o": err(o, o_ref[:, :, rows])}
    # o is tied to the exchange (a copy) on rank 0 alone: every other rank's o reads the exchange already
    errors["tied on rank 0 alone"] = float((type(o.grad_fn).__name__ == "_JoinBackward") != (rank == 0))
    if not return_state:  # the reference's loss used the state: recompute its gradients with o alone
        d["w_state"].zero_()
        _, _, g_ref = _reference(d, lam, use_init, learn_decay)
    else:
        errors["state"] = err(state, state_ref)
    for name in ("q", "k", "v"):
        errors["d" + name] = err(mine[name].grad, g_ref[name][:, :, rows])
    if init is not None:
        errors["d_init"] = err(init.grad, g_ref["init"])
    if learn_decay:
        total = decay.grad.clone()
        dist.all_reduce(total)  # a replicated weight: the ranks' shares add up to dL/dlambda
        errors["d_decay"] = err(total, g_ref["decay"])
    return errors


def _configs_two(rank):
    counts = [6, 9]
    out = {}
    for exchange in ("allgather", "ring"):
        out[f"{exchange} lambda=1"] = _case(rank, counts, [1.0, 1.0], exchange=exchange)
        out[f"{exchange} per-head, learnable"] = _case(rank, counts, [0.95, 1e-3], exchange=exchange,
                                                        learn_decay=True, seed=1)
        out[f"{exchange} no state, no init"] = _case(rank, counts, [0.8, 1.0], exchange=exchange, use_init=False,
                                                     return_state=False, seed=2)
        out[f"{exchange} d_k > d_v"] = _case(rank, [1, 4], [0.7], exchange=exchange, d_k=6, d_v=2, seed=3)
    return out


def _configs_three(rank):
    counts = [5, 17, 1]
    out = {}
    for exchange in ("allgather", "ring"):
        out[f"{exchange} uneven, per-head"] = _case(rank, counts, [1.0, 0.9, 1e-3], exchange=exchange,
                                                    learn_decay=True)
        out[f"{exchange} uneven, no init"] = _case(rank, counts, [0.5, 1.0, 0.99], exchange=exchange,
                                                   use_init=False, seed=4)
    return out


def _check(results):
    for rank, per_config in enumerate(results):
        for config, errors in per_config.items():
            for what, e in errors.items():
                assert e < TOL, f"rank {rank}, {config}: {what} off by {e:.3g}"


def test_two_ranks_match_single_process():
    _check(run_on_cpu_ranks(_configs_two, 2))


def test_three_uneven_ranks_match_single_process():
    _check(run_on_cpu_ranks(_configs_three, 3))


def _ring_vs_allgather(rank):
    """The two exchanges give the same o and final state (bit for bit up to rounding)."""
    d = _data([4, 7], 2, 3, 3, seed=5)
    rows = slice(0, 4) if rank == 0 else slice(4, 11)
    args = (d["q"][:, :, rows], d["k"][:, :, rows], d["v"][:, :, rows], [0.9, 0.6])
    init = d["init"] if rank == 0 else None
    a = sequence_parallel_attention(*args, initial_state=init, return_state=True, exchange="allgather")
    b = sequence_parallel_attention(*args, initial_state=init, return_state=True, exchange="ring")
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def test_ring_and_allgather_agree_with_spawn():
    # "spawn" (fresh interpreters, fn imported by name) as well as the default "fork"
    assert max(run_on_cpu_ranks(_ring_vs_allgather, 2, start_method="spawn")) < 1e-12


def _error(call):
    try:
        call()
    except (TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _errors(rank):
    """Each wrong call raises on every rank (no rank left waiting); the group still works afterwards."""
    x = lambda n, d=3, heads=2, dtype=F64: torch.ones(1, heads, n, d, dtype=dtype)  # noqa: E731
    spa = sequence_parallel_attention
    out = {}
    out["heads"] = _error(lambda: spa(x(4, heads=2 + rank), x(4, heads=2 + rank), x(4, heads=2 + rank)))
    out["d_v"] = _error(lambda: spa(x(4), x(4), x(4, d=3 + rank)))
    out["dtype"] = _error(lambda: spa(*(x(4, dtype=F64 if rank else torch.float32),) * 3))
    out["order"] = _error(lambda: spa(x(5), x(5), x(5), offset=5 - 5 * rank))
    out["gap"] = _error(lambda: spa(x(4), x(4), x(4), offset=6 * rank))
    out["resumed"] = spa(x(4), x(4), x(4), offset=100 + 4 * rank).sum().item()
    out["negative"] = _error(lambda: spa(x(4), x(4), x(4), offset=-1 + 5 * rank))
    out["numpy"] = _error(lambda: spa(*(x(4).numpy() if rank else x(4),) * 3))
    out["decay"] = _error(lambda: spa(x(4), x(4), x(4), 1.5))
    out["decay shape"] = _error(lambda: spa(x(4), x(4), x(4), [0.5, 0.5, 0.5]))
    out["decay differs"] = _error(lambda: spa(x(4), x(4), x(4), 0.9 - 0.1 * rank))
    out["init"] = _error(lambda: spa(x(4), x(4), x(4), initial_state=torch.zeros(1, 2, 3, 3, dtype=F64)))
    out["empty"] = _error(lambda: spa(x(4 - 4 * rank), x(4 - 4 * rank), x(4 - 4 * rank)))
    out["exchange"] = _error(lambda: spa(x(4), x(4), x(4), exchange="tree"))
    out["backend"] = _error(lambda: spa(x(4), x(4), x(4), backend="numpy"))
    q = x(4).requires_grad_(rank == 0)
    out["grad"] = _error(lambda: spa(q, x(4), x(4)))
    out["after"] = spa(x(4), x(4), x(4), 0.5).sum().item()
    return out


def test_errors_are_clear_and_raised_on_every_rank():
    r0, r1 = run_on_cpu_ranks(_errors, 2)
    for key in r0:
        if key not in ("after", "resumed"):
            for message in (r0[key], r1[key]):
                assert message.startswith(("ValueError", "TypeError")), (key, message)
    assert "the number of heads (axis 1)" in r0["heads"] and "rank 0 has 2, rank 1 has 3" in r0["heads"]
    assert r0["heads"] == r1["heads"]
    assert "d_v (axis 3 of v)" in r0["d_v"] and "rank 1 has 4" in r0["d_v"]
    assert "the dtype of q" in r0["dtype"] and "torch.float32" in r0["dtype"] and "torch.float64" in r0["dtype"]
    assert "contiguous and in rank order" in r0["order"] and "rank 1 starts at 0, expected 10" in r0["order"]
    assert "(rank 0 holds positions 5..9)" in r0["order"] and r0["order"] == r1["order"]
    assert "rank 1 starts at 6, expected 4 (rank 0 holds positions 0..3)" in r1["gap"]
    assert r0["resumed"] > 0  # offsets need not start at 0: contiguity is what is checked
    assert "decay must lie in (0, 1]" in r0["decay"] and "1.5" in r0["decay"]
    assert "decay must have one value per head: expected length 2, got length 3" in r0["decay shape"]
    assert "decay (one lambda per head for the whole sequence) must be the same on every rank" in r0["decay differs"]
    assert r1["init"].startswith("ValueError: initial_state is the state before the sequence's first token")
    assert "pass it on rank 0 only" in r1["init"] and "rank 1 refused its arguments" in r0["init"]
    assert "q must hold at least one token on every rank" in r1["empty"] and "rank 1 refused" in r0["empty"]
    assert "offset must be >= 0" in r0["negative"] and "rank 0 refused its arguments: ValueError" in r1["negative"]
    assert r1["numpy"].startswith("TypeError: q must be a torch.Tensor") and "got ndarray" in r1["numpy"]
    assert r0["numpy"].startswith("TypeError: rank 1 refused its arguments: TypeError: q must be a torch.Tensor")
    assert "exchange must be one of ('allgather', 'ring'), got 'tree'" in r0["exchange"]
    assert "backend must be one of ('auto', 'torch', 'triton'), got 'numpy'" in r0["backend"]
    assert "autograd must record this call on every rank or on none" in r0["grad"] and r0["grad"] == r1["grad"]
    assert r0["after"] > 0 and r1["after"] > r0["after"]  # the group still answers: rank 1 carries rank 0's state


def test_no_process_group():
    assert not dist.is_initialized()
    q = torch.ones(1, 1, 2, 2, dtype=F64)
    with pytest.raises(ValueError, match="group: torch.distributed is not initialised"):
        sequence_parallel_attention(q, q, q)


def _fails_on_rank_one(rank):
    if rank == 1:
        raise KeyError("broken on purpose")
    return rank


def _sleeps(rank):
    time.sleep(60)


def test_run_on_cpu_ranks_reports_failures_and_timeouts():
    with pytest.raises(RuntimeError, match=r"rank 1 of 2 failed(.|\n)*broken on purpose"):
        run_on_cpu_ranks(_fails_on_rank_one, 2)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish within 1 s"):
        run_on_cpu_ranks(_sleeps, 2, timeout=1)
    assert time.monotonic() - start < 15


def test_communication_bytes_by_hand():
    # 8192 tokens on 4 ranks, 8 heads of 128 x 128, bf16 keys and values, float32 states
    got = communication_bytes(8192, 4, 8, 128, 128, 2)
    state = 8 * 128 * 128 * 4  # 524288 bytes: one rank's state
    assert got["lightning_allgather"] == 3 * state == 1_572_864
    assert got["lightning_ring"] == state
    assert got["softmax_allgather_kv"] == 3 * (8 * 2048 * (128 + 128) * 2) == 25_165_824
    assert communication_bytes(10, 3, 1, 2, 3, 4, batch=2)["softmax_allgather_kv"] == 2 * (2 * 4 * 5 * 4)
    assert communication_bytes(10, 1, 1, 2, 3, 4) == {"lightning_allgather": 0, "lightning_ring": 0,
                                                     "softmax_allgather_kv": 0}
    with pytest.raises(ValueError, match="world must be a positive integer"):
        communication_bytes(10, 0, 1, 2, 3, 4)


def _second_derivatives(rank):
    """Differentiate twice through each exchange alone. ``x ** 3`` gives the first derivative a history of its own,
    so without a guard the second derivative would come back (without the exchange's term) instead of failing."""
    from lightning_edu.distributed import _GatherStates, _RingExchange

    group, out = dist.group.WORLD, {}
    x = torch.linspace(0.5, 1.5, 6, dtype=torch.float64).view(1, 1, 2, 3).add(rank).requires_grad_()
    a, b = _GatherStates.apply(group, x)
    gathered = (a * b).sum() + (x ** 3).sum()
    incoming, final = _RingExchange.apply(group, rank, 2, x, torch.full((1, 1, 1, 1), 0.5, dtype=torch.float64), True)
    ring = (incoming ** 2).sum() + (final * x).sum() + (x ** 3).sum()
    for name, loss in (("all-gather", gathered), ("ring", ring)):
        g, = torch.autograd.grad(loss, x, create_graph=True)  # the first derivative: collectives on every rank
        for route in ("backward", "grad"):
            try:
                if route == "backward":
                    g.sum().backward(retain_graph=True)
                else:
                    torch.autograd.grad(g.sum(), x, retain_graph=True)
                out[name, route] = "returned"
            except RuntimeError as exc:
                out[name, route] = str(exc)
    return out


def test_second_derivatives_through_the_exchanges_raise_on_every_rank():
    for rank, out in enumerate(run_on_cpu_ranks(_second_derivatives, 2)):
        for (exchange, route), message in out.items():
            assert "has no second derivative" in message, f"rank {rank}, {exchange}, {route}: {message}"


def _raises_while_the_others_reduce(rank):
    if rank == 1:
        raise ValueError("boom from rank 1")
    dist.all_reduce(torch.ones(3))  # blocks until rank 1's process is gone: then "Connection reset by peer"
    return rank


def test_the_failure_reported_is_the_rank_that_raised_every_time():
    """The others' collectives fail too once rank 1 has gone, and torch.multiprocessing may notice one of them
    first; the report must still name rank 1 and carry its own exception, run after run."""
    for _ in range(3):
        with pytest.raises(RuntimeError) as info:
            run_on_cpu_ranks(_raises_while_the_others_reduce, 3, start_method="fork")  # the quick start
        message = str(info.value)
        assert message.startswith("rank 1 of 3 failed:") and "ValueError: boom from rank 1" in message, message


@pytest.mark.parametrize("timeout", [float("inf"), float("nan"), 0, -1.0, 1e10])
def test_run_on_cpu_ranks_refuses_a_timeout_it_cannot_keep(timeout):
    with pytest.raises(ValueError, match=f"timeout must be a positive, finite number of seconds.*got {timeout!r}"):
        run_on_cpu_ranks(_fails_on_rank_one, 2, timeout=timeout)


def test_a_fork_after_a_backward_is_explained():
    """What a forked rank raises in its backward once the parent has run one (seen on CUDA machines), turned into
    a message that names the cause and the two ways out; any other failure, or a spawned run, is left as it is."""
    from lightning_edu.distributed import _failure_message

    torch_error = ("Traceback (most recent call last):\n  ...\nRuntimeError: Unable to handle autograd's threading "
                   "in combination with fork-based multiprocessing. See https://github.com/pytorch/pytorch/wiki/"
                   "Autograd-and-Fork\n")
    message = _failure_message(2, 4, torch_error, "fork")
    assert message.startswith("rank 2 of 4 failed:\nTraceback") and "Autograd-and-Fork" in message
    assert "start_method='spawn'" in message and "before any backward" in message
    assert "at the top level of a module" in message
    other = "Traceback (most recent call last):\n  ...\nValueError: boom\n"
    assert _failure_message(0, 2, other, "fork") == "rank 0 of 2 failed:\n" + other.rstrip()
    assert "start_method='spawn'" not in _failure_message(0, 2, torch_error, "spawn")


def _module_level(rank):
    return rank


def test_the_default_start_method_is_spawn_on_cuda_machines_when_fn_can_be_imported(monkeypatch):
    from lightning_edu.distributed import _default_start_method

    def local(rank):
        return rank

    methods = ["fork", "spawn", "forkserver"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _default_start_method(_module_level, (1, [2.0]), methods) == "spawn"
    assert _default_start_method(local, (), methods) == "fork"  # pickle cannot find it: only a fork can start it
    assert _default_start_method(lambda rank: rank, (), methods) == "fork"
    assert _default_start_method(_module_level, (lambda: 0,), methods) == "fork"  # args that do not pickle
    assert _default_start_method(_module_level, (), ["spawn"]) == "spawn"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _default_start_method(_module_level, (), methods) == "fork"


def _dies_while_the_others_reduce(rank):
    if rank == 2:
        os._exit(3)  # no Python exception, nothing recorded: only its exit code tells
    dist.all_reduce(torch.ones(3))
    return rank


def test_a_rank_that_dies_without_an_exception_is_the_one_reported():
    for _ in range(3):
        with pytest.raises(RuntimeError, match=r"^rank 2 of 3 died") as info:
            run_on_cpu_ranks(_dies_while_the_others_reduce, 3, start_method="fork")
        assert "exit code 3" in str(info.value)
