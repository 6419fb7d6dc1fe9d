"""The sequence-parallel launcher (benchmarks/sequence_parallel.py) under torchrun: two CPU processes over gloo give
what one process gives for the whole sequence, and a command line it does not run is refused in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from benchmarks import sequence_parallel
from lightning_edu import lightning_attention
from lightning_edu.book import repo_root
from lightning_edu.models.decay import head_decays

TOKENS, HEADS, DIM = 301, 2, 16  # 301 = 151 + 150: slices of unequal length, neither a multiple of a block


def test_two_processes_under_torchrun_give_the_single_call_over_the_whole_sequence(tmp_path):
    out, saved = tmp_path / "record.json", tmp_path / "tensors.pt"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "benchmarks.sequence_parallel", str(out), "--tokens", str(TOKENS), "--heads", str(HEADS),
               "--dim", str(DIM), "--dtype", "float32", "--backend", "torch", "--repeats", "1", "--save", str(saved)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(repo_root()))
    done = subprocess.run(command, cwd=repo_root(), env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["world_size"] == 2 and record["process_group"] == "gloo"
    assert [r["slice"] for r in record["ranks"]] == [[0, 151], [151, 301]]
    for r in record["ranks"]:
        assert r["forward_ms"] > 0 and r["forward_backward_ms"] > 0 and r["peak_bytes_beyond_inputs"] is None
        # one float32 state (heads x d x d) to the one other rank; softmax sends its 151-token slice of K and V
        assert r["bytes_sent_per_layer_forward"] == {"ours": HEADS * DIM * DIM * 4,
                                                     "softmax_allgather_kv": HEADS * 151 * 2 * DIM * 4}

    # one process: the whole sequence in one call, in float64
    q, k, v, do = (x.double().requires_grad_(i < 3) for i, x in enumerate(
        sequence_parallel.slice_inputs(0, TOKENS, HEADS, DIM, 0, torch.float32, torch.device("cpu"))))
    o = lightning_attention(q, k, v, torch.tensor(head_decays(HEADS)), backend="torch")
    o.backward(do)
    got = torch.load(saved)
    for name, want in (("o", o), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert got[name].shape == want.shape, name
        error = (got[name].double() - want).abs().max() / want.abs().max()
        assert error < 1e-5, (name, float(error))


def test_the_inputs_are_the_same_tokens_whatever_the_slicing():
    whole = sequence_parallel.slice_inputs(0, 9000, 1, 16, 3, torch.float32, torch.device("cpu"))
    for start, end in ((0, 1), (4095, 4097), (8191, 9000)):
        part = sequence_parallel.slice_inputs(start, end, 1, 16, 3, torch.float32, torch.device("cpu"))
        for a, b in zip(part, whole):
            assert torch.equal(a, b[:, :, start:end])


def test_slices_cover_the_sequence_in_rank_order():
    for tokens, world in ((301, 2), (7, 7), (10, 3), (2**21, 8)):
        bounds = [sequence_parallel.slice_bounds(tokens, world, r) for r in range(world)]
        assert bounds[0][0] == 0 and bounds[-1][1] == tokens
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        assert max(e - s for s, e in bounds) - min(e - s for s, e in bounds) <= 1


@pytest.mark.parametrize("argv, words", [
    (["--tokens", "4"], "no output path"),
    (["out.json", "--tokens", "0"], "--tokens must be at least 1, got 0"),
    (["out.json", "--tokens", "many"], "--tokens must be an integer, got 'many'"),
    (["out.json", "--exchange", "tree"], "--exchange must be one of allgather, ring, got 'tree'"),
    (["out.json", "--dtype"], "--dtype needs a value"),
    (["out.json", "--world", "2"], "unknown option --world"),
    (["out.json", "again.json"], "unexpected argument 'again.json'"),
])
def test_a_command_line_it_does_not_run_is_one_line_and_exit_2_and_leaves_nothing(argv, words, tmp_path, capsys,
                                                                                  monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert sequence_parallel.main(argv) == 2
    printed = capsys.readouterr().out
    assert printed.count("\n") == 1 and words in printed
    assert list(tmp_path.iterdir()) == []


def test_triton_on_a_cpu_only_machine_is_refused_before_any_process_group(tmp_path, capsys, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs the triton backend")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert sequence_parallel.main([str(tmp_path / "out.json")]) == 2
    assert "--backend triton needs CUDA" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []
