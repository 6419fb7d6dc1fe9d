"""The byte-level language model task (lightning_edu.models.lm) and the quality runner (lightning_edu.models.quality)."""

import copy
import importlib
import json
import math
import re
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from lightning_edu.models.lm import VOCAB, corpus_bytes, evaluate_lm, lm_batches, perplexity, split_corpus
from benchmarks import quality as quality_cli
from lightning_edu.models import quality
from lightning_edu.models.quality import KINDS, PRESETS, lm_run, mqar_run

DATA = Path(__file__).resolve().parents[2] / "notebooks" / "data"


@pytest.fixture(autouse=True)
def _one_thread(torch_threads):
    # The models here are tiny: one thread is as fast, and a hundred times faster than two when another process
    # keeps the CPU's cores busy (OpenMP threads then wait on each other).
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def corpus():
    return corpus_bytes()


def _tiny():
    """PRESETS["cpu"] shrunk to a few milliseconds per step."""
    cfg = copy.deepcopy(PRESETS["cpu"])
    cfg["lm"].update(d_model=16, heads=2, layers=1, seq_len=16, batch=4, steps=7, eval_every=3, eval_windows=4,
                     log_every=2, seeds=(0,))
    cfg["mqar"].update(d_model=16, heads=2, layers=1, seq_len=16, vocab=16, batch=4, steps=6, warmup=3,
                       log_every=4, pairs=(2, 3), eval_batch=8)
    return cfg


def _n_params(vocab, d, layers, extra):
    """The Decoder docstring's count: vocab d + layers (4 d^2 + 3 d h + 2 d + extra) + d, h = 8 ceil(d / 3)."""
    h = 8 * math.ceil(8 * d / 3 / 8)
    return vocab * d + layers * (4 * d * d + 3 * d * h + 2 * d + extra) + d


# ---------------------------------------------------------------- the corpus

def test_corpus_bytes(corpus):
    assert isinstance(corpus, np.ndarray) and corpus.dtype == np.uint8 and corpus.ndim == 1
    assert 300_000 < len(corpus) < 5_000_000
    text = corpus.tobytes().decode("utf-8")  # raises if not valid UTF-8
    assert 'The "with" statement is used to wrap the execution of a block' in text
    assert "context manager" in text
    np.testing.assert_array_equal(corpus_bytes(), corpus)  # deterministic
    assert corpus.flags.writeable  # a copy, not a view of an immutable bytes object


def test_corpus_is_the_sorted_topics_joined_by_blank_lines(corpus):
    from pydoc_data.topics import topics

    text = corpus.tobytes().decode("utf-8")
    names = sorted(topics)
    first, last = topics[names[0]].strip(), topics[names[-1]].strip()
    assert text.startswith(first) and text.endswith(last)
    # every topic, stripped, in name order, separated by exactly one blank line
    pos = 0
    for i, name in enumerate(names):
        body = topics[name].strip()
        assert text.startswith(body, pos), name
        pos += len(body)
        if i < len(names) - 1:
            assert text.startswith("\n\n", pos) and text[pos + 2] not in "\n ", name
            pos += 2
    assert pos == len(text)


def test_split_corpus_default(corpus):
    train, valid = split_corpus()
    assert train.dtype == valid.dtype == np.uint8
    assert len(train) + len(valid) == len(corpus)
    assert len(train) == round(0.9 * len(corpus))
    np.testing.assert_array_equal(train, corpus[:len(train)])
    np.testing.assert_array_equal(valid, corpus[len(train):])


def test_split_corpus_given_data():
    data = np.arange(200, dtype=np.uint8)
    train, valid = split_corpus(data, valid_fraction=0.25)
    np.testing.assert_array_equal(train, np.arange(150))
    np.testing.assert_array_equal(valid, np.arange(150, 200))
    train, valid = split_corpus(list(range(10)))  # array-likes are converted to uint8
    assert train.dtype == np.uint8 and train.tolist() == list(range(9)) and valid.tolist() == [9]


@pytest.mark.parametrize("bad", [0, 1, -0.1, 1.5, float("nan")])
def test_split_corpus_bad_fraction(bad):
    with pytest.raises(ValueError, match="valid_fraction"):
        split_corpus(np.arange(100, dtype=np.uint8), valid_fraction=bad)


# ---------------------------------------------------------------- training batches

def test_lm_batches_windows_are_slices_of_the_data():
    data = np.arange(200, dtype=np.uint8)  # every byte distinct: a window's first byte is its offset
    batches = lm_batches(data, batch=5, seq_len=12, seed=3)
    for _ in range(20):
        x, y = next(batches)
        assert x.shape == y.shape == (5, 12) and x.dtype == y.dtype == torch.int64
        for row_x, row_y in zip(x.numpy(), y.numpy()):
            s = int(row_x[0])
            np.testing.assert_array_equal(row_x, data[s:s + 12])
            np.testing.assert_array_equal(row_y, data[s + 1:s + 13])


def _window_starts(data, seq_len=10, draws=20):
    """The first byte of every window lm_batches drew (data is np.arange, so a window's first byte is its start)."""
    starts = set()
    batches = lm_batches(data, batch=64, seq_len=seq_len, seed=0)
    for _ in range(draws):
        starts.update(next(batches)[0][:, 0].tolist())
    return starts


def test_lm_batches_offsets_spread_over_the_data():
    starts = _window_starts(np.arange(60, dtype=np.uint8))
    assert min(starts) == 0 and max(starts) >= 47  # not stuck at the beginning
    assert all(0 <= s <= 60 - 11 for s in starts)  # every window fits


def test_lm_batches_reaches_the_last_window():
    starts = _window_starts(np.arange(60, dtype=np.uint8))
    assert max(starts) == 60 - 11  # the window data[49:60] holds the last byte as its last target


def test_lm_batches_accepts_exactly_one_window():
    x, y = next(lm_batches(np.arange(17, dtype=np.uint8), batch=2, seq_len=16))
    np.testing.assert_array_equal(x[0].numpy(), np.arange(16))


def test_lm_batches_seeded():
    data = np.random.default_rng(1).integers(0, 256, 5000).astype(np.uint8)
    a, b, c = (lm_batches(data, 4, 32, seed=s) for s in (7, 7, 8))
    for _ in range(3):
        (xa, ya), (xb, yb), (xc, _) = next(a), next(b), next(c)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert not torch.equal(xa, xc)
    # successive batches of one stream differ
    assert not torch.equal(next(a)[0], next(a)[0])


def test_lm_batches_errors():
    data = np.arange(100, dtype=np.uint8)
    with pytest.raises(ValueError, match="seq_len"):
        next(lm_batches(np.arange(16, dtype=np.uint8), 2, 16))
    with pytest.raises(ValueError, match="seq_len"):
        next(lm_batches(data, 2, 0))
    with pytest.raises(TypeError, match="batch"):
        next(lm_batches(data, 2.0, 8))
    with pytest.raises(TypeError, match="seq_len"):
        next(lm_batches(data, 2, "8"))
    with pytest.raises(ValueError, match="batch"):
        next(lm_batches(data, 0, 8))
    with pytest.raises(ValueError, match="seed"):
        next(lm_batches(data, 2, 8, seed=-1))


# ---------------------------------------------------------------- evaluation

class _Zeros(nn.Module):
    """Uniform predictions: every byte has probability 1/256."""

    def __init__(self):
        super().__init__()
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return torch.zeros(*x.shape, VOCAB)


class _Bigram(nn.Module):
    """Logits that depend on the previous byte only: table[x] (a (256, 256) matrix). Records the batch sizes seen."""

    def __init__(self, table):
        super().__init__()
        self.table = nn.Parameter(torch.as_tensor(table, dtype=torch.float32))
        self.calls = []

    def forward(self, x):
        self.calls.append(tuple(x.shape))
        return self.table[x]


def _bigram_loss(table, data, n_targets):
    """Mean -log softmax(table[data[t-1]])[data[t]] over t = 1 .. n_targets, in float64 numpy."""
    table = np.asarray(table, dtype=np.float64)
    logz = np.log(np.exp(table - table.max(1, keepdims=True)).sum(1)) + table.max(1)
    prev, nxt = data[:n_targets].astype(np.int64), data[1:n_targets + 1].astype(np.int64)
    return float(np.mean(logz[prev] - table[prev, nxt]))


def test_evaluate_uniform_model_is_ln256():
    data = np.random.default_rng(0).integers(0, 256, 1000).astype(np.uint8)
    model = _Zeros()
    loss = evaluate_lm(model, data, seq_len=16, batch=5)
    assert loss == pytest.approx(math.log(256), rel=1e-6)
    assert perplexity(loss) == pytest.approx(256, rel=1e-5)
    assert model.training  # left in train mode


def test_evaluate_perfect_model_is_near_zero():
    data = np.tile(np.arange(10, dtype=np.uint8), 100)
    table = np.zeros((256, 256))
    table[np.arange(10), (np.arange(10) + 1) % 10] = 50.0
    loss = evaluate_lm(_Bigram(table), data, seq_len=8)
    assert 0 <= loss < 1e-6
    # and the same model on bytes it predicts wrongly (each followed by itself) pays ~50 nats a byte
    assert evaluate_lm(_Bigram(table), np.full(100, 3, dtype=np.uint8), seq_len=8) == pytest.approx(50.0, rel=1e-6)


@pytest.mark.parametrize("seq_len,batch,max_windows", [(7, 3, None), (7, 16, None), (10, 4, 5), (10, 4, 10_000), (2, 1, 3)])
def test_evaluate_counts_each_byte_once(seq_len, batch, max_windows):
    rng = np.random.default_rng(seq_len * 100 + batch)
    data = rng.integers(0, 256, 203).astype(np.uint8)
    table = rng.normal(0, 2, (256, 256))
    model = _Bigram(table)
    loss = evaluate_lm(model, data, seq_len=seq_len, batch=batch, max_windows=max_windows)
    n_windows = (len(data) - 1) // seq_len if max_windows is None else min((len(data) - 1) // seq_len, max_windows)
    assert loss == pytest.approx(_bigram_loss(table, data, n_windows * seq_len), rel=1e-5)
    # windows of seq_len inputs, at most `batch` at a time, n_windows in all
    assert all(shape[1] == seq_len and shape[0] <= batch for shape in model.calls)
    assert sum(shape[0] for shape in model.calls) == n_windows
    assert model.training


def test_evaluate_max_windows_caps_to_the_first_windows():
    data = np.concatenate([np.zeros(41, dtype=np.uint8), np.arange(100, 200, dtype=np.uint8)])
    table = np.zeros((256, 256))
    table[0, 0] = 30.0  # certain that 0 follows 0
    # the first 4 windows of 10 (targets data[1:41]) are all zeros -> loss ~0; more windows reach the rest
    assert evaluate_lm(_Bigram(table), data, seq_len=10, max_windows=4) < 1e-6
    assert evaluate_lm(_Bigram(table), data, seq_len=10, max_windows=5) > 1.0


def test_evaluate_no_grad():
    model = _Bigram(np.zeros((256, 256)))
    seen = []
    model.register_forward_hook(lambda m, i, o: seen.append(o.requires_grad))
    evaluate_lm(model, np.arange(50, dtype=np.uint8), seq_len=8)
    assert seen and not any(seen)
    assert model.table.grad is None


def test_evaluate_leaves_the_mode_as_it_was():
    model = _Zeros()
    for training in (True, False):
        model.train(training)
        evaluate_lm(model, np.arange(50, dtype=np.uint8), seq_len=8)
        assert model.training is training


def test_evaluate_errors():
    model = _Zeros()
    with pytest.raises(ValueError, match="too few"):
        evaluate_lm(model, np.arange(16, dtype=np.uint8), seq_len=16)  # needs seq_len + 1 bytes
    assert evaluate_lm(model, np.arange(17, dtype=np.uint8), seq_len=16) == pytest.approx(math.log(256), rel=1e-6)
    with pytest.raises(ValueError, match="seq_len"):
        evaluate_lm(model, np.arange(100, dtype=np.uint8), seq_len=1)
    with pytest.raises(ValueError, match="max_windows"):
        evaluate_lm(model, np.arange(100, dtype=np.uint8), seq_len=8, max_windows=0)
    with pytest.raises(TypeError, match="batch"):
        evaluate_lm(model, np.arange(100, dtype=np.uint8), seq_len=8, batch=2.5)


def test_perplexity():
    for loss in (0.0, 0.5, 1.3, math.log(256)):
        assert perplexity(loss) == pytest.approx(math.exp(loss), rel=1e-15)
    assert perplexity(0.0) == 1.0
    assert perplexity(math.log(2) * 1.5) == pytest.approx(2 ** 1.5)  # 1.5 bits per byte


# ---------------------------------------------------------------- quality: presets and runs

def test_kinds_and_presets():
    assert KINDS == ("softmax", "lightning", "elu", "relu2", "hybrid")
    assert set(PRESETS) == {"cpu", "gpu"}
    for preset in PRESETS.values():
        lm, mqar = preset["lm"], preset["mqar"]
        for key in ("d_model", "heads", "layers", "seq_len", "batch", "steps", "lr", "eval_every", "eval_windows",
                    "log_every", "seeds"):
            assert key in lm
        for key in ("d_model", "heads", "layers", "seq_len", "vocab", "batch", "steps", "lr", "warmup", "log_every",
                    "pairs", "eval_batch"):
            assert key in mqar
        assert 1 <= mqar["warmup"] < mqar["steps"] and mqar["steps"] % mqar["log_every"] == 0
        assert list(mqar["pairs"]) == sorted(set(mqar["pairs"]))  # increasing: --budget skips the hardest last
        for cfg in (lm, mqar):
            assert cfg["d_model"] % cfg["heads"] == 0 and (cfg["d_model"] // cfg["heads"]) % 2 == 0  # RoPE
        assert mqar["vocab"] >= 2 * max(mqar["pairs"]) + 1 and mqar["seq_len"] >= 3 * max(mqar["pairs"])
        assert lm["steps"] % lm["log_every"] == 0
        json.dumps(preset)  # recorded as JSON


LM_KEYS = {"kind", "seed", "params", "state_per_head", "train_curve", "valid_curve", "best_valid_loss", "best_step",
           "seconds"}


@pytest.fixture(scope="module")
def lm_records(torch_threads):
    # one thread, as every test here runs (the function-scoped _one_thread starts after this module fixture): the
    # determinism test compares a rerun with these records bit for bit
    cfg = _tiny()["lm"]
    with torch_threads(1):
        return {kind: lm_run(kind, cfg, seed=0) for kind in ("softmax", "lightning")}


@pytest.mark.parametrize("kind", ["softmax", "lightning"])
def test_lm_run_record(lm_records, kind):
    r = lm_records[kind]
    assert set(r) == LM_KEYS
    assert r["kind"] == kind and r["seed"] == 0
    assert [s for s, _ in r["train_curve"]] == [2, 4, 6]  # every log_every; step 7 has no full interval
    assert [s for s, _ in r["valid_curve"]] == [3, 6, 7]  # every eval_every, and the last step
    losses = [v for _, v in r["train_curve"] + r["valid_curve"]]
    assert all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in losses)
    assert r["best_valid_loss"] == min(v for _, v in r["valid_curve"])
    assert [r["best_step"], r["best_valid_loss"]] in r["valid_curve"]
    # a fresh model (weights ~ N(0, 0.02)) predicts nearly uniformly: ln 256 nats per byte, not bits
    assert abs(r["train_curve"][0][1] - math.log(256)) < 0.3
    assert r["valid_curve"][-1][1] < math.log(256) + 0.3
    assert r["seconds"] > 0
    extra = 16 if kind == "lightning" else 0  # the lightning kinds' output RMSNorm
    assert r["params"] == _n_params(VOCAB, 16, 1, extra)
    json.dumps(r)


def test_lm_run_is_deterministic_and_takes_data(lm_records):
    cfg = _tiny()["lm"]
    again = lm_run("softmax", cfg, seed=0, data=split_corpus())
    for key in ("train_curve", "valid_curve", "best_valid_loss", "best_step", "params"):
        assert again[key] == lm_records["softmax"][key]
    # other data, other losses
    rng = np.random.default_rng(0)
    other = lm_run("softmax", cfg, seed=0, data=(rng.integers(0, 256, 3000).astype(np.uint8),
                                                 rng.integers(0, 256, 500).astype(np.uint8)))
    assert other["valid_curve"] != lm_records["softmax"]["valid_curve"]
    assert other["best_valid_loss"] > 5.0  # random bytes cannot be predicted: near ln 256


def test_lm_run_best_is_the_lowest_not_the_last(monkeypatch):
    cfg = _tiny()["lm"]
    losses = iter([3.0, 1.0, 2.0])  # the validation loss rises after step 6 (memorising)
    calls = []

    def fake_evaluate(model, data, seq_len, max_windows=None, autocast_dtype=None):
        calls.append((len(data), seq_len, max_windows))
        return next(losses)

    monkeypatch.setattr(quality, "evaluate_lm", fake_evaluate)
    valid = np.arange(100, dtype=np.uint8)
    r = lm_run("softmax", cfg, data=((np.arange(1000) % 256).astype(np.uint8), valid))
    assert r["valid_curve"] == [[3, 3.0], [6, 1.0], [7, 2.0]]
    assert r["best_valid_loss"] == 1.0 and r["best_step"] == 6
    assert calls == [(100, 16, 4)] * 3  # the validation bytes, windows of seq_len, eval_windows of them


def test_same_initial_weights_where_shapes_agree():
    cfg = _tiny()["lm"]
    a, b = (quality._model(kind, VOCAB, cfg, 16, 0, "cpu") for kind in ("softmax", "lightning"))
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    shared = [n for n in pa if n in pb and pa[n].shape == pb[n].shape]
    assert "embed.weight" in shared and "blocks.0.attn.qkv.weight" in shared
    for name in shared:
        assert torch.equal(pa[name], pb[name]), name
    assert b.blocks[0].attn.kind == "lightning"
    assert b.blocks[0].attn.decay[0] == 1.0 and b.blocks[0].attn.decay[1] < 1.0  # fla_lightning: head 0 never decays


MQAR_KEYS = {"kind", "pairs", "seed", "accuracy", "final_loss", "state_per_head", "loss_curve", "seconds"}


@pytest.mark.parametrize("kind", ["softmax", "lightning"])
def test_mqar_run_record(kind):
    cfg = _tiny()["mqar"]
    r = mqar_run(kind, cfg, pairs=3, seed=1)
    assert set(r) == MQAR_KEYS
    assert r["kind"] == kind and r["pairs"] == 3 and r["seed"] == 1
    assert 0.0 <= r["accuracy"] <= 1.0
    n_queries = cfg["eval_batch"] * 3  # one query per key
    assert r["accuracy"] * n_queries == pytest.approx(round(r["accuracy"] * n_queries), abs=1e-4)
    assert math.isfinite(r["final_loss"]) and r["final_loss"] > 0
    assert [s for s, _ in r["loss_curve"]] == [4, 6]  # every log_every steps, and the last step
    assert r["final_loss"] == r["loss_curve"][-1][1]
    assert abs(r["loss_curve"][0][1] - math.log(16)) < 0.5  # a fresh model guesses among the 16 tokens
    assert r["seconds"] > 0
    again = mqar_run(kind, cfg, pairs=3, seed=1)
    assert again["accuracy"] == r["accuracy"] and again["loss_curve"] == r["loss_curve"]  # deterministic
    json.dumps(r)


def test_mqar_run_warms_the_learning_rate_up(monkeypatch):
    cfg = _tiny()["mqar"]  # lr reached after warmup=3 steps, 6 steps in all
    rates = []

    def spy(model, opt, inputs, targets, autocast_dtype=None, grad_clip=None):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()  # no gradients: changes nothing, but keeps the scheduler's order check quiet
        return torch.tensor(1.0)

    # mqar_run trains with the book's loop, which calls train_step (the module: models.train is also a function)
    monkeypatch.setattr(importlib.import_module("lightning_edu.models.train"), "train_step", spy)
    r = mqar_run("softmax", cfg, pairs=2)
    assert rates == pytest.approx([cfg["lr"] * f for f in (1 / 3, 2 / 3, 1, 1, 1, 1)])
    assert r["loss_curve"] == [[4, 1.0], [6, 1.0]]  # the mean of the losses train_step returned


def test_softmax_learns_recall_with_the_cpu_preset():
    # The recipe of PRESETS["cpu"] as it stands, its fewest pairs: a 2-layer softmax model must recall, not just
    # guess. The levels of guessing, from the task's definition alone (not from the code under test): a blind
    # guess among the value tokens (the upper half of the vocabulary, vocab // 2 of them), a guess among the
    # sequence's own p values (1/p), or among those not yet asked for (H_p / p). About 8 s on one core; every
    # seed of 0 to 3 reached 0.99 or more at 4 and 8 pairs when this was written.
    cfg = PRESETS["cpu"]["mqar"]
    pairs = min(cfg["pairs"])
    guesses = {"blind": 1 / (cfg["vocab"] // 2), "one of the sequence's values": 1 / pairs,
               "one of the values not yet asked for": sum(1 / i for i in range(1, pairs + 1)) / pairs}
    assert max(guesses.values()) < 0.6
    r = mqar_run("softmax", cfg, pairs=pairs, seed=0)
    assert r["accuracy"] > 0.9, (r, guesses)
    assert r["final_loss"] < 0.3 * math.log(pairs)  # log p on the plateau of guessing among the sequence's values


def test_mqar_run_refuses_too_many_pairs():
    cfg = _tiny()["mqar"]  # vocab 16 holds 7 keys, seq_len 16 holds 5 pairs
    with pytest.raises(ValueError, match="seq_len"):
        mqar_run("softmax", cfg, pairs=6)


# ---------------------------------------------------------------- quality: the command line

def _fake_clock():
    now = [0.0]
    return now, types.SimpleNamespace(perf_counter=lambda: now[0])


def test_main_budget_zero_skips_everything(tmp_path):
    out = tmp_path / "q.json"
    argv = ["--preset", "cpu", "--kinds", "softmax", "--only", "mqar", "--budget", "0", "--out", str(out)]
    assert quality_cli.main(argv) == 0
    record = json.loads(out.read_text())
    assert record["results"] == [] and "lm" not in record and "mqar" not in record
    assert record["skipped"] == [f"mqar softmax pairs {p}" for p in PRESETS["cpu"]["mqar"]["pairs"]]
    assert "corpus" not in record  # --only mqar: the language model is not touched
    assert record["command"] == "python -m benchmarks.quality " + " ".join(argv)
    assert record["command"].startswith("python -m benchmarks.quality")
    assert isinstance(record["machine"], str) and record["machine"]
    assert "commit" in record
    assert record["commit"] is None or re.fullmatch(r"[0-9a-f]{40}(\+local changes)?", record["commit"])
    assert record["preset"] == "cpu" and record["autocast"] == "None"
    assert record["config"] == json.loads(json.dumps(PRESETS["cpu"]))


def test_main_budget_skips_later_runs(tmp_path, monkeypatch):
    now, clock = _fake_clock()
    monkeypatch.setattr(quality_cli, "time", clock)
    calls = []

    def fake_mqar(kind, cfg, pairs, seed, device, autocast_dtype):
        calls.append((kind, pairs))
        now[0] += 10.0  # each run takes ten (fake) seconds
        return {"kind": kind, "pairs": pairs, "seed": seed, "accuracy": 0.5, "final_loss": 1.0,
                "loss_curve": [[1, 1.0]], "seconds": 10.0}

    monkeypatch.setattr(quality_cli, "mqar_run", fake_mqar)
    monkeypatch.setitem(quality.PRESETS["cpu"], "mqar", {**PRESETS["cpu"]["mqar"], "pairs": (2, 4, 8)})
    out = tmp_path / "q.json"
    quality_cli.main(["--kinds", "softmax", "elu", "--only", "mqar", "--budget", "15", "--out", str(out)])
    # pairs outer, kinds inner; runs start at t = 0 and 10 (within 15 s), later ones are skipped
    assert calls == [("softmax", 2), ("elu", 2)]
    record = json.loads(out.read_text())
    assert record["results"] == [{"experiment": "mqar", "kind": k, "pairs": p, "seed": 0, "accuracy": 0.5,
                                  "final_loss": 1.0, "loss_curve": [[1, 1.0]], "seconds": 10.0} for k, p in calls]
    assert record["skipped"] == ["mqar softmax pairs 4", "mqar elu pairs 4", "mqar softmax pairs 8",
                                 "mqar elu pairs 8"]


def test_jobs_give_the_runs_of_one_process(tmp_path, monkeypatch):
    # --jobs 2 trains in spawned workers: the same runs in the same order with the same results as one process
    # (a run's seed fixes it), only the wall times differ; a run that would start past the budget is skipped.
    monkeypatch.setitem(quality.PRESETS, "cpu", _tiny())
    records = {}
    for jobs in (1, 2):
        out = tmp_path / f"q{jobs}.json"
        assert quality_cli.main(["--kinds", "softmax", "lightning", "--only", "mqar", "--seeds", "0", "1",
                                 "--jobs", str(jobs), "--out", str(out)]) == 0
        records[jobs] = json.loads(out.read_text())
    assert records[2]["jobs"] == 2 and records[1]["jobs"] == 1

    def runs(record):
        return [{k: v for k, v in r.items() if k != "seconds"} for r in record["results"]]

    assert [(r["kind"], r["pairs"], r["seed"]) for r in records[2]["results"]] == [
        (kind, pairs, seed) for seed in (0, 1) for pairs in (2, 3) for kind in ("softmax", "lightning")]
    assert runs(records[2]) == runs(records[1])
    assert records[2]["skipped"] == []
    out = tmp_path / "q0.json"
    quality_cli.main(["--kinds", "softmax", "--only", "mqar", "--budget", "0", "--jobs", "2", "--out", str(out)])
    assert json.loads(out.read_text())["skipped"] == ["mqar softmax pairs 2", "mqar softmax pairs 3"]


def test_main_trains_tiny_preset(tmp_path, monkeypatch, capsys, corpus):
    tiny = _tiny()
    monkeypatch.setitem(quality.PRESETS, "cpu", tiny)
    out = tmp_path / "q.json"
    assert quality_cli.main(["--kinds", "softmax", "lightning", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["skipped"] == []
    assert record["config"] == json.loads(json.dumps(tiny))
    assert record["corpus"]["source"] == "pydoc_data.topics"
    assert record["corpus"]["train_bytes"] + record["corpus"]["valid_bytes"] == len(corpus)
    assert record["corpus"]["train_bytes"] == round(0.9 * len(corpus))
    # one list of results, the language model's first, each record saying which experiment it belongs to
    assert [r["experiment"] for r in record["results"]] == ["lm"] * 2 + ["mqar"] * 4
    lm, mqar = _records(record, "lm"), _records(record, "mqar")
    assert [r["kind"] for r in lm] == ["softmax", "lightning"]
    assert [(r["kind"], r["pairs"]) for r in mqar] == [("softmax", 2), ("lightning", 2), ("softmax", 3),
                                                        ("lightning", 3)]
    for r in lm:
        assert set(r) == LM_KEYS | {"experiment"} and r["best_valid_loss"] == min(v for _, v in r["valid_curve"])
    for r in mqar:
        assert set(r) == MQAR_KEYS | {"experiment"} and 0 <= r["accuracy"] <= 1
    printed = capsys.readouterr().out
    for r in lm:
        assert f"lm {r['kind']} seed 0: {r['best_valid_loss']:.4f}" in printed
    for r in mqar:
        assert f"mqar {r['kind']} {r['pairs']} seed 0: {r['accuracy']:.3f}" in printed


@pytest.mark.parametrize("only", ["lm", "mqar"])
def test_main_only_writes_the_layout_of_the_recorded_files(tmp_path, monkeypatch, only):
    # `--only mqar` (or lm) writes what notebooks/data/quality_{mqar,lm}_h100.json hold and what chapter 13 reads:
    # the results of that experiment alone under "results", a header that load_recorded accepts, the whole preset
    # under "config", the runs --budget left out under "skipped"
    from lightning_edu.book import describe_recorded

    tiny = _tiny()
    monkeypatch.setitem(quality.PRESETS, "cpu", tiny)
    out = tmp_path / "q.json"
    assert quality_cli.main(["--kinds", "softmax", "--only", only, "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    for key in ("machine", "command", "date", "results"):  # what load_recorded demands
        assert key in record
    assert describe_recorded(record).startswith("Recorded on ")
    assert "lm" not in record and "mqar" not in record  # no second place for the results
    assert record["config"] == json.loads(json.dumps(tiny)) and record["skipped"] == []
    assert {r["experiment"] for r in record["results"]} == {only}
    assert ("corpus" in record) == (only == "lm")
    if only == "mqar":  # the keys chapter 13's MQAR table reads
        cfg = record["config"]["mqar"]
        assert all(key in cfg for key in ("d_model", "layers", "seq_len", "vocab", "steps", "batch", "pairs"))
        assert [(r["kind"], r["pairs"]) for r in record["results"]] == [("softmax", 2), ("softmax", 3)]
        assert all(isinstance(r["accuracy"], float) for r in record["results"])
    else:
        assert [r["kind"] for r in record["results"]] == ["softmax"]


def test_main_argument_errors(tmp_path):
    with pytest.raises(SystemExit):
        quality_cli.main(["--preset", "tpu", "--out", str(tmp_path / "q.json")])
    with pytest.raises(SystemExit):
        quality_cli.main(["--only", "both", "--out", str(tmp_path / "q.json")])
    with pytest.raises(SystemExit):
        quality_cli.main(["--preset", "cpu"])  # --out is required
    with pytest.raises(SystemExit):
        quality_cli.main(["--kinds", "bogus", "--budget", "0", "--out", str(tmp_path / "q.json")])  # refused up front
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="CUDA"):
            quality_cli.main(["--preset", "gpu", "--out", str(tmp_path / "q.json")])
    assert not (tmp_path / "q.json").exists()


# ---------------------------------------------------------------- the recorded runs

def _load(name):
    path = DATA / name
    if not path.exists():
        pytest.skip(f"{name} not recorded")
    return json.loads(path.read_text())


def _records(record, key):
    """The records of experiment ``key`` ("lm" or "mqar") in a quality file: those of its "results" (a record
    without an "experiment" tag, as in files recorded before the tag, counts as the file's), or of each of
    several "runs"."""
    if "runs" in record:
        return [r for run in record["runs"] for r in _records(run, key)]
    return [r for r in record["results"] if r.get("experiment", key) == key]


def _headers(record):
    return record["runs"] if "runs" in record else [record]


def _check_header(header, experiment):
    # the preset of the code is the recorded one (for this experiment: the other may have changed since)
    assert header["config"][experiment] == json.loads(json.dumps(PRESETS["gpu"][experiment])), \
        f"recorded with another {experiment} preset than the code's: record it again"


# The recorded runs against the code as it stands: its preset, its kinds, the keys lm_run and mqar_run write. What
# a run's record holds (best loss the least of its curve, whole numbers of right answers, the corpus split) is
# tested on runs made here: test_lm_run_record, test_mqar_run_record, test_main_trains_tiny_preset.

def test_recorded_lm():
    record = _load("quality_lm_h100.json")
    for header in _headers(record):
        _check_header(header, "lm")
    lm = _records(record, "lm")
    cfg = PRESETS["gpu"]["lm"]
    assert sorted(r["kind"] for r in lm) == sorted(KINDS)  # each attention once
    for r in lm:
        assert set(r) >= LM_KEYS - {"state_per_head"}  # recorded before runs reported it
        assert [s for s, _ in r["valid_curve"]] == list(range(cfg["eval_every"], cfg["steps"] + 1, cfg["eval_every"]))
        assert [s for s, _ in r["train_curve"]] == list(range(cfg["log_every"], cfg["steps"] + 1, cfg["log_every"]))


def test_recorded_mqar():
    record = _load("quality_mqar_h100.json")
    for header in _headers(record):
        _check_header(header, "mqar")
    cfg = PRESETS["gpu"]["mqar"]
    runs = _records(record, "mqar")
    skipped = [s for header in _headers(record) for s in header.get("skipped", [])]
    done = {(r["kind"], r["pairs"]) for r in runs}
    assert len(done) == len(runs)  # no point measured twice
    left = {(m.group(1), int(m.group(2))) for m in (re.fullmatch(r"mqar (\w+) pairs (\d+)", s) for s in skipped)}
    assert done | left == {(k, p) for k in KINDS for p in cfg["pairs"]}
    for r in runs:
        assert set(r) >= MQAR_KEYS - {"state_per_head"}  # likewise


def test_main_runs_mqar_over_seeds_steps_and_pairs_given_on_the_command_line(tmp_path, monkeypatch):
    calls = []

    def fake_mqar(kind, cfg, pairs, seed, device, autocast_dtype):
        calls.append((seed, pairs, kind, cfg["steps"]))
        return {"kind": kind, "pairs": pairs, "seed": seed, "accuracy": 0.5, "final_loss": 1.0,
                "loss_curve": [[1, 1.0]], "seconds": 0.0}

    monkeypatch.setattr(quality_cli, "mqar_run", fake_mqar)
    out = tmp_path / "q.json"
    assert quality_cli.main(["--kinds", "softmax", "elu", "--only", "mqar", "--seeds", "3", "1", "--steps", "7",
                             "--pairs", "2", "5", "--out", str(out)]) == 0
    # seeds outermost, then pairs, then kinds; every run at the steps asked for
    assert calls == [(s, p, k, 7) for s in (3, 1) for p in (2, 5) for k in ("softmax", "elu")]
    record = json.loads(out.read_text())
    assert record["mqar_seeds"] == [3, 1] and record["config"]["mqar"]["steps"] == 7
    assert record["config"]["mqar"]["pairs"] == [2, 5] and PRESETS["cpu"]["mqar"]["steps"] != 7  # the preset untouched


@pytest.mark.parametrize("argv, message", [
    (["--seeds", "1", "1"], "--seeds lists a value twice"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--pairs", "0"], "--pairs must be at least 1"),
])
def test_main_refuses_bad_seeds_steps_and_pairs_and_writes_nothing(argv, message, tmp_path, capsys):
    out = tmp_path / "q.json"
    with pytest.raises(SystemExit) as exc:
        quality_cli.main([*argv, "--only", "mqar", "--out", str(out)])
    assert exc.value.code == 2 and message in capsys.readouterr().err and not out.exists()


# ---------------------------------------------------------------- quality: the state each model carries, a short conv

def test_state_per_head_counts_what_crosses_to_the_last_token():
    cfg = {"d_model": 64, "heads": 2, "seq_len": 128}  # head dim 32
    assert quality.state_per_head("softmax", cfg) == 2 * 127 * 32  # every earlier key and value
    assert quality.state_per_head("lightning", cfg) == 32 * 32
    assert quality.state_per_head("elu", cfg) == quality.state_per_head("relu2", cfg) == 32 * 33  # S and z
    assert quality.state_per_head("hybrid", cfg) == 32 * 33 + 2 * 63 * 32  # and the current block of 64
    with pytest.raises(ValueError, match="kind must be one of"):
        quality.state_per_head("la1", cfg)


def test_a_short_convolution_goes_before_every_attention_and_is_causal():
    cfg = {**_tiny()["mqar"], "short_conv": 4}
    model = quality._model("lightning", 16, cfg, 16, 0, "cpu")
    plain = quality._model("lightning", 16, _tiny()["mqar"], 16, 0, "cpu")
    d = cfg["d_model"]
    assert model.n_params() - plain.n_params() == cfg["layers"] * d * 4  # one d x width filter per layer
    conv = model.blocks[0].conv
    x = torch.randn(2, 10, d, requires_grad=True)
    y = conv(x)
    assert y.shape == x.shape
    # token t's output reads tokens t-3 .. t of its own channel, nothing later
    y[:, 5].sum().backward()
    reached = x.grad.abs().sum(dim=(0, 2)) > 0
    assert reached.tolist() == [False, False, True, True, True, True, False, False, False, False]
    # and equals the filter applied by hand (weights w[c, 0, j] meet x at t - 3 + j)
    w = conv.conv.weight[:, 0]
    by_hand = sum(w[:, j] * x[:, 5 - 3 + j] for j in range(4))
    assert torch.allclose(y[:, 5], by_hand, atol=1e-6)


@pytest.mark.parametrize("width, error", [(1, ValueError), (-2, ValueError), (2.0, TypeError)])
def test_short_conv_width_is_checked(width, error):
    from lightning_edu.models import Decoder

    with pytest.raises(error, match="short_conv"):
        Decoder(16, 16, 2, 1, short_conv=width)


def test_the_command_line_records_a_short_convolution(tmp_path, monkeypatch):
    seen = []

    def fake_mqar(kind, cfg, pairs, seed, device, autocast_dtype):
        seen.append(cfg.get("short_conv"))
        return {"kind": kind, "pairs": pairs, "seed": seed, "accuracy": 0.5, "seconds": 1.0}

    monkeypatch.setattr(quality_cli, "mqar_run", fake_mqar)
    out = tmp_path / "q.json"
    assert quality_cli.main(["--kinds", "elu", "--only", "mqar", "--pairs", "2", "--short-conv", "3",
                             "--out", str(out)]) == 0
    assert seen == [3] and json.loads(out.read_text())["config"]["mqar"]["short_conv"] == 3
    for bad in ("1", "-1"):
        with pytest.raises(SystemExit):
            quality_cli.main(["--only", "mqar", "--short-conv", bad, "--out", str(tmp_path / "no.json")])
    assert not (tmp_path / "no.json").exists()


def test_over_seeds_gives_mean_range_and_the_seeds_of_each_cell():
    results = [{"kind": "lightning", "pairs": 8, "seed": s, "accuracy": a} for s, a in ((0, 1.0), (1, 0.25), (2, 0.5))]
    results += [{"kind": "relu2", "pairs": 8, "seed": 1, "accuracy": 0.125}]
    got = quality.over_seeds(results, "accuracy")
    assert got == {("lightning", 8): (0.5833333333333334, 0.25, 1.0, [0, 1, 2]), ("relu2", 8): (0.125, 0.125, 0.125, [1])}
    lm = [{"kind": "softmax", "seed": s, "best_valid_loss": v} for s, v in ((0, 2.0), (1, 3.0))]
    assert quality.over_seeds(lm, "best_valid_loss", by=("kind",)) == {("softmax",): (2.5, 2.0, 3.0, [0, 1])}


def test_turn_step_is_the_first_logged_step_below_the_threshold():
    # ln 8 = 2.079: 0.3 of it is 0.624. The curve crosses it at step 300 (0.5), not at 200 (0.7), and a curve that
    # never goes below it has no turn.
    run = {"pairs": 8, "loss_curve": [[100, 2.1], [200, 0.7], [300, 0.5], [400, 0.01]]}
    assert quality.turn_step(run) == 300
    assert quality.turn_step(run, fraction=0.4) == 200  # 0.832
    assert quality.turn_step({"pairs": 8, "loss_curve": [[100, 2.1], [200, 2.0]]}) is None


@pytest.mark.parametrize("name, experiment, changed", [
    ("quality_lm_h200.json", "lm", {"seeds": [0, 1, 2]}),
    ("quality_mqar_conv_h200.json", "mqar", {"steps": 1500, "short_conv": 4}),
    ("quality_mqar_h200.json", "mqar", {"steps": 1500}),
])
def test_recorded_over_seeds(name, experiment, changed):
    # The records chapter 13 reads over seeds: the code's preset but for what their command changed, and every
    # (attention, pairs, seed) cell exactly once for seeds 0, 1 and 2, nothing skipped.
    record = _load(name)
    preset = json.loads(json.dumps(PRESETS["gpu"][experiment]))
    assert record["config"][experiment] == {**preset, **changed}, f"{name}: record it again"
    runs = _records(record, experiment)
    cells = [(r["kind"], r.get("pairs"), r["seed"]) for r in runs]
    pairs = preset["pairs"] if experiment == "mqar" else [None]
    assert sorted(cells, key=str) == sorted(((k, p, s) for k in KINDS for p in pairs for s in (0, 1, 2)), key=str)
    assert record["skipped"] == []
    keys = LM_KEYS if experiment == "lm" else MQAR_KEYS
    for r in runs:
        assert set(r) >= keys - {"state_per_head"}
