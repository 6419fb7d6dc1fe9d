"""The benchmark harness on the CPU: timing needs a GPU, the arithmetic around it and the method table do not.

The table is built from the registry, so its methods run here too, in Triton's CPU interpreter on tiny inputs.
"""

import json
import types
from pathlib import Path

import pytest
import torch

import lightning_edu as le
from lightning_edu import registry, validation
from lightning_edu.checks import relative_error
from benchmarks import bench
from lightning_edu import book, costs
from lightning_edu.models.decay import head_decays

ROOT = Path(__file__).resolve().parents[2]


def test_hbm_floor_counts_four_tensors_forward_and_seven_backward():
    # 16 x 2048 x 16 x 128 bf16 elements per tensor = 128 MiB (the benchmark's shape at T = 2K)
    assert costs.hbm_floor_bytes(16, 2048, 16, 128) == 4 * 2**27
    assert costs.hbm_floor_bytes(16, 2048, 16, 128, backward=True) == 7 * 2**27


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


# ------------------------------------------------------------------------------------------------------
# The method table comes from the registry: one method per benchmarked Triton record, none from a name.

def _benchmarked_triton_records():
    return [impl for impl in registry.IMPLEMENTATIONS.values() if impl.rung == "triton" and impl.bench is not None]


def test_every_benchmarked_triton_record_has_a_method():
    ours = {m.implementation: name for name, m in bench.METHODS.items() if m.implementation is not None}
    for impl in _benchmarked_triton_records():
        name = "triton" if impl is registry.backend_for("triton") else impl.name
        assert ours.get(impl.name) == name, f"{impl.name} has no benchmark method named {name!r}"
        assert bench.METHODS[name].max_T == impl.bench.get("max_T")
    assert ours["torch.chunked"] == "torch"  # the torch backend, beside the anchors
    skipped = [i.name for i in registry.IMPLEMENTATIONS.values() if i.rung == "triton" and i.bench is None]
    assert not set(skipped) & set(ours)


def test_method_table_reads_records_not_names():
    # Names that no rule could parse: the table follows the records' fields only.
    fake = {
        "triton.zz": registry.Implementation("triton.zz", "triton", "07", "a", "m:f", "m:g", bench={"max_T": 7}),
        "la2_fast_anything": registry.Implementation("la2_fast_anything", "triton", "07", "b", "m:f", bench=None),
        "triton.main": registry.Implementation("triton.main", "triton", "07", "c", "m:f", "m:g", backend=True,
                                               differentiable=True, bench={}),
        "torch.x": registry.Implementation("torch.x", "torch", "06", "d", "m:f", bench={}),
    }
    methods = bench.registry_methods(fake)
    assert list(methods) == ["triton", "triton.zz"]  # the backend first, named by its rung
    assert methods["triton"].implementation == "triton.main"
    assert methods["triton.zz"].max_T == 7
    typo = {"triton.t": registry.Implementation("triton.t", "triton", "07", "e", "m:f", bench={"maxT": 7})}
    with pytest.raises(ValueError, match="maxT"):
        bench.registry_methods(typo)


def test_recorded_names_map_to_current_methods():
    assert set(book.RECORDED_NAMES.values()) <= set(bench.METHODS)
    recorded = sorted((ROOT / "notebooks" / "data").glob("bench_*.json"))
    assert recorded, "no recorded benchmark to read"
    for path in recorded:
        data = book.with_current_names(json.loads(path.read_text()))
        names = {r["method"] for r in data["results"]} | set(data["correctness_rel_err"]) | set(data["unavailable"])
        assert names <= set(bench.METHODS), f"{path.name}: {sorted(names - set(bench.METHODS))}"


def test_cli_takes_recorded_names_and_refuses_unknown_ones(monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(SystemExit, match="refusing to time"):  # every name known: on to the GPU check
        bench.main(["--methods", "triton", "la2_fast_noseg", "triton.la1", "fla_chunk"])
    with pytest.raises(SystemExit):
        bench.main(["--methods", "triton", "la2_fast_sideways"])
    assert "unknown method(s) la2_fast_sideways" in capsys.readouterr().err


def _tiny(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(1, 2, 20, 16, generator=g).to(dtype) for _ in range(4))
    return q, k, v, do, head_decays(2)


@pytest.mark.parametrize("name", [n for n, m in bench.METHODS.items() if m.implementation is not None])
def test_registry_methods_compute_the_function_on_the_cpu(name):
    q, k, v, do, decay = _tiny()
    fwd, fwdbwd = bench.METHODS[name].make(q, k, v, decay, do)
    arrays = [x.double().numpy() for x in (q, k, v, do)]
    o_ref = le.lightning_attention(*arrays[:3], decay, backend="numpy")
    grads_ref = le.lightning_attention_backward(*arrays, decay, backend="numpy")
    tol = registry.TOLERANCES["float32"]
    assert relative_error(fwd(), o_ref) < tol
    for got, ref, what in zip(fwdbwd(), grads_ref, ("dq", "dk", "dv")):
        assert relative_error(got, ref) < tol, what
    assert relative_error(fwd(), o_ref) < tol  # the callables run again: do_bench calls them many times


@pytest.mark.parametrize("name", ["triton", "triton.la2_literal"])
def test_timed_callables_do_not_validate(name, monkeypatch):
    calls = []
    checked = validation.validate_attention_args
    monkeypatch.setattr(validation, "validate_attention_args", lambda *a, **kw: calls.append(1) or checked(*a, **kw))
    q, k, v, do, decay = _tiny()
    fwd, fwdbwd = bench.METHODS[name].make(q, k, v, decay, do)
    assert len(calls) == 1
    fwd(), fwdbwd()
    assert len(calls) == 1, "validation ran inside a timed callable"


def test_method_refuses_what_its_record_does_not_support():
    q, k, v, do, decay = _tiny(torch.float64)  # the kernels take no float64
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        bench.METHODS["triton.la1"].make(q, k, v, decay, do)


def test_environment_commit_prefers_the_variable_given_for_a_copied_checkout(monkeypatch):
    from lightning_edu.environment import git_commit

    monkeypatch.setenv("LIGHTNING_EDU_COMMIT", "0123456789abcdef")
    assert git_commit() == "0123456789abcdef"
    monkeypatch.delenv("LIGHTNING_EDU_COMMIT")
    assert git_commit() != "0123456789abcdef"


def test_a_record_is_saved_whole_or_not_at_all(tmp_path):
    from lightning_edu.environment import save_record

    path = tmp_path / "r.json"
    save_record(path, {"results": [1.5]})
    assert json.loads(path.read_text()) == {"results": [1.5]} and path.read_text().startswith('{\n "results"')
    with pytest.raises(TypeError):  # the writer fails half-way (a value JSON cannot hold), as a run cut short would
        save_record(path, {"results": [2.5, object()]})
    assert json.loads(path.read_text()) == {"results": [1.5]}  # the last whole record stays
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # and no temporary file is left beside it


def test_interleaved_rounds_rotate_the_order_and_take_medians():
    calls = []
    clock = iter(range(100))  # each call is slower than the one before: a drifting machine

    def method(name):
        def measure():
            calls.append(name)
            t = float(next(clock))
            return {"fwd_ms": t, "fwd_peak_extra_bytes": 10 * len(calls)}
        return measure

    def broken():
        calls.append("broken")
        raise RuntimeError("out of memory")

    rows = bench.interleaved({"a": method("a"), "b": method("b"), "broken": broken}, rounds=3)
    # round 0 from a, round 1 from b, round 2 from broken, which is not called again after it failed
    assert calls == ["a", "b", "broken", "b", "a", "a", "b"]
    assert rows["a"]["fwd_ms_rounds"] == [0.0, 3.0, 4.0] and rows["a"]["fwd_ms"] == 3.0
    assert rows["b"]["fwd_ms_rounds"] == [1.0, 2.0, 5.0] and rows["b"]["fwd_ms"] == 2.0
    assert rows["b"]["fwd_peak_extra_bytes"] == 70  # the largest over the rounds
    assert rows["broken"] == {"error": "RuntimeError: out of memory"}
    one = bench.interleaved({"a": method("a")}, rounds=1)["a"]
    assert set(one) == {"fwd_ms", "fwd_peak_extra_bytes"}  # one round: no list of rounds
    assert bench.interleaved({}, rounds=2) == {}


def test_rounds_must_be_positive():
    with pytest.raises(SystemExit):
        bench.main(["--rounds", "0"])


def test_run_table_interleaves_every_shape_and_skips_past_max_T(monkeypatch):
    # The loop around the timings, on the CPU: inputs, correctness, bandwidth and the timings themselves faked.
    order = []
    methods = {"ours": bench.Method("ours", lambda *a: None), "short": bench.Method("short", lambda *a: None, max_T=64)}
    monkeypatch.setattr(bench, "METHODS", methods)
    monkeypatch.setattr(bench, "copy_bandwidth", lambda: 1e12)
    monkeypatch.setattr(bench, "_correctness", lambda *a: 0.0)
    monkeypatch.setattr(bench, "benchmark_inputs", lambda batch, heads, T, d, dtype: [torch.zeros(batch, heads, T, d)] * 4)

    def measure(make, q, *rest):
        order.append((next(n for n, m in methods.items() if m.make is make), q.shape[2]))
        return {"fwd_ms": 1.0, "fwdbwd_ms": 2.0}

    monkeypatch.setattr(bench, "_measure", measure)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    args = types.SimpleNamespace(D=[16], T=[64, 128], H=2, tokens=128, dtype="fp32", methods=["ours", "short"],
                                 rounds=2, out=None, backward_on_caller=False)
    data = bench.run_table(args)
    assert order == [("ours", 64), ("short", 64), ("short", 64), ("ours", 64), ("ours", 128), ("ours", 128)]
    assert [(r["method"], r["T"], r["batch"]) for r in data["results"]] == [("ours", 64, 2), ("short", 64, 2),
                                                                             ("ours", 128, 1)]
    assert data["rounds"] == 2 and data["results"][0]["fwd_ms_rounds"] == [1.0, 1.0]
    assert data["results"][0]["fwd_tokens_per_s"] == 128 / 1e-3


def test_backward_on_caller_turns_autograds_device_thread_off_for_the_backward_only(monkeypatch):
    def make(q, k, v, decay, do):
        state = torch.autograd.is_multithreading_enabled
        return (lambda: ("fwd", state())), (lambda: ("fwdbwd", state()))

    fwd, fwdbwd = bench.backward_on_caller(make)(*[None] * 5)
    assert fwd() == ("fwd", True) and fwdbwd() == ("fwdbwd", False)
    assert torch.autograd.is_multithreading_enabled()  # restored after the call
    # run_table: every method wrapped, and the record says so
    seen = []
    monkeypatch.setattr(bench, "METHODS", {"ours": bench.Method("ours", make)})
    monkeypatch.setattr(bench, "copy_bandwidth", lambda: 1e12)
    monkeypatch.setattr(bench, "_correctness", lambda *a: 0.0)
    monkeypatch.setattr(bench, "benchmark_inputs", lambda batch, heads, T, d, dtype: [torch.zeros(batch, heads, T, d)] * 4)

    def measure(wrapped, *inputs):
        fwd, fwdbwd = wrapped(*inputs)
        seen.append((fwd()[1], fwdbwd()[1]))
        return {"fwd_ms": 1.0, "fwdbwd_ms": 2.0}

    monkeypatch.setattr(bench, "_measure", measure)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    for on_caller in (True, False):
        args = types.SimpleNamespace(D=[16], T=[64], H=2, tokens=64, dtype="fp32", methods=["ours"], rounds=1,
                                     out=None, backward_on_caller=on_caller)
        data = bench.run_table(args)
        assert seen.pop() == (True, not on_caller) and data.get("backward_on_caller", False) is on_caller


def test_run_tiny_interleaves_its_methods_in_rounds(monkeypatch):
    # The tiny call's loop on the CPU: every method timed once per round, in a rotated order, per head dim; the
    # row holds the median over the rounds and the rounds' values; a method that raises keeps its error.
    order, makes = [], []

    def make(name):
        def made(q, k, v, decay, do):
            makes.append((name, q.shape[-1]))

            def fwdbwd():
                order.append((name, q.shape[-1]))
                if name == "broken":
                    raise RuntimeError("no such kernel")
            return None, fwdbwd
        return bench.Method(name, made)

    monkeypatch.setattr(bench, "METHODS", {name: make(name) for name in ("ours", "theirs", "broken")})
    monkeypatch.setattr(bench, "benchmark_inputs", lambda batch, heads, T, d, dtype: [torch.zeros(batch, heads, T, d)] * 4)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    walls = iter(range(1, 100))
    monkeypatch.setattr("lightning_edu.measure.median_time",
                        lambda fn, repeat, warmup: (fn(), next(walls) / 1e3)[1])
    args = types.SimpleNamespace(D=[16, 32], dtype="fp32", methods=["ours", "theirs", "broken"], rounds=3)
    data = bench.run_tiny(args)
    assert data["rounds"] == 3
    rotated = ["ours", "theirs", "broken", "theirs", "ours", "ours", "theirs"]  # "broken" not called after its error
    assert order == [(name, 16) for name in rotated] + [(name, 32) for name in rotated]
    assert makes == [(name, d) for d in (16, 32) for name in ("ours", "theirs", "broken")]  # once per method and D
    rows = {(r["method"], r["D"]): r for r in data["results"]}
    assert rows["ours", 16]["fwdbwd_wall_ms_rounds"] == [1.0, 4.0, 5.0] and rows["ours", 16]["fwdbwd_wall_ms"] == 4.0
    assert rows["theirs", 16]["fwdbwd_wall_ms_rounds"] == [2.0, 3.0, 6.0]
    assert rows["ours", 32]["fwdbwd_wall_ms_rounds"] == [7.0, 10.0, 11.0]
    assert rows["broken", 32] == {"method": "broken", "T": 256, "D": 32, "batch": 1, "heads": 4, "dtype": "fp32",
                                  "error": "RuntimeError: no such kernel"}


def test_two_ways_interleaves_its_rounds_and_summarises_each_way():
    # benchmarks.prepass and benchmarks.redo time a setting off and on in turn: off, on, off, on, ...; each way's
    # entry holds the median, the rounds and the floor over the median; the setting is back as it was after.
    from benchmarks.two_ways import summary, time_two_ways
    from lightning_edu.triton_kernels import plan

    switched = []
    times, firsts = time_two_ways("prepass_tail_first", {"a_ms": lambda: 2.0 if plan.settings().prepass_tail_first else 4.0},
                                  first=lambda: switched.append(plan.settings().prepass_tail_first) or switched[-1],
                                  rounds=3)
    assert switched == [False, True] * 3 and plan.settings() == plan.Settings()
    assert times == {False: {"a_ms": [4.0] * 3}, True: {"a_ms": [2.0] * 3}} and firsts == {False: False, True: True}
    assert summary({"a_ms": [1.0, 3.0, 2.0]}, {"a_frac": ("a_ms", 1.0)}) == {
        "a_ms": 2.0, "a_ms_rounds": [1.0, 3.0, 2.0], "a_frac": 0.5}
