"""The one-pass forward (:mod:`lightning_edu.triton_kernels.lookback`), chained scan and decoupled look-back,
against float64.

In the interpreter programs run one at a time in ticket order, so every wait ends at once; on a GPU the
segments of a sequence run side by side (many short segments: waits and walks happen), so the cuda cases are
the ones that test the hand-off between programs. Each cuda case calls the kernel several times: a race shows
as an occasional wrong answer.
"""

import numpy as np
import pytest
import torch
from kernel_cases import cases, kernel_inputs, on, synchronize
from kernel_cases import to_numpy64 as _np

from lightning_edu.checks import relative_error
from lightning_edu.numpy_blockwise import blockwise_forward
from lightning_edu.triton_kernels import log2_decay_tensor
from lightning_edu.triton_kernels.la2_fast import la2_fast_forward
from lightning_edu.triton_kernels.lookback import lookback_forward

BOUNDS = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
MODES = (True, False)  # look-back, chained scan


@cases("shape,decays,seg_len,lookback,dtype,calls", {
    "cpu": [(shape, decays, seg_len, lookback, torch.float32, 2)
            for shape, decays, seg_len in [((1, 2, 1, 16, 16), [1.0, 0.5], 16),
                                           ((1, 2, 100, 16, 48), [0.999, 1e-3], 32),
                                           ((2, 1, 130, 32, 16), [1.0], 48)]
            for lookback in MODES],
    "cuda": [(shape, [1.0, 0.99, 0.05][:shape[1]], seg_len, lookback, dtype, 10)
             for shape, seg_len in [((2, 3, 1000, 64, 64), 128), ((1, 2, 4099, 128, 128), 128),
                                    ((1, 3, 777, 64, 32), None)]
             for lookback in MODES for dtype in (torch.bfloat16, torch.float16)]
            + [((1, 2, 999, 64, 48), [1.0, 0.9], 64, lookback, torch.float32, 3) for lookback in MODES],
})
def test_one_pass_forward_matches_float64(device, shape, decays, seg_len, lookback, dtype, calls):
    q, k, v, _, s0, _ = kernel_inputs(shape, device, dtype)
    lam = np.array(decays)
    l2 = log2_decay_tensor(lam, device)
    block = 16 if device == "cpu" else None
    ro, rs = blockwise_forward(_np(q), _np(k), _np(v), lam, 64, _np(s0))
    for _ in range(calls):
        o, sn = lookback_forward(q, k, v, l2, s0, seg_len=seg_len, lookback=lookback, block=block)
        synchronize(device)
        assert o.dtype == dtype and sn.dtype == torch.float32
        assert relative_error(o, ro) < BOUNDS[dtype]
        assert relative_error(sn, rs) < BOUNDS[dtype]


@cases("lookback", {"cuda": list(MODES)})
def test_one_pass_forward_agrees_with_two_pass_on_many_segments(device, lookback):
    # 32 heads x 64 segments of 64 rows: far more programs than the GPU holds at once, so segments wait on
    # programs still running. The two-pass forward computes the same sums in nearly the same order.
    q, k, v, _, _, _ = kernel_inputs((2, 16, 4096, 64, 64), device, torch.bfloat16, seed=3)
    l2 = log2_decay_tensor(np.linspace(0.9, 1.0, 16), device)
    o2, s2 = la2_fast_forward(q, k, v, l2)
    for _ in range(20):
        o1, s1 = lookback_forward(q, k, v, l2, seg_len=64, lookback=lookback)
        assert relative_error(o1, o2) < 1e-2 and relative_error(s1, s2) < 1e-5


@on("cuda")
def test_chained_scan_gives_the_same_bits_every_call(device):
    # The chained scan adds the same terms in the same order whatever the timing; the look-back does not
    # (how far a walk goes depends on which predecessors have finished).
    q, k, v, _, _, _ = kernel_inputs((2, 8, 2048, 64, 64), device, torch.bfloat16, seed=4)
    l2 = log2_decay_tensor(np.full(8, 0.99), device)
    first = lookback_forward(q, k, v, l2, seg_len=128, lookback=False)
    for _ in range(5):
        again = lookback_forward(q, k, v, l2, seg_len=128, lookback=False)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])


@cases("lookback,dtype", {"cpu": [(lb, torch.float32) for lb in MODES],
                          "cuda": [(lb, torch.bfloat16) for lb in MODES]})
def test_one_pass_forward_keeps_non_finite_values_causal(device, lookback, dtype):
    q, k, v, _, _, _ = kernel_inputs((1, 2, 300, 16 if device == "cpu" else 64, 32), device, dtype, seed=5)
    l2 = log2_decay_tensor(np.array([0.9, 0.95]), device)
    extra = dict(block=16, seg_len=32) if device == "cpu" else dict(seg_len=64)
    clean = lookback_forward(q, k, v, l2, lookback=lookback, **extra)[0]
    k[0, 1, 130, 3] = float("nan")
    o, sn = lookback_forward(q, k, v, l2, lookback=lookback, **extra)
    synchronize(device)
    bad = torch.isnan(o[0, 1]).any(-1)
    assert not bad[:130].any() and bad[130:].all()  # exactly the rows at and after the NaN, in its head
    assert torch.equal(o[0, 0], clean[0, 0]) and torch.equal(o[0, 1, :130], clean[0, 1, :130])
    assert torch.isnan(sn[0, 1]).any() and not torch.isnan(sn[0, 0]).any()


@on("cpu")
def test_one_pass_forward_refuses_bad_segment_lengths_and_interpreted_bf16(device):
    q, k, v, _, _, _ = kernel_inputs((1, 1, 40, 16, 16), device)
    l2 = log2_decay_tensor(np.array([0.9]), device)
    for seg_len in (24, 0, 32.0):
        with pytest.raises(ValueError, match=r"seg_len must be a positive multiple of the block size 16, got"):
            lookback_forward(q, k, v, l2, seg_len=seg_len, block=16)
    with pytest.raises(TypeError, match="bfloat16"):
        lookback_forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), l2, block=16)


def test_lookback_record_covers_every_shape_and_way():
    # The committed H100 record (chapter 07) was made by perf.lookback as it stands: every shape, every
    # segment length in both ways, and the profiled forwards its child names.
    import json
    from pathlib import Path

    from benchmarks import lookback as perf_lookback

    record = json.loads((Path(__file__).resolve().parents[2] / "notebooks" / "data" / "lookback_h100.json").read_text())
    assert [(r["d"], r["T"]) for r in record["results"]] == list(perf_lookback.SHAPES)
    for row in record["results"]:
        assert sorted((x["seg_len"], x["lookback"]) for x in row["variants"]) == sorted(
            (s, lb) for s in perf_lookback.SEG_LENS for lb in MODES)
    ways = {f"{'look-back' if lb else 'chained'} {s}" for s in perf_lookback.NCU_SEG_LENS for lb in MODES}
    for shape in record["ncu"]:
        assert {x["pass"] for x in shape["launches"]} == ways | {"two-pass"}


def test_lookback_measurement_refuses_bad_command_lines(capsys):
    from benchmarks import lookback as perf_lookback

    assert perf_lookback.main(["--help"]) == 0
    assert perf_lookback.main([]) == 2 and perf_lookback.main(["a.json", "b.json"]) == 2
    assert "python -m benchmarks.lookback OUT.json [--ncu]" in capsys.readouterr().out


@on("cpu")
def test_one_pass_forward_reads_views_of_a_projection_in_place(device):
    # q, k, v as a model makes them: views of one (batch, n, 3, heads, d) projection, not contiguous; the output
    # is laid out as v's (output_like), and the result is the contiguous inputs' bit for bit.
    b, n, h, d = 2, 70, 2, 16
    x = torch.randn(b, n, 3 * h * d, generator=torch.Generator().manual_seed(6))
    q, k, v = x.view(b, n, 3, h, d).permute(2, 0, 3, 1, 4)
    l2 = log2_decay_tensor(np.array([0.9, 1.0]), device)
    for lookback in MODES:
        o, sn = lookback_forward(q, k, v, l2, seg_len=32, lookback=lookback, block=16)
        o_dense, sn_dense = lookback_forward(q.contiguous(), k.contiguous(), v.contiguous(), l2, seg_len=32,
                                             lookback=lookback, block=16)
        assert not q.is_contiguous() and torch.equal(o, o_dense) and torch.equal(sn, sn_dense)
