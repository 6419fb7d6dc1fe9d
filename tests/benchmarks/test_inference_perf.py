"""Chapter 10's measurement tools on the CPU: the memory formulas against real tensors, the drift measurement's
invariants and its refusals, the explainer's memory table. (The GPU measurement itself is recorded data.)"""

import numpy as np
import pytest
import torch

from lightning_edu import errata
from benchmarks import decode
from lightning_edu import costs, drift


def test_memory_formulas_count_the_bytes_of_real_tensors():
    layers, heads, d, n, batch = 2, 3, 16, 50, 4
    cache = [torch.empty(batch, heads, n, d, dtype=torch.bfloat16) for _ in range(2 * layers)]  # K and V per layer
    states = [torch.empty(batch, heads, d, 8, dtype=torch.float32) for _ in range(layers)]
    assert costs.kv_cache_bytes(n, layers=layers, heads=heads, head_dim=d, batch=batch) == sum(
        t.numel() * t.element_size() for t in cache)
    assert costs.state_bytes(layers=layers, heads=heads, d_k=d, d_v=8, batch=batch) == sum(
        t.numel() * t.element_size() for t in states)
    rows = costs.memory_table()
    assert [r["tokens"] for r in rows] == list(costs.CONTEXTS)
    assert all(r["ratio"] == r["kv_cache_bytes"] / r["state_bytes"] for r in rows)
    # break-even at n = d: 2 n d x 2 bytes = d^2 x 4 bytes
    assert costs.kv_cache_bytes(128, layers=1, heads=1, head_dim=128) == costs.state_bytes(layers=1, heads=1, d_k=128)


def test_step_floor_counts_state_twice_and_the_vectors_once():
    b, h, dk, dv = 3, 2, 8, 4
    assert costs.step_floor_bytes(b, h, dk, dv) == b * h * (2 * dk * dv * 4 + (2 * dk + 2 * dv) * 2)


def test_decode_main_refuses_without_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA present: main would measure")
    assert decode.main(["/tmp/never.json"]) == 2
    assert "CUDA" in capsys.readouterr().out


def test_explainer_table_first_column_is_the_score_matrix_and_the_rest_is_not_what_it_says():
    for r in errata.explainer_memory_table():
        n = r["tokens"]
        assert r["printed_standard"] == n * n * 2
        assert r["kv_cache"] == 2 * n * 128 * 2 and r["printed_flash"] * 4 == r["kv_cache"]
        assert r["state_fp32"] == 128 * 128 * 4 and r["printed_lightning"] == 32 * r["state_fp32"]


@pytest.mark.parametrize("update", drift.UPDATES)
@pytest.mark.parametrize("decay", [1.0, 0.99])
def test_float64_state_is_near_exact_and_kahan_beats_float32_at_decay_one(update, decay):
    runs = {s: drift.state_drift(8192, decay, state=s, update=update, points=6) for s in drift.STATES}
    assert max(runs["float64"]["state_error"]) < 1e-13
    assert max(runs["float32"]["state_error"]) < 1e-5
    assert runs["float32"]["positions"] == runs["kahan"]["positions"]
    if decay == 1.0 and update == "token":
        assert runs["kahan"]["state_error"][-1] < runs["float32"]["state_error"][-1] / 5


def test_state_norm_is_the_float64_states_norm():
    """The positive distribution's state grows like n: the norm at 8K is about 8 times the norm at 1K."""
    r = drift.state_drift(8192, 1.0, distribution="positive", points=4)
    pos, norm = np.array(r["positions"]), np.array(r["state_norm"])
    ratio = (norm[-1] / norm[0]) / (pos[-1] / pos[0])
    assert 0.8 < ratio < 1.2


def test_a_shorter_run_sees_the_first_tokens_of_a_longer_one():
    n_short = 2 * drift.PIECE
    short = drift.state_drift(n_short, 1.0, points=5)
    long = drift.state_drift(4 * drift.PIECE, 1.0, points=200)
    same = {p: e for p, e in zip(long["positions"], long["state_error"]) if p <= n_short}
    shared = [p for p in short["positions"] if p in same]
    assert shared and all(short["state_error"][short["positions"].index(p)] == same[p] for p in shared)


@pytest.mark.parametrize("kw, match", [
    (dict(inputs="float16"), "inputs"), (dict(state="double"), "state"), (dict(update="chunk"), "update"),
    (dict(distribution="uniform"), "distribution"), (dict(decay=0.0), "decay"), (dict(decay=1.5), "decay"),
    (dict(block=48), "block"), (dict(n_tokens=64), "n_tokens"),
])
def test_bad_arguments_are_refused_by_name(kw, match):
    args = dict(n_tokens=4096, decay=1.0)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        drift.state_drift(args.pop("n_tokens"), args.pop("decay"), **args)
