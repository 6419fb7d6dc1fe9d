"""la2_fast's forward with descriptor loads (:mod:`lightning_edu.triton_kernels.la2_tma`), against float64 and
against la2_fast's own kernel: the same arithmetic, so the same bits, in the interpreter and on a GPU."""

import importlib
import numpy as np
import pytest
import torch
from kernel_cases import cases, kernel_inputs, on, synchronize
from kernel_cases import to_numpy64 as _np

from lightning_edu.checks import relative_error
from lightning_edu.numpy_blockwise import blockwise_forward
from lightning_edu.triton_kernels import log2_decay_tensor
from lightning_edu.triton_kernels import plan as kernel_plan
from lightning_edu.triton_kernels.la2_fast import la2_fast_backward, la2_fast_forward
from lightning_edu.triton_kernels.plan import backend_tiles, choose_segments
from lightning_edu.triton_kernels.la2_tma import la2_tma_forward, tma_ready

BOUNDS = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


@cases("shape,decays,tiles,dtype", {
    "cpu": [((1, 2, 100, 16, 48), [0.999, 1e-3], dict(block=16, block_dv=32, seg_len=32), torch.float32),
            ((2, 1, 1, 16, 16), [1.0], dict(block=16), torch.float32),
            ((1, 3, 77, 32, 16), [1.0, 0.9, 0.05], dict(block=16, seg_len=48), torch.float32)],
    "cuda": [(shape, [1.0, 0.99, 0.05][:shape[1]], tiles, dtype)
             for shape in [(2, 3, 1000, 64, 64), (1, 2, 4099, 128, 128), (1, 3, 777, 64, 32)]
             for tiles in ({}, dict(block=64, block_dv=128, num_warps=8, num_stages=3))
             for dtype in (torch.bfloat16, torch.float16)]
            + [((1, 2, 999, 64, 48), [1.0, 0.9], {}, torch.float32)],
})
def test_tma_forward_matches_float64_and_la2_fast_bit_for_bit(device, shape, decays, tiles, dtype):
    q, k, v, _, s0, _ = kernel_inputs(shape, device, dtype)
    lam = np.array(decays)
    l2 = log2_decay_tensor(lam, device)
    # every tile named, so that la2_fast_forward takes them as given (not its sliced plan)
    names = ("block", "block_dv", "num_warps", "num_stages")
    cfg = dict(zip(names, backend_tiles(q, v, *(tiles.get(name) for name in names))), seg_len=tiles.get("seg_len"))
    ro, rs = blockwise_forward(_np(q), _np(k), _np(v), lam, 64, _np(s0))
    o, sn = la2_tma_forward(q, k, v, l2, s0, **cfg)
    synchronize(device)
    assert o.dtype == dtype and relative_error(o, ro) < BOUNDS[dtype] and relative_error(sn, rs) < BOUNDS[dtype]
    # the same tiles through la2_fast's pointer kernel: the same arithmetic, the same bits
    o2, s2 = la2_fast_forward(q, k, v, l2, s0, **cfg, tma=False)
    assert torch.equal(o, o2) and torch.equal(sn, s2)


@cases("dtype", {"cpu": [torch.float32], "cuda": [torch.bfloat16]})
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy meets the planted inf
def test_tma_forward_keeps_non_finite_values_causal(device, dtype):
    d = 16 if device == "cpu" else 64
    q, k, v, _, _, _ = kernel_inputs((1, 2, 300, d, 32), device, dtype, seed=5)
    l2 = log2_decay_tensor(np.array([0.9, 0.95]), device)
    extra = dict(block=16, seg_len=32) if device == "cpu" else {}
    clean = la2_tma_forward(q, k, v, l2, **extra)[0]
    v[0, 1, 130, 3] = float("inf")
    o, sn = la2_tma_forward(q, k, v, l2, **extra)
    synchronize(device)
    bad = ~torch.isfinite(o[0, 1, :, 3])
    assert not bad[:130].any() and bad[130:].all()  # column 3 from the inf's row on, in its head
    assert torch.equal(o[0, 0], clean[0, 0]) and torch.equal(o[0, 1, :130], clean[0, 1, :130])
    assert torch.isfinite(o[0, 1, :, :3]).all()  # the other columns: v's inf reaches only its own column


@on("cpu")
def test_tma_forward_refuses_rows_off_16_bytes(device):
    q, k, v, _, _, _ = kernel_inputs((1, 1, 40, 16, 16), device)
    l2 = log2_decay_tensor(np.array([0.9]), device)
    x = torch.randn(1, 1, 40, 18)[..., :12]  # rows of 18 floats: 72 bytes apart
    assert tma_ready(q, k, v) is None and "16-byte aligned rows" in tma_ready(x)
    with pytest.raises(ValueError, match=r"la2_tma_forward: tensor descriptors need 16-byte aligned rows .*\(720, 720, 18, 1\)"):
        la2_tma_forward(x, x, x, l2, block=16)
    with pytest.raises(TypeError, match="bfloat16"):
        la2_tma_forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), l2, block=16)


def test_tma_measurement_refuses_bad_command_lines(capsys):
    from benchmarks import tma as perf_tma

    assert perf_tma.main(["--help"]) == 0
    assert perf_tma.main([]) == 2 and perf_tma.main(["a.json", "b.json"]) == 2
    assert "python -m benchmarks.tma OUT.json" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["segments", "prepass", "redo", "slices"])
def test_segment_measurements_refuse_bad_command_lines(capsys, name):
    module = importlib.import_module(f"benchmarks.{name}")

    assert module.main(["--help"]) == 0
    assert module.main([]) == 2 and module.main(["-o"]) == 2
    assert f"python -m benchmarks.{name} OUT.json" in capsys.readouterr().out
    if not torch.cuda.is_available():  # a command line it would run, on a machine it cannot measure
        assert module.main(["out.json"]) == 1 and "none is available here" in capsys.readouterr().out


@cases("shape,tiles,dtype,segments", {
    "cpu": [((1, 2, 100, 16, 48), dict(block=16, block_dv=32, seg_len=32), torch.float32, True),
            ((2, 1, 70, 32, 16), dict(block=16, seg_len=48), torch.float32, True)],
    "cuda": [((2, 3, 1000, 128, 128), {}, torch.bfloat16, True), ((1, 2, 4099, 128, 96), {}, torch.float16, True),
             ((16, 16, 512, 128, 128), {}, torch.bfloat16, False)],  # more pairs than SMs: d_v whole, one segment
})
def test_the_backends_passes_in_time_order_take_descriptor_tiles_bit_for_bit(device, shape, tiles, dtype, segments,
                                                                            monkeypatch):
    # The forward (saving its incoming states, from an initial state) and the backward's dQ pass (reading them, or
    # with one segment none), their fast pass through descriptors (tma=True) or through pointers (tma=False): the
    # same bits.
    from lightning_edu.triton_kernels import la2_fast

    seen = []
    real = la2_fast._tma_fast_pass
    monkeypatch.setattr(la2_fast, "_tma_fast_pass", lambda grid, args, meta: seen.append(grid) or real(grid, args, meta))
    q, k, v, do, s0, _ = kernel_inputs(shape, device, dtype)
    l2 = log2_decay_tensor(np.array([1.0, 0.9, 0.05][:shape[1]] + [0.99] * max(0, shape[1] - 3)), device)
    runs = {}
    for tma in (True, False):
        o, sn, saved = la2_fast_forward(q, k, v, l2, s0, save_states=True, tma=tma, **tiles)
        grads = la2_fast_backward(q, k, v, do, l2, s0, None, saved=saved, tma=tma, **tiles)
        runs[tma] = (o, sn, saved[1], *grads)
        assert len(seen) == 2  # the forward's fast pass and dQ's, with tma=True only
    synchronize(device)
    assert (saved[1] is not None) == segments  # more than one segment: the incoming states stored, and read by dQ
    assert all(a is b is None or torch.equal(a, b) for a, b in zip(runs[True], runs[False]))
    assert relative_error(runs[True][0], blockwise_forward(_np(q), _np(k), _np(v), np.exp2(_np(l2)), 64, _np(s0))[0]) < BOUNDS[dtype]


@on("cpu")
def test_the_backends_replayed_forward_rebuilds_its_descriptors(device, monkeypatch):
    # A launch plan of a forward with descriptor tiles: its replay on new inputs gives the launchers' bits.
    from lightning_edu.triton_kernels import la2_fast, ops

    monkeypatch.setattr(kernel_plan, "backend_takes", lambda q, v: True)  # the interpreter's call, as a GPU's would be
    seen = []
    real = la2_fast._tma_fast_pass
    monkeypatch.setattr(la2_fast, "_tma_fast_pass", lambda grid, args, meta: seen.append(args[0]) or real(grid, args, meta))
    l2 = log2_decay_tensor(np.array([0.9, 0.999]), device)
    first = kernel_inputs((1, 2, 130, 16, 32), device, torch.float32, seed=1)[:3]
    ops.forward_impl(*first, l2, None, 32, True)  # recorded
    (plan,) = ops._FORWARD_PLANS.values()
    assert plan is not None and len(seen) == 1
    q, k, v = kernel_inputs((1, 2, 130, 16, 32), device, torch.float32, seed=2)[:3]
    replayed = ops.forward_impl(q, k, v, l2, None, 32, True)
    assert len(seen) == 1  # replayed: no launcher ran
    with kernel_plan.override(replay=False):
        want = ops.forward_impl(q, k, v, l2, None, 32, True)
    assert len(seen) == 2 and seen[-1] is q
    assert all(torch.equal(a, b) for a, b in zip(replayed, want))


@on("cuda")
def test_the_backend_takes_descriptor_tiles_for_16_bit_heads_of_65_to_128_in_calls_of_many_rows(device):
    from lightning_edu.triton_kernels.plan import MIN_ROWS, backend_takes

    def x(d, dtype=torch.bfloat16, rows=MIN_ROWS):
        return torch.empty(2, 4, rows // 8, d, device=device, dtype=dtype)

    hopper = torch.cuda.get_device_capability() >= (9, 0)
    assert backend_takes(x(128), x(128)) == hopper and backend_takes(x(64), x(96)) == hopper
    assert not backend_takes(x(64), x(64)) and not backend_takes(x(256), x(256))
    assert not backend_takes(x(128, torch.float32), x(128, torch.float32))
    assert not backend_takes(x(128, rows=MIN_ROWS - 8), x(128, rows=MIN_ROWS - 8))  # a short call: bound by the host


@on("cpu")
def test_a_forward_with_no_backward_takes_d_v_whole_where_its_tiles_load_by_descriptor(device, monkeypatch):
    # plan.whole_dv_forward: the backend's plan (ops.launch_plan) and la2_fast_forward's own choice agree, only a
    # forward that saves no states takes it, and the answer is la2_fast's with the slices' tiles.
    from lightning_edu.triton_kernels import la2_fast, ops

    monkeypatch.setattr(kernel_plan, "backend_takes", lambda q, v: True)  # as on a Hopper GPU, for a long call
    q, k, v, _, _, _ = kernel_inputs((1, 2, 70, 72, 80), device)
    l2 = log2_decay_tensor(np.array([0.9, 1.0]), device)
    cfg, seg_len, num_seg = ops.launch_plan(q, v, None, save_states=False)
    assert {key: cfg[key] for key in kernel_plan.WHOLE_DV} == kernel_plan.WHOLE_DV
    assert ops.launch_plan(q, v, None, save_states=True)[0]["block_dv"] == 64  # a backward follows: the slices
    # one program of these tiles per SM (WHOLE_DV_PER_SM): half the segments two per SM would give (4 SMs here)
    sms, short = kernel_plan.sm_count(q.device), kernel_plan.short_blocks(q.device)
    assert (num_seg, seg_len) == choose_segments(2, 70, cfg["block"], sms, None, short, kernel_plan.WHOLE_DV_PER_SM)
    assert kernel_plan.whole_dv_plan(q, cfg["block"]) == (kernel_plan.WHOLE_DV, num_seg, seg_len)
    assert num_seg < choose_segments(2, 70, cfg["block"], sms, None, short)[0]
    seen = []
    real = la2_fast._forward_form
    monkeypatch.setattr(la2_fast, "_forward_form", lambda *a, **kw: seen.append((a[7], a[10])) or real(*a, **kw))
    o, sn = la2_fast_forward(q, k, v, l2)
    o2, s2 = la2_fast_forward(q, k, v, l2, tma=False)
    assert seen[0] == (128, seg_len)  # (block_dv, seg_len): d_v whole on the backend's plan's segments with descriptors
    assert seen[1][0] == 64  # the slices without
    ro, rs = blockwise_forward(_np(q), _np(k), _np(v), np.array([0.9, 1.0]), 64)
    assert relative_error(o, ro) < 1e-5 and relative_error(sn, rs) < 1e-5 and relative_error(o, _np(o2)) < 1e-5
