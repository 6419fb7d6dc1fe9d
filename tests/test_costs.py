"""The cost model (lightning_edu.costs) against hand counts and against the numpy code it models."""

import math
import types

import numpy as np
import pytest

from lightning_edu import numpy_blockwise
from lightning_edu.costs import Hardware, attention_cost, block_size_sweep, modelled_time, optimal_block_size


# ---------------------------------------------------------------- hand counts, written out
def test_blockwise_forward_hand_count_n4_B2_d1():
    # Two blocks of b = 2 rows, d_k = d_v = 1. Per block:
    #   intra: Q_i K_i^T 4 entries x 1 multiply-add = 8 FLOPs; * M 4; (.) V_i 2 rows x 2 multiply-adds = 8 -> 20
    #   inter: lambda^(r+1) Q_i 2; (.) KV 2 rows x 1 multiply-add = 4; intra + inter 2             -> 8
    #   state: lambda^b KV 1; lambda^(b-1-r) K_i 2; K_i^T V_i 1 entry x 2 multiply-adds = 4; + 1    -> 8
    c = attention_cost("blockwise", n=4, d_k=1, d_v=1, block_size=2)
    assert (c.intra_flops, c.inter_flops, c.state_flops, c.flops) == (40, 16, 16, 72)
    assert (c.num_blocks, c.sequential_steps) == (2, 2)
    # fp32: read Q, K, V and write O: 4 tensors x 4 tokens x 1 x 4 bytes
    assert c.hbm_bytes == 64
    # on chip: Q_i, K_i, V_i, O_i (4 x 2), score tile and M (2 x 4), KV (1) = 17 elements
    assert c.sram_bytes_per_block == 17 * 4


def test_blockwise_forward_hand_count_partial_last_block():
    # n = 5, B = 2: blocks of 2, 2, 1 rows. The 1-row block: intra 2 + 1 + 2 = 5, inter 1 + 2 + 1 = 4,
    # state 1 + 1 + 2 + 1 = 5; the two full blocks as above (20, 8, 8 each).
    c = attention_cost("blockwise", 5, 1, 1, 2)
    assert (c.intra_flops, c.inter_flops, c.state_flops) == (45, 20, 21)
    assert (c.num_blocks, c.sequential_steps) == (3, 3)


def test_recurrent_hand_count():
    # per token, d = 1: lambda KV 1, k_t^T v_t 1, add 1 (state, 3); q_t KV_t one multiply-add (inter, 2)
    c = attention_cost("recurrent", 4, 1)
    assert (c.intra_flops, c.inter_flops, c.state_flops) == (0, 8, 12)
    assert (c.num_blocks, c.sequential_steps, c.block_size) == (4, 4, 1)
    # d_k = 2, d_v = 3: per token 3 * 6 + 2 * 6 = 30 FLOPs
    assert attention_cost("recurrent", 7, 2, 3).flops == 7 * 30


def test_masked_hand_count():
    # n = 4, d = 1: Q K^T 16 multiply-adds = 32; * M 16; (.) V 16 multiply-adds = 32. All "intra", one step.
    c = attention_cost("masked", 4, 1, dtype_bytes=2)
    assert (c.intra_flops, c.inter_flops, c.state_flops, c.sequential_steps) == (80, 0, 0, 1)
    # Q, K, V, O (16 elements) plus the 4 x 4 matrix written and read back (32), 2 bytes each
    assert c.hbm_bytes == (16 + 32) * 2
    assert c.sram_bytes_per_block == 16 * 2


def test_batch_and_heads_scale_flops_and_bytes_not_working_set():
    one = attention_cost("blockwise", 37, 5, 3, 8)
    many = attention_cost("blockwise", 37, 5, 3, 8, batch=2, heads=3)
    assert many.flops == 6 * one.flops and many.hbm_bytes == 6 * one.hbm_bytes
    assert many.sram_bytes_per_block == one.sram_bytes_per_block
    assert many.sequential_steps == one.sequential_steps == 5


def test_one_block_is_masked_plus_an_empty_state():
    # B >= n: the single block's intra part is exactly the masked product
    c = attention_cost("blockwise", 37, 4, 6, 64)
    m = attention_cost("masked", 37, 4, 6)
    assert c.intra_flops == m.intra_flops and c.num_blocks == 1
    # B = 1 does the recurrence's work plus, per token: a 1 x 1 "masked" product q k^T * M times v
    # (2 d_k + 1 + 2 d_v), scaling q and k (d_k each), adding intra + inter (d_v), and k^T v as a matmul
    # of inner size 1 (multiply-adds: 2 d_k d_v instead of the outer product's d_k d_v multiplies).
    r = attention_cost("recurrent", 37, 4, 6)
    b1 = attention_cost("blockwise", 37, 4, 6, 1)
    assert b1.flops - r.flops == 37 * ((2 * 4 + 1 + 2 * 6) + 4 + 4 + 6 + 4 * 6)


def test_backward_hand_count_n2_B2_d1():
    # one block of 2 rows, d = 1. Three masked products of 20 FLOPs each (dQ, dK, dV) = 60.
    # inter: dQ (4 + 2 + 2), dK (4 + 2 + 2), dV (4 + 2 + 2) = 24. state: KV 8 and dKV 8 = 16.
    c = attention_cost("blockwise", 2, 1, 1, 2, direction="backward")
    assert (c.intra_flops, c.inter_flops, c.state_flops) == (60, 24, 16)
    assert c.sequential_steps == 2
    # reads K, V, dO then Q, K, V, dO (7 x 2), writes dQ, dK, dV (3 x 2), 4 bytes
    assert c.hbm_bytes == (14 + 6) * 4


# ---------------------------------------------------------------- against the code itself
class _Counting(np.ndarray):
    """An ndarray that counts multiply-adds of matmul and elementwise multiplies/adds done with it."""

    counts = {"mac": 0, "elementwise": 0}

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        plain = [np.asarray(x) if isinstance(x, _Counting) else x for x in inputs]
        out = getattr(ufunc, method)(*plain, **kwargs)
        if method == "__call__" and ufunc is np.matmul:
            _Counting.counts["mac"] += int(np.prod(out.shape)) * plain[0].shape[-1]
        elif method == "__call__" and ufunc in (np.multiply, np.add):
            _Counting.counts["elementwise"] += int(np.size(out))
        # Not counted: decay factors, and masked_product's finite test (a comparison per element, no arithmetic).
        elif method == "__call__" and ufunc not in (np.power, np.square, np.isfinite, np.invert):
            raise AssertionError(f"the cost model does not count {ufunc.__name__}: extend the model or this test")
        return out.view(_Counting) if isinstance(out, np.ndarray) else out


@pytest.fixture
def counting_numpy(monkeypatch):
    """numpy_blockwise, with every array it creates counting the arithmetic done on it."""
    proxy = types.ModuleType("np")
    proxy.__getattr__ = lambda name: getattr(np, name)
    for name in dir(np):
        if not name.startswith("__"):
            setattr(proxy, name, getattr(np, name))
    for name in ("asarray", "array", "zeros", "empty", "zeros_like", "empty_like"):
        make = getattr(np, name)
        setattr(proxy, name, lambda *a, _make=make, **k: _make(*a, **k).view(_Counting))
    monkeypatch.setattr(numpy_blockwise, "np", proxy)
    _Counting.counts.update(mac=0, elementwise=0)
    return _Counting.counts


@pytest.mark.parametrize("batch,heads,n,d_k,d_v,block", [(1, 1, 4, 1, 1, 2), (2, 3, 37, 5, 4, 8), (1, 2, 130, 8, 3, 64), (1, 1, 7, 3, 2, 100)])
def test_forward_model_counts_what_blockwise_forward_computes(counting_numpy, batch, heads, n, d_k, d_v, block):
    rng = np.random.default_rng(n)
    q, k = rng.standard_normal((2, batch, heads, n, d_k))
    v = rng.standard_normal((batch, heads, n, d_v))
    numpy_blockwise.blockwise_forward(q, k, v, np.linspace(0.5, 1.0, heads), block)
    counted = 2 * counting_numpy["mac"] + counting_numpy["elementwise"]
    assert counting_numpy["mac"] > 0  # the harness really saw the products
    assert attention_cost("blockwise", n, d_k, d_v, block, batch=batch, heads=heads).flops == counted


@pytest.mark.parametrize("batch,heads,n,d_k,d_v,block", [(1, 1, 2, 1, 1, 2), (2, 3, 37, 5, 4, 8), (1, 2, 130, 8, 3, 64)])
def test_backward_model_counts_what_blockwise_backward_computes(counting_numpy, batch, heads, n, d_k, d_v, block):
    rng = np.random.default_rng(n)
    q, k = rng.standard_normal((2, batch, heads, n, d_k))
    v, do = rng.standard_normal((2, batch, heads, n, d_v))
    numpy_blockwise.blockwise_backward(q, k, v, do, 0.9, block)
    counted = 2 * counting_numpy["mac"] + counting_numpy["elementwise"]
    cost = attention_cost("blockwise", n, d_k, d_v, block, batch=batch, heads=heads, direction="backward")
    assert cost.flops == counted


# ---------------------------------------------------------------- the time model and the optimum
def test_optimum_matches_the_closed_form():
    # d = 1, n a multiple of B: FLOPs = n B (4d+1) + n (2d + 2d^2 + d + 2d^2) + (n / B) 2 d^2, and
    # n / B steps. With peak 1 FLOP/s, step latency L and free memory traffic, time = 5 n B + (2 + L) n / B
    # + const, minimal at B* = sqrt((2 + L) / 5). L = 20478 gives B* = 64 exactly.
    hw = Hardware(peak_flops=1.0, hbm_bandwidth=1e30, sram_bytes=10**12, step_latency=20478.0)
    assert optimal_block_size(4096, 1, hardware=hw) == 64
    hw_fast_steps = Hardware(peak_flops=1.0, hbm_bandwidth=1e30, sram_bytes=10**12, step_latency=1e-9)
    assert optimal_block_size(4096, 1, hardware=hw_fast_steps) == 16
    hw_slow_steps = Hardware(peak_flops=1.0, hbm_bandwidth=1e30, sram_bytes=10**12, step_latency=1e9)
    assert optimal_block_size(4096, 1, hardware=hw_slow_steps) == 1024


def test_sram_limit_caps_the_block_size():
    # fp16, d = 64: B = 128 needs 2 * (128 * 256 + 2 * 128^2 + 64^2) = 139264 bytes, B = 256 needs 401408
    assert attention_cost("blockwise", 4096, 64, 64, 128, dtype_bytes=2).sram_bytes_per_block == 139264
    hw = Hardware(sram_bytes=200_000, step_latency=1.0)  # huge step latency: as large a B as fits
    assert optimal_block_size(4096, 64, dtype_bytes=2, hardware=hw) == 128
    assert math.isinf(modelled_time(attention_cost("blockwise", 4096, 64, 64, 256, dtype_bytes=2), hw))
    assert optimal_block_size(4096, 64, dtype_bytes=2, hardware=hw, check_sram=False) == 1024
    with pytest.raises(ValueError, match="fits"):
        optimal_block_size(4096, 64, dtype_bytes=2, hardware=Hardware(sram_bytes=1000))


def test_sweep_intra_grows_inter_is_flat():
    costs = block_size_sweep(4096, 64)
    intra = [c.intra_flops for c in costs]
    inter = [c.inter_flops for c in costs]
    assert all(a * 2 == b for a, b in zip(intra, intra[1:]))  # n B (4d + 1): doubles with B
    assert len(set(inter)) == 1  # per row, not per block
    assert [c.sequential_steps for c in costs] == [256, 128, 64, 32, 16, 8, 4]


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(algorithm="blockwise", n=0, d_k=4, block_size=2), ValueError, "n must be a positive integer"),
        (dict(algorithm="blockwise", n=8, d_k=4.0, block_size=2), TypeError, "d_k must be a positive integer, got float"),
        (dict(algorithm="blockwise", n=8, d_k=4, block_size=True), TypeError, "block_size must be a positive integer, got bool"),
        (dict(algorithm="blockwise", n=8, d_k=4), ValueError, "block_size must be a positive integer for algorithm='blockwise'"),
        (dict(algorithm="blockwise", n=8, d_k=4, block_size=2, heads=-1), ValueError, "heads must be a positive integer"),
        (dict(algorithm="blockwise", n=8, d_k=4, block_size=2, dtype_bytes="bf16"), TypeError, "dtype_bytes must be a positive integer, got str"),
        (dict(algorithm="flash", n=8, d_k=4), ValueError, "algorithm must be one of"),
        (dict(algorithm="masked", n=8, d_k=4, direction="backward"), ValueError, "algorithm='blockwise' only"),
        (dict(algorithm="blockwise", n=8, d_k=4, block_size=2, direction="sideways"), ValueError, "direction must be one of"),
    ],
)
def test_errors_name_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        attention_cost(**kwargs)


def test_hardware_and_time_arguments_are_checked():
    with pytest.raises(ValueError, match="step_latency must be positive"):
        Hardware(step_latency=0.0)
    with pytest.raises(ValueError, match="peak_flops must be a finite real number"):
        Hardware(peak_flops=float("inf"))
    with pytest.raises(TypeError, match="peak_flops must be a finite real number, got str"):
        Hardware(peak_flops="1e15")
    with pytest.raises(TypeError, match="cost must be"):
        modelled_time({"flops": 1})
    with pytest.raises(ValueError, match="at least one block size"):
        block_size_sweep(64, 4, block_sizes=[])


@pytest.mark.parametrize("n, d_k, d_v, dq_block", [(1024, 64, 64, 64), (1000, 32, 48, 64), (37, 16, 8, 16)])
def test_la3_cost_counts_every_block_of_the_dq_pass(n, d_k, d_v, dq_block):
    # dQ is Algorithm 1 with (dO, V, K): the blockwise forward's FLOPs with d_k and d_v swapped, block by block;
    # the dK/dV sweep's FLOPs from la3_cost's own formula (chunks of 64, micro-chunks of 16)
    from lightning_edu.costs import attention_cost, la3_cost

    fwd = attention_cost("blockwise", n, d_v, d_k, dq_block)
    dq = fwd.intra_flops + fwd.inter_flops + fwd.state_flops
    chunk, micro = 64, 16
    nm, chunks = chunk // micro, -(-n // chunk)
    dkdv = chunks * (nm * (nm + 1) // 2 * 2 * micro * micro * (2 * d_k + 2 * d_v) + nm * 4 * micro * d_k * d_v
                     + 2 * chunk * d_k * d_v)
    assert la3_cost(n, d_k, d_v, chunk, micro, dq_block=dq_block)["flops"] == dq + dkdv


def test_one_pass_balance_counts_kv_saved_against_states_handed_on():
    from lightning_edu.costs import one_pass_balance

    # d = 128: a 256-row segment's K and V (2 x 256 x 128 x 2 bytes) against one 128 x 128 float32 state written and read
    assert one_pass_balance(128, 256, 1) == 2 * 256 * 128 * 2 - 2 * 128 * 128 * 4 == 0
    assert one_pass_balance(64, 1024, 2) == 2 * 1024 * 64 * 2 - 2 * 2 * 64 * 64 * 4 == 196608
    assert one_pass_balance(128, 256, 1, elem_bytes=4) > 0 > one_pass_balance(128, 256, 1, state_bytes=8)
    for bad in ({"handoffs": 0}, {"seg_len": -1}, {"d": 2.5}):
        args = {"d": 128, "seg_len": 256, "handoffs": 1, **bad}
        with pytest.raises((ValueError, TypeError), match=next(iter(bad))):
            one_pass_balance(**args)
