"""la2_fast's forward with descriptor loads (:mod:`lightning_edu.triton_kernels.la2_tma`), against float64 and
against la2_fast's own kernel: the same arithmetic, so the same bits, in the interpreter and on a GPU."""

import numpy as np
import pytest
import torch
from kernel_cases import cases, kernel_inputs, on, synchronize
from kernel_cases import to_numpy64 as _np

from lightning_edu.checks import relative_error
from lightning_edu.numpy_blockwise import blockwise_forward
from lightning_edu.triton_kernels import log2_decay_tensor
from lightning_edu.triton_kernels.la2_fast import backend_tiles, la2_fast_forward
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
    o2, s2 = la2_fast_forward(q, k, v, l2, s0, **cfg)
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
    from lightning_edu.perf import tma as perf_tma

    assert perf_tma.main(["--help"]) == 0
    assert perf_tma.main([]) == 2 and perf_tma.main(["a.json", "b.json"]) == 2
    assert "python -m lightning_edu.perf.tma OUT.json" in capsys.readouterr().out
