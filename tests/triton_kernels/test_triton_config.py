"""The backend's tile sizes per dtype (``kernel_config``), and the backend still right where they change."""

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from kernel_cases import cases, kernel_inputs, to_numpy64

import lightning_edu as le
from lightning_edu import triton_kernels
from lightning_edu.checks import relative_error
from lightning_edu.triton_kernels import kernel_config, plan
from lightning_edu.triton_kernels.plan import SLICE, choose_segments, prepass_tiles, sliced_forward, value_slices


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d, block, block_dv", [(32, 64, None), (64, 64, None), (96, 64, 64), (128, 64, 64),
                                                (192, 32, 64), (256, 32, 64)])
def test_16_bit_tiles_are_the_swept_ones(dtype, d, block, block_dv):
    cfg = kernel_config(d, d, dtype)
    assert (cfg["block"], cfg["block_dv"]) == (block, block_dv)
    assert (cfg["num_warps"], cfg["num_stages"]) == (4, 3 if d <= 64 else 2)  # 3 stages: the H100 sweep at d = 64


@pytest.mark.parametrize("d, block, block_dv, warps, stages", [
    (16, 16, None, 4, 2), (64, 16, None, 4, 2), (65, 16, 64, 8, 1), (128, 16, 64, 8, 1), (256, 32, 64, 8, 2)])
def test_fp32_tiles_on_a_gpu_are_16_rows_up_to_d_128(d, block, block_dv, warps, stages):
    # exact fp32 dots run on the FMA units: larger tiles spill and compile longer (measured on an H100)
    cfg = kernel_config(d, d, torch.float32)
    assert (cfg["block"], cfg["block_dv"], cfg["num_warps"], cfg["num_stages"]) == (block, block_dv, warps, stages)


@pytest.mark.parametrize("d, block", [(32, 64), (64, 64), (65, 32), (128, 32), (256, 32)])
def test_fp32_tiles_in_the_interpreter_keep_larger_blocks(d, block):
    # in the interpreter a block costs per operation: fewer, larger blocks run faster there
    cfg = kernel_config(d, d, torch.float32, interpreter=True)
    assert cfg["block"] == block
    assert {k: v for k, v in cfg.items() if k != "block"} == {k: v for k, v in kernel_config(d, d, torch.float32).items()
                                                             if k != "block"}


def test_16_bit_tiles_do_not_depend_on_the_interpreter():
    for d in (32, 64, 128, 256):
        assert kernel_config(d, d, torch.float16, interpreter=True) == kernel_config(d, d, torch.float16)


def test_the_wider_head_dim_decides_and_block_size_overrides():
    assert kernel_config(96, 16, torch.float32)["num_warps"] == 8
    assert kernel_config(16, 96, torch.float32)["num_warps"] == 8
    assert kernel_config(16, 96, torch.float32, interpreter=True)["block"] == 32
    assert kernel_config(16, 96, torch.bfloat16)["block"] == 64
    assert kernel_config(96, 96, torch.float32, block_size=64)["block"] == 64
    assert kernel_config(256, 256, torch.float32, block_size=64) == dict(block=64, block_dv=64, num_warps=8,
                                                                        num_stages=2)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, "float32", np.float32, None])
def test_dtype_must_be_a_torch_float_dtype(dtype):
    with pytest.raises(TypeError, match="torch floating-point dtype"):
        kernel_config(64, 64, dtype)


def test_backend_is_right_with_fp32_tiles_at_d_96(monkeypatch):
    seen = []
    monkeypatch.setattr(plan, "kernel_config", lambda *a, **kw: seen.append(kernel_config(*a, **kw)) or seen[-1])
    rng = np.random.default_rng(0)
    q, k = (rng.standard_normal((1, 2, 70, 96)) for _ in range(2))
    v, do = (rng.standard_normal((1, 2, 70, 40)) for _ in range(2))
    decay = [0.95, 0.5]
    o = le.lightning_attention(*(torch.from_numpy(x).float() for x in (q, k, v)), decay, backend="triton")
    assert seen and seen[0]["block"] == 32  # 70 rows: three 32-row blocks, the last one partial
    assert relative_error(o, le.lightning_attention(q, k, v, decay, backend="numpy")) < 1e-5
    grads = le.lightning_attention_backward(*(torch.from_numpy(x).float() for x in (q, k, v, do)), decay,
                                            backend="triton")
    for got, ref, name in zip(grads, le.lightning_attention_backward(q, k, v, do, decay, backend="numpy"),
                              ("dq", "dk", "dv")):
        assert relative_error(got, ref) < 1e-5, name


def test_launch_arithmetic_agrees_with_tritons():
    """The launchers' plain-Python cdiv and next_power_of_2 (Triton's cost ~5 us of host per call) give Triton's
    answers."""
    import triton

    from lightning_edu.triton_kernels._tiles import cdiv, next_power_of_2

    assert all(next_power_of_2(n) == triton.next_power_of_2(n) for n in range(1, 5000))
    assert all(cdiv(a, b) == triton.cdiv(a, b) for a in range(0, 400) for b in range(1, 70))


COUNTS = {"H", "heads", "n_programs"}  # integer counts a kernel must not be compiled again for (_tiles)
LENGTHS = {"n", "seg_len"}  # specialised on purpose: unspecialised, n cost the forward 6 % on an H100


def _kernels():
    import importlib

    for module in ("la1", "la2_literal", "la2_fast", "la3", "decode"):
        m = importlib.import_module(f"lightning_edu.triton_kernels.{module}")
        for name, obj in vars(m).items():
            if name.endswith("_kernel") and hasattr(obj, "arg_names"):
                yield f"{module}.{name}", obj


def _unspecialised(kernel) -> set:
    listed = getattr(kernel, "do_not_specialize", None)  # a compiled JITFunction keeps indices
    if listed is None:  # the interpreter's InterpretedFunction keeps the decorator's arguments
        listed = kernel.kwargs.get("do_not_specialize") or ()
    return {kernel.arg_names[i] if isinstance(i, int) else i for i in listed}


def test_kernels_are_compiled_once_for_every_head_count_and_grid():
    """Every kernel leaves its counts unspecialised (one compilation serves every head count and grid) and
    keeps its lengths specialised (measured faster)."""
    seen = dict(_kernels())
    assert len(seen) >= 11, sorted(seen)  # la1 3, la2_literal 3, la2_fast 3, la3 1, decode 1
    for name, kernel in seen.items():
        counts = COUNTS & set(kernel.arg_names)
        assert counts, f"{name} takes none of {sorted(COUNTS)}: update COUNTS"
        missing = counts - _unspecialised(kernel)
        assert not missing, f"{name} specialises on {sorted(missing)}: list them in do_not_specialize"
        assert not LENGTHS & _unspecialised(kernel), f"{name}: n and seg_len stay specialised (_tiles)"


def test_same_worker_groups_name_cuda_cases_only():
    """kernel_cases.cases: a case's group (pytest-xdist ``--dist loadgroup``) is put on cuda cases, where kernels
    compile, and never on cpu ones."""
    from kernel_cases import cases

    mark = cases("d", {"cpu": [16, 128], "cuda": [64, 128]}, same_worker=lambda case: "big" if case == (128,) else None)
    groups = {p.id: [m.args[0] for m in p.marks if m.name == "xdist_group"] for p in mark.args[1]}
    assert groups == {"cpu-16": [], "cpu-128": [], "cuda-64": [], "cuda-128": ["big"]}


# ---------------------------------------------------------------------------------------------------------
# How many segments, and the pre-pass's tiles.


@given(programs=st.integers(1, 600), n=st.integers(1, 300_000), block=st.sampled_from([16, 32, 64]),
       sms=st.sampled_from([4, 108, 132]), per_sm=st.sampled_from([None, 1, 2]))
def test_segments_fill_one_wave_of_programs_and_no_more(programs, n, block, sms, per_sm):
    if per_sm is None:  # the default: two programs per SM
        num_seg, seg_len = choose_segments(programs, n, block, sms)
        per_sm = 2
    else:
        num_seg, seg_len = choose_segments(programs, n, block, sms, per_sm=per_sm)
    blocks = -(-n // block)
    wave = max(1, per_sm * sms // programs)  # segments per (batch, head) program that one wave holds
    assert seg_len % block == 0 and (num_seg - 1) * seg_len < n <= num_seg * seg_len  # every row, no empty segment
    assert num_seg <= wave  # never a second wave, unless one segment already needs it
    assert 2 * num_seg >= min(wave, blocks)  # at least half the wave used (segments are whole, equal runs of blocks)


def test_segments_round_down_at_the_benchmarks_shapes():
    # 16 heads, d_v in two slices: 32 programs per segment on a 132-SM GPU -> 8 segments (256 programs), not 9
    assert choose_segments(32, 32768, 64, 132)[0] == 8
    assert choose_segments(16, 131072, 64, 132)[0] == 16  # not 17: 272 programs would start a second wave
    assert choose_segments(64, 8192, 64, 132)[0] == 4  # not 5
    # d_v whole with 8 warps, one program per SM: 16 heads of one sequence -> 8 segments (128 programs), not 16
    assert choose_segments(16, 32768, 64, 132, per_sm=1)[0] == 8
    assert choose_segments(16, 131072, 64, 132, per_sm=1)[0] == 8


def test_value_slices_are_64_columns_unless_given():
    # (d_v, block_dv) -> (block_dv, slices): whatever the pair count; d_v whole for many pairs is kernel_config's
    assert value_slices(128, None) == (64, 2)
    assert value_slices(256, None) == (64, 4)
    assert value_slices(64, None) == (64, 1)
    assert value_slices(48, None) == (64, 1)  # never wider than d_v padded to a power of two
    assert value_slices(24, None) == (32, 1)
    assert value_slices(96, 32) == (32, 3)  # a given slice is kept
    assert value_slices(128, 128) == (128, 1)


def test_fp32_cuts_d_v_into_64_column_slices_at_every_pair_count():
    # measured on an H100 at 16 to 256 pairs (kernel_config's docstring): slices 3.7-6.5x faster than d_v whole
    for d in (65, 96, 128):
        for pairs in (None, 4, 132, 133, 512):
            for interpreter in (False, True):
                cfg = kernel_config(d, d, torch.float32, interpreter=interpreter, batch_heads=pairs,
                                    sms=None if pairs is None else 132)
                assert cfg["block_dv"] == 64 and value_slices(d, cfg["block_dv"]) == (64, 2)
    assert kernel_config(64, 64, torch.float32)["block_dv"] is None  # d <= 64: one slice anyway


def test_a_short_sequence_is_one_segment_on_a_gpu_only():
    from lightning_edu.triton_kernels.plan import SHORT_BLOCKS, short_blocks

    assert short_blocks(torch.device("cuda")) == SHORT_BLOCKS == 4 and short_blocks(torch.device("cpu")) == 0
    for n in (1, 100, 256):  # up to 4 blocks of 64: one segment, no pre-pass
        assert choose_segments(4, n, 64, 132, short=4) == (1, 256 if n > 192 else -(-n // 64) * 64)
    assert choose_segments(4, 257, 64, 132, short=4)[0] == 5  # 5 blocks: one segment each, as without the rule
    assert choose_segments(4, 256, 64, 132) == (4, 64)  # the interpreter's rule (short=0): segments as before
    assert choose_segments(4, 256, 64, 132, seg_len=128, short=4) == (2, 128)  # a given seg_len is kept


def test_a_forward_without_backward_trades_segments_for_slices_at_the_benchmarks_shapes():
    # 16 heads on a 132-SM GPU, 32K tokens per call: (batch * heads, n, d_v) -> (block_dv, stages, seg_len) or None
    assert sliced_forward(64, 8192, 128, 64, 132) == (32, 3, 8192)  # d = 128, T = 8K: 256 programs, no pre-pass
    assert sliced_forward(32, 16384, 128, 64, 132) is None  # T = 16K: 128 programs, under two per SM
    assert sliced_forward(128, 4096, 128, 64, 132) is None  # 64-column slices already give 256 programs
    assert sliced_forward(64, 8192, 64, 64, 132) == (32, 3, 8192)  # d = 64, T = 8K: 128 programs, one per SM
    assert sliced_forward(16, 32768, 64, 64, 132) is None  # T = 32K: 32 programs
    assert sliced_forward(256, 2048, 64, 64, 132) is None  # T = 2K: 256 programs of 64 columns already
    assert sliced_forward(64, 1000, 128, 64, 132) == (32, 3, 1024)  # one segment: n rounded up to whole blocks
    assert sliced_forward(64, 8192, 256, 32, 132) is None  # beyond d = 128 the tiles are other
    assert sliced_forward(128, 8192, 32, 64, 132) is None  # d_v <= 32: 32-column slices add no programs


@st.composite
def slicing_problems(draw):
    """(batch_heads, n, d_v, block, sms), batch_heads drawn two times in three next to where the rule switches."""
    d_v = draw(st.sampled_from([16, 32, 48, 64, 96, 128, 192]))
    sms = draw(st.sampled_from([4, 108, 132]))
    edges = (-(-sms // -(-d_v // 64)), -(-_enough(d_v, sms) // -(-d_v // SLICE)))  # idle SMs end; slices fill
    near = st.sampled_from(edges).flatmap(lambda e: st.integers(max(1, e - 2), e + 2))
    batch_heads = draw(st.one_of(st.integers(1, 600), near, near))
    return batch_heads, draw(st.integers(1, 200_000)), d_v, draw(st.sampled_from([32, 64])), sms


def _enough(d_v, sms):
    """sliced_forward's contract: enough programs are one per SM less a tenth with at most two slices, else two
    per SM less an eighth."""
    return sms - sms // 10 if -(-d_v // SLICE) <= 2 else 2 * sms - sms // 8


@given(slicing_problems())
@example((64, 8192, 128, 64, 132))  # sliced: d = 128 at the benchmarks' 8K tokens
@example((64, 1000, 64, 64, 132))  # sliced: d = 64, n not whole blocks
def test_a_sliced_forward_is_one_segment_that_fills_the_chip(problem):
    batch_heads, n, d_v, block, sms = problem
    idle = batch_heads * -(-d_v // 64) < sms  # 64-column slices leave SMs idle
    fills = batch_heads * -(-d_v // SLICE) >= _enough(d_v, sms)  # 32-column slices give enough programs
    plan = sliced_forward(batch_heads, n, d_v, block, sms)
    assert (plan is not None) == (SLICE < d_v <= 128 and idle and fills), plan
    if plan is not None:
        block_dv, stages, seg_len = plan
        assert block_dv == SLICE and stages == 3
        assert seg_len % block == 0 and seg_len - block < n <= seg_len  # one segment, every row


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prepass_streams_32_row_blocks_in_16_bit(dtype):
    assert prepass_tiles(dtype, 4096, 64, 4, 2) == (32, 4, 4)
    assert prepass_tiles(dtype, 48, 16, 4, 2) == (16, 4, 2)  # a segment that is not whole 32-row blocks


def test_prepass_keeps_the_given_tiles_in_fp32():
    assert prepass_tiles(torch.float32, 4096, 32, 8, 2) == (32, 8, 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_more_head_pairs_than_sms_take_d_v_whole_above_d_64(dtype):
    """Two 64-column slices per (batch, head) would need more than one wave of programs: d_v whole, 8 warps."""
    whole = dict(block=64, block_dv=128, num_warps=8, num_stages=3)
    assert kernel_config(128, 128, dtype, batch_heads=256, sms=132) == whole
    assert kernel_config(96, 128, dtype, batch_heads=133, sms=132) == whole
    assert kernel_config(128, 128, dtype, block_size=32, batch_heads=256, sms=132)["block"] == 32
    for pairs in (4, 132):  # the slices fit in one wave (two programs per SM)
        assert kernel_config(128, 128, dtype, batch_heads=pairs, sms=132) == kernel_config(128, 128, dtype)
    for d in (64, 192):  # d_v <= 64 is never sliced; above 128 the 32-row tiles stay
        assert kernel_config(d, d, dtype, batch_heads=256, sms=132) == kernel_config(d, d, dtype)
    assert kernel_config(128, 128, torch.float32, batch_heads=256, sms=132) == kernel_config(128, 128, torch.float32)


@cases("shape,dtype", {
    # in the interpreter the device has 4 SMs: 6 (batch, head) pairs are more than it has
    "cpu": [((1, 6, 70, 96, 80), torch.float16)],
    "cuda": [((8, 17, 201, 128, 128), dtype) for dtype in (torch.bfloat16, torch.float16)],  # 136 pairs, 132 SMs
})
def test_backend_is_right_with_d_v_whole_for_many_heads(device, shape, dtype):
    from lightning_edu.triton_kernels import ops
    from lightning_edu.triton_kernels._tiles import sm_count

    q, k, v, do, _, _ = kernel_inputs(shape, device, dtype, seed=11)
    if shape[0] * shape[1] <= sm_count(q.device):
        pytest.skip(f"this GPU's {sm_count(q.device)} SMs take this many (batch, head) pairs in 64-column slices")
    for save in (False, True):
        cfg, _, _ = ops.launch_plan(q, v, None, save_states=save)
        assert (cfg["block_dv"], cfg["num_warps"]) == (128, 8)
    lam = np.linspace(0.9, 1.0, shape[1])
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o = le.lightning_attention(*leaves, lam, backend="triton")
    o.backward(do)
    # the float64 reference: the torch backend on the CPU (vectorised, with autograd)
    ref = [torch.from_numpy(to_numpy64(x)).requires_grad_() for x in (q, k, v)]
    o64 = le.lightning_attention(*ref, lam, backend="torch")
    o64.backward(torch.from_numpy(to_numpy64(do)))
    bound = 5e-3 if dtype == torch.float16 else 2e-2
    assert relative_error(o, o64) < bound
    for name, x, want in zip(("dq", "dk", "dv"), leaves, ref):
        assert relative_error(x.grad, want.grad) < bound, name
