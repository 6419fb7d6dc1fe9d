"""The recompute-heavy backward (la3) on a real GPU: every tile choice of the chapter-09 sweep against float64,
and the shared-memory claim read from the compiled kernels. Skipped without CUDA (tests/gpu/conftest.py)."""

import numpy as np
import pytest
import torch

from lightning_edu.checks import relative_error
from lightning_edu.numpy_blockwise import blockwise_backward
from lightning_edu.perf.la3_sweep import TILES
from lightning_edu.perf.resources import SM120_SHARED_LIMIT, compiled_resources
from lightning_edu.triton_kernels import kernel_config, log2_decay_tensor
from lightning_edu.triton_kernels.la2_fast import la2_fast_forward
from lightning_edu.triton_kernels.la3 import la3_backward

BOUNDS = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
DECAYS = np.array([1.0, 0.999, 1e-3])


def _case(batch, heads, n, d_k, d_v, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *s: (torch.randn(*s, device="cuda", generator=g) / 2).to(dtype)  # noqa: E731
    q, k, v, do = mk(batch, heads, n, d_k), mk(batch, heads, n, d_k), mk(batch, heads, n, d_v), mk(batch, heads, n, d_v)
    s0, dsn = (torch.randn(batch, heads, d_k, d_v, device="cuda", generator=g) for _ in range(2))
    return q, k, v, do, s0, dsn


def _np(x):
    return x.detach().double().cpu().numpy()


@pytest.mark.parametrize("tiles", sorted(TILES))
# (2, 3, 517, 64, 32): 64-row micro-chunks fault there on Triton 3.6 (an H100), so la3_dkdv takes 16-row ones.
@pytest.mark.parametrize("shape", [(2, 3, 1000, 64, 64), (1, 3, 4099, 128, 128), (1, 2, 333, 128, 64), (1, 3, 77, 16, 32),
                                   (2, 3, 517, 64, 32)],
                         ids=lambda s: "x".join(map(str, s)))
def test_every_tile_choice_is_correct_in_bf16(shape, tiles):
    q, k, v, do, s0, dsn = _case(*shape, torch.bfloat16)
    lam = DECAYS[: shape[1]]
    l2 = log2_decay_tensor(lam, "cuda")
    _, _, saved = la2_fast_forward(q, k, v, l2, s0, save_states=True)
    grads = la3_backward(q, k, v, do, l2, s0, dsn, saved=saved, **TILES[tiles])
    ref = blockwise_backward(_np(q), _np(k), _np(v), _np(do), lam, 64, _np(s0), _np(dsn))
    for name, got, want in zip(("dq", "dk", "dv", "d_state"), grads, ref):
        assert relative_error(got, want) < BOUNDS[torch.bfloat16], name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("d", [64, 128])
def test_every_la3_kernel_fits_in_99_kib_of_shared_memory(d, dtype):
    q, k, v, do, s0, dsn = _case(1, 2, 700, d, d, dtype, seed=1)
    l2 = log2_decay_tensor(DECAYS[:2], "cuda")
    cfg = kernel_config(d, d, dtype)  # the backend's tiles: 32-row blocks for fp32 at d = 128
    records = compiled_resources(lambda: la3_backward(q, k, v, do, l2, s0, dsn, seg_len=256, **cfg), fresh=True)
    kernels = {r["kernel"] for r in records}
    assert {"_segment_state_kernel", "_la2_fast_forward_kernel", "_la3_dkdv_kernel"} <= kernels, kernels
    for r in records:
        assert r["shared"] <= SM120_SHARED_LIMIT, r
