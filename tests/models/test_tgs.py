"""lightning_edu.models.tgs: the paper's Table 1 as transcribed, the models it times, the line fit, and the recorded runs."""

import importlib.util
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_edu.models import SIZES, Decoder, decay_schedule
from benchmarks import tgs
from lightning_edu.models.tgs import fit_tgs
from lightning_edu.models.tgs import MODELS, PAPER_TABLE1, build

DATA = Path(__file__).resolve().parents[2] / "notebooks" / "data"
HAS_FLA = importlib.util.find_spec("fla") is not None


@pytest.fixture(autouse=True)
def _one_thread(torch_threads):
    # The models here are tiny: one thread is as fast, and a hundred times faster than two when another process
    # keeps the CPU's cores busy (OpenMP threads then wait on each other).
    with torch_threads(1):
        yield


def _n_params(vocab, d, layers, extra):
    """The Decoder docstring's count: vocab d + layers (4 d^2 + 3 d h + 2 d + extra) + d, h = 8 ceil(d / 3)."""
    h = 8 * math.ceil(8 * d / 3 / 8)
    return vocab * d + layers * (4 * d * d + 3 * d * h + 2 * d + extra) + d


# ---------------------------------------------------------------- the paper's Table 1

def _rows():
    for size, models in PAPER_TABLE1["tgs"].items():
        for model, row in models.items():
            yield size, model, row


def test_table1_shape():
    contexts = PAPER_TABLE1["contexts"]
    assert contexts == (1024, 2048, 4096, 8192, 16384, 32768, 65536, 81920, 94208)
    assert list(PAPER_TABLE1["tgs"]) == ["0.4B", "1B", "3B"]
    for size, models in PAPER_TABLE1["tgs"].items():
        assert list(models) == ["LLaMA-FA2", "TNL-LA1", "TNL-LA2"], size
    for size, model, row in _rows():
        assert len(row) == len(contexts), (size, model)
        measured = [x for x in row if x is not None]
        assert all(isinstance(x, int) and 1000 < x < 100_000 for x in measured), (size, model)
        # out of memory happens at the longest contexts only: the Nones form a suffix
        n = len(measured)
        assert row[:n] == tuple(measured) and all(x is None for x in row[n:]), (size, model)
    json.loads(json.dumps(PAPER_TABLE1))  # main records it as JSON


def test_table1_oom_pattern():
    # the same contexts run out of memory for every model of one size; larger models, from shorter contexts
    n_measured = {}
    for size, models in PAPER_TABLE1["tgs"].items():
        counts = {sum(x is not None for x in row) for row in models.values()}
        assert len(counts) == 1, size
        n_measured[size] = counts.pop()
    assert n_measured == {"0.4B": 9, "1B": 8, "3B": 6}


def test_table1_paper_claims():
    tgs_ = PAPER_TABLE1["tgs"]
    # TNL-LA2's speed does not depend on the context: within 4 % of its mean at every length, every size
    for size in tgs_:
        la2 = [x for x in tgs_[size]["TNL-LA2"] if x is not None]
        mean = sum(la2) / len(la2)
        assert all(abs(x - mean) <= 0.04 * mean for x in la2), size
    # LLaMA-FA2 0.4B falls more than 8x from 1K to 94208 tokens
    fa2 = tgs_["0.4B"]["LLaMA-FA2"]
    assert fa2[0] / fa2[-1] > 8
    for size in tgs_:
        for model in ("LLaMA-FA2", "TNL-LA1"):  # the quadratic ones slow down with every doubling
            row = [x for x in tgs_[size][model] if x is not None]
            assert all(a > b for a, b in zip(row, row[1:])), (size, model)
        # LA1 beats FA2 everywhere; LA2 beats both at the longest context each size reaches
        for fa, la1 in zip(tgs_[size]["LLaMA-FA2"], tgs_[size]["TNL-LA1"]):
            assert fa is None or la1 > fa, size
        last = max(i for i, x in enumerate(tgs_[size]["TNL-LA2"]) if x is not None)
        assert tgs_[size]["TNL-LA2"][last] > tgs_[size]["TNL-LA1"][last]
    # bigger models are slower, at every context and for every model
    for model in ("LLaMA-FA2", "TNL-LA1", "TNL-LA2"):
        for small, mid, big in zip(tgs_["0.4B"][model], tgs_["1B"][model], tgs_["3B"][model]):
            assert big is None or small > mid > big
            assert mid is None or small > mid


# ---------------------------------------------------------------- fit_tgs

def test_fit_tgs_recovers_a_line():
    a, b = 2.5e-5, 3.0e-10
    T = np.array(PAPER_TABLE1["contexts"], dtype=float)
    fa, fb = fit_tgs(T, 1 / (a + b * T))
    assert fa == pytest.approx(a, rel=1e-9) and fb == pytest.approx(b, rel=1e-6)
    assert isinstance(fa, float) and isinstance(fb, float)
    # a flat TGS: b = 0
    fa, fb = fit_tgs([1024, 4096, 65536], [40_000, 40_000, 40_000])
    assert fa == pytest.approx(1 / 40_000, rel=1e-12) and abs(fb) < 1e-12 * fa


def test_fit_tgs_skips_oom_points():
    a, b = 1e-4, 2e-9
    T = [1024, 2048, 4096, 8192]
    tgs_ = [1 / (a + b * t) for t in T[:3]] + [None]
    fa, fb = fit_tgs(T, tgs_)
    assert fa == pytest.approx(a, rel=1e-9) and fb == pytest.approx(b, rel=1e-6)


def test_fit_tgs_on_the_paper():
    contexts = PAPER_TABLE1["contexts"]
    for size, models in PAPER_TABLE1["tgs"].items():
        fa2 = fit_tgs(contexts, models["LLaMA-FA2"])
        la2 = fit_tgs(contexts, models["TNL-LA2"])
        assert fa2[0] > 0 and la2[0] > 0
        # at 64K tokens the context adds more than the fixed cost for FA2, under 1 % of it for LA2
        assert fa2[1] * 65536 > fa2[0], size
        assert abs(la2[1]) * 65536 < 0.01 * la2[0], size


def test_fit_tgs_errors():
    with pytest.raises(ValueError, match="at least two"):
        fit_tgs([1024, 2048], [30_000, None])
    with pytest.raises(ValueError, match="at least two"):
        fit_tgs([], [])
    with pytest.raises(ValueError, match="> 0"):
        fit_tgs([1024, 2048, 4096], [30_000, -5, 20_000])
    with pytest.raises(ValueError, match="same length"):
        fit_tgs([1024, 2048, 4096], [30_000, 20_000])  # never silently truncated


# ---------------------------------------------------------------- build

def test_models():
    assert set(MODELS) == {"tnl", "tnl_fla", "llama", "tnl_la1"} and len(MODELS) == 4


@pytest.mark.parametrize("name,kind,activation", [("llama", "softmax", True), ("tnl", "lightning", False),
                                                  ("tnl_la1", "la1", False)])
def test_build(name, kind, activation):
    model = build(name, "tiny", 50, 32)
    tiny = SIZES["tiny"]
    assert isinstance(model, Decoder)
    assert model.checkpoint is True and model.max_len == 32 and model.vocab == 50
    assert model.embed.weight.shape == (50, tiny["d_model"]) and len(model.blocks) == tiny["layers"]
    for layer, block in enumerate(model.blocks):
        assert block.attn.kind == kind and block.attn.heads == tiny["heads"]
        assert block.mlp.activation is activation
        if kind == "softmax":
            assert block.attn.norm is None
        else:  # TransNormerLLM: its decay schedule, an output norm, this book's Triton kernels
            assert block.attn.backend == "triton" and block.attn.norm is not None
            np.testing.assert_allclose(block.attn.decay.numpy(),
                                       decay_schedule("fla_lightning", tiny["heads"], layer, tiny["layers"]),
                                       rtol=1e-6)
    extra = 0 if kind == "softmax" else tiny["d_model"]
    assert model.n_params() == _n_params(50, tiny["d_model"], tiny["layers"], extra)


def test_build_llama_trains_with_checkpointing():
    torch.manual_seed(0)
    model = build("llama", "tiny", 50, 32)
    reference = Decoder(50, **SIZES["tiny"], attention="softmax", mlp="swiglu", max_len=32)
    reference.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 50, (2, 16))
    grads = []
    for m in (model, reference):
        loss = torch.nn.functional.cross_entropy(m(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    for g, r in zip(*grads):  # checkpointing recomputes, it does not change the gradient
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["tnl", "tnl_la1"])
def test_build_tnl_matches_torch_reference(name):
    """The Triton kernels (interpreted on a CPU) under checkpointing give the torch model's logits and gradients."""
    torch.manual_seed(0)
    model = build(name, "tiny", 50, 32)
    reference = Decoder(50, **SIZES["tiny"], attention="lightning", mlp="glu", decay="fla_lightning", max_len=32,
                        backend="torch")
    reference.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 50, (1, 17))
    outs, grads = [], []
    for m in (model, reference):
        logits = m(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        outs.append(logits.detach())
        grads.append([p.grad.clone() for p in m.parameters()])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-5)
    for g, r in zip(*grads):
        torch.testing.assert_close(g, r, rtol=1e-3, atol=1e-5)


def test_build_errors():
    with pytest.raises(ValueError, match="size"):
        build("llama", "7B", 50, 32)
    with pytest.raises(ValueError, match="size"):
        build("tnl", "1B", 50, 32)  # in the paper's table, not among SIZES
    with pytest.raises(ValueError, match="model must be one of"):
        build("gpt", "tiny", 50, 32)


@pytest.mark.skipif(HAS_FLA, reason="flash-linear-attention is installed")
def test_build_fla_without_fla():
    with pytest.raises(ValueError, match="flash-linear-attention"):
        build("tnl_fla", "tiny", 50, 32)


# ---------------------------------------------------------------- main

@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: main would run")
def test_main_refuses_without_cuda(tmp_path):
    out = tmp_path / "tgs.json"
    with pytest.raises(SystemExit, match="CUDA"):
        tgs.main(["--sizes", "tiny", "--models", "llama", "--contexts", "64", "--out", str(out)])
    assert not out.exists()


def test_main_argument_errors(tmp_path):
    with pytest.raises(SystemExit) as exc:
        tgs.main(["--models", "gpt", "--out", str(tmp_path / "t.json")])
    assert exc.value.code == 2  # argparse, before any CUDA question
    with pytest.raises(SystemExit) as exc:
        tgs.main(["--contexts", "1K", "--out", str(tmp_path / "t.json")])
    assert exc.value.code == 2


# ---------------------------------------------------------------- the recorded runs

SIZES_OF_FILE = {"tgs_h100_04b.json": ("0.4B",), "tgs_h100_01b.json": ("0.1B",), "tgs_h200.json": ("0.4B", "0.1B")}


@pytest.fixture(params=[(name, size) for name, sizes in sorted(SIZES_OF_FILE.items()) for size in sizes],
                ids=lambda p: f"{p[0]}-{p[1]}")
def recorded(request):
    name, size = request.param
    path = DATA / name
    if not path.exists():
        pytest.skip(f"{name} not recorded")
    return size, json.loads(path.read_text())


def _asked(command: str, flag: str, default):
    # the values the record's command gave a flag (nargs="+"), or the driver's default
    words = command.split()
    if flag not in words:
        return list(default)
    after = words[words.index(flag) + 1:]
    return after[:next((i for i, w in enumerate(after) if w.startswith("--")), len(after))]


def test_recorded_paper_table_is_the_codes(recorded):
    _, record = recorded
    assert record["paper"] == json.loads(json.dumps(PAPER_TABLE1))  # the table recorded is the table in the code


def test_recorded_models_are_the_codes(recorded):
    # each model's count, from the Decoder docstring's formula at the size's d_model and layers in the code today:
    # a size whose shape changed since the record was made fails here (the formula itself: test_build)
    size, record = recorded
    d, layers = SIZES[size]["d_model"], SIZES[size]["layers"]
    points = [r for r in record["results"] if r["size"] == size]
    assert points, f"no {size} point"
    for r in points:
        assert r["model"] in MODELS, r
        extra = 0 if r["model"] == "llama" else d  # TransNormerLLM's output norm
        assert r["params"] == _n_params(record["vocab"], d, layers, extra), r


def test_recorded_covers_every_point(recorded):
    # every (model, context) the record's command asked for at this size is measured or skipped with a reason, once
    size, record = recorded
    assert size in _asked(record["command"], "--sizes", ("0.4B", "0.1B"))
    models = _asked(record["command"], "--models", MODELS)
    contexts = [int(T) for T in _asked(record["command"], "--contexts", PAPER_TABLE1["contexts"])]
    assert set(contexts) <= set(PAPER_TABLE1["contexts"])  # the chapter compares them with the paper's columns
    measured = [(r["model"], r["context"]) for r in record["results"] if r["size"] == size]
    assert len(measured) == len(set(measured))
    left = set()
    for s in record["skipped"]:
        if not s.startswith(f"{size} "):
            continue
        m = re.fullmatch(rf"{re.escape(size)} (\w+) (\d+): over the time budget", s)
        if m:
            left.add((m.group(1), int(m.group(2))))
        else:  # a model that could not be built (fla missing): all its contexts
            m = re.fullmatch(rf"{re.escape(size)} (\w+): .+", s)
            assert m, s
            left.update((m.group(1), T) for T in contexts)
    assert not left & set(measured)
    assert set(measured) | left == {(m, T) for m in models for T in contexts}
