"""The benchmark harness's bookkeeping, on the CPU: timing needs a GPU, the arithmetic around it does not."""

import types

import pytest
import torch

from lightning_edu.perf import bench


def test_hbm_floor_counts_four_tensors_forward_and_seven_backward():
    # 16 x 2048 x 16 x 128 bf16 elements per tensor = 128 MiB (the benchmark's shape at T = 2K)
    assert bench.hbm_floor_bytes(16, 2048, 16, 128) == 4 * 2**27
    assert bench.hbm_floor_bytes(16, 2048, 16, 128, backward=True) == 7 * 2**27


def test_refuses_to_time_without_a_gpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(SystemExit, match="refusing to time"):
        bench.main(["--T", "2048"])


def test_measure_reports_time_and_peak_beyond_the_outputs(monkeypatch):
    # A fake CUDA allocator: each call of a method allocates a known number of bytes at its peak.
    state = {"allocated": 1000, "peak": 1000}

    def run(nbytes):
        def fn():
            state["peak"] = max(state["peak"], state["allocated"] + nbytes)
        return fn

    fake_cuda = types.SimpleNamespace(
        synchronize=lambda: None,
        reset_peak_memory_stats=lambda: state.update(peak=state["allocated"]),
        memory_allocated=lambda: state["allocated"],
        max_memory_allocated=lambda: state["peak"],
    )
    monkeypatch.setattr(torch, "cuda", fake_cuda)
    monkeypatch.setattr("triton.testing.do_bench", lambda fn, **kw: 2.5)
    q = torch.zeros(1, 1, 8, 4)  # 32 float32 elements: 128 bytes per tensor
    row = bench._measure(lambda *a: (run(500), run(2000)), q, q, q, [1.0], q)
    assert row == {"fwd_ms": 2.5, "fwd_peak_extra_bytes": 500 - 128,
                   "fwdbwd_ms": 2.5, "fwdbwd_peak_extra_bytes": 2000 - 3 * 128}
