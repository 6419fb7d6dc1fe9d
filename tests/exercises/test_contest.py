"""The kernel contest (lightning_edu.exercises.contest): correctness checks, grading, the leaderboard, the command.

Without CUDA every kernel runs in Triton's CPU interpreter (float32); the timing path needs a GPU and its tests
are marked ``gpu``. The submissions here are small: a correct one in torch ops, planted mistakes (each must be
refused with the message that names it), the starter Triton kernel and broken variants of it.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import lightning_edu
from lightning_edu.exercises import ExerciseError, IntegrityError
from lightning_edu.exercises import contest
from lightning_edu.exercises.contest import (
    STARTER, check_forward_kernel, find_submissions, grade, leaderboard_markdown, load_submission, time_forward_kernel,
)

ROOT = Path(__file__).resolve().parents[2]
HAS_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU with Triton's interpreter off")


# ------------------------------------------------------------------------------------------- submissions


def _masked(q, k, v, log2_decay, *, keep=lambda gap: gap >= 0, power=lambda gap, l2: torch.exp2(l2 * gap)):
    """The quadratic form [(Q K^T) * M] V in torch, with the mask and the decay as arguments (to plant mistakes)."""
    n = q.shape[-2]
    t = torch.arange(n, device=q.device)
    gap = (t[:, None] - t[None, :]).float()
    decay = power(gap.clamp(min=0), log2_decay.float()[:, None, None])
    weights = torch.where(keep(gap), decay, 0.0) * (q.float() @ k.float().transpose(-1, -2))
    return (weights @ v.float()).to(v.dtype)


def correct(q, k, v, log2_decay):
    return _masked(q, k, v, log2_decay)


def chunked(q, k, v, log2_decay, *, decay_the_state=True, block=16):
    """Algorithm 1 in torch: the intra part of each block plus the carried state; ``decay_the_state=False``
    forgets lambda^b when the state moves past a block."""
    batch, heads, n, d_k = q.shape
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    kv = torch.zeros(batch, heads, d_k, v.shape[-1], device=v.device)
    l2 = log2_decay.float()[:, None, None]
    for start in range(0, n, block):
        end = min(n, start + block)
        r = torch.arange(end - start, dtype=torch.float32, device=v.device)[:, None]
        qb, kb, vb = (x[..., start:end, :].float() for x in (q, k, v))
        out[..., start:end, :] = _masked(qb, kb, vb, log2_decay).float() + (qb * torch.exp2(l2 * (r + 1))) @ kv
        carry = torch.exp2(l2 * (end - start)) if decay_the_state else 1.0
        kv = kv * carry + (kb * torch.exp2(l2 * (end - start - 1 - r))).transpose(-1, -2) @ vb
    return out.to(v.dtype)


def correct_chunked(q, k, v, log2_decay):
    return chunked(q, k, v, log2_decay)


def state_not_decayed(q, k, v, log2_decay):
    return chunked(q, k, v, log2_decay, decay_the_state=False)


def no_decay(q, k, v, log2_decay):
    return _masked(q, k, v, log2_decay, power=lambda gap, l2: torch.ones_like(gap * l2))


def diagonal_left_out(q, k, v, log2_decay):
    return _masked(q, k, v, log2_decay, keep=lambda gap: gap > 0)


def sees_next_token(q, k, v, log2_decay):
    return _masked(q, k, v, log2_decay, keep=lambda gap: gap >= -1)


def exp_not_exp2(q, k, v, log2_decay):
    return _masked(q, k, v, log2_decay, power=lambda gap, l2: torch.exp(l2 * gap))


def fp32_for_bf16(q, k, v, log2_decay):
    return _masked(q, k, v, log2_decay).float()


def nan_in_last_row(q, k, v, log2_decay):
    o = _masked(q, k, v, log2_decay)
    o[..., -1, :] = float("nan")
    return o


def factorised_decay(q, k, v, log2_decay):
    """lambda^(t - s) as lambda^t * lambda^-s: lambda^-s overflows float32 for a lambda near 0."""
    n = q.shape[-2]
    t = torch.arange(n, dtype=torch.float32, device=q.device)
    l2 = log2_decay.float()[:, None]
    qa = q.float() * torch.exp2(l2 * t)[..., None]
    kb = k.float() * torch.exp2(-l2 * t)[..., None]
    return ((torch.tril(torch.ones(n, n, device=q.device)) * (qa @ kb.transpose(-1, -2))) @ v.float()).to(v.dtype)


def heads_swapped(q, k, v, log2_decay):
    return _masked(q, k, v, log2_decay).transpose(1, 2).contiguous()


def returns_state_too(q, k, v, log2_decay):
    return _masked(q, k, v, log2_decay), None


def scales_q_in_place(q, k, v, log2_decay):
    q.mul_(2.0)
    return _masked(q, k, v, log2_decay) / 2


def calls_the_package(q, k, v, log2_decay):
    lam = torch.exp2(log2_decay.double())
    return lightning_edu.lightning_attention(q, k, v, lam, backend="torch")


def calls_the_book_kernel(q, k, v, log2_decay):
    from lightning_edu.triton_kernels.la2_fast import la2_fast_forward

    return la2_fast_forward(q.float(), k.float(), v.float(), log2_decay)[0].to(v.dtype)


def returns_nothing(q, k, v, log2_decay):
    _masked(q, k, v, log2_decay)


def returns_numpy(q, k, v, log2_decay):
    return _masked(q, k, v, log2_decay).cpu().numpy()


def uses_d_k_for_o(q, k, v, log2_decay):
    return _masked(q, k, q, log2_decay)


def scaled_everywhere(q, k, v, log2_decay):
    return _masked(q, k, v, log2_decay) * 1.5


def batch_0_everywhere(q, k, v, log2_decay):
    return _masked(q[:1], k[:1], v[:1], log2_decay).expand_as(v).contiguous()


def off_from_row_20(q, k, v, log2_decay):
    o = _masked(q, k, v, log2_decay)
    o[..., 20:, :] *= 1.01
    return o


PLANTED = [  # (submission, the exception, what its message must say)
    (returns_nothing, ExerciseError, "your forward returned None -- did you forget `return o`?"),
    (returns_numpy, ExerciseError, "your forward returned ndarray, expected a torch tensor o"),
    (uses_d_k_for_o, ExerciseError, "o's last dim is v's head dim d_v = 32 (here d_k = 16?)"),
    (scaled_everywhere, ExerciseError, "row 0 is already wrong, where o_0 = (q_0 . k_0) v_0"),
    (batch_0_everywhere, ExerciseError, "batch 0 is right and batch 1 wrong"),
    (off_from_row_20, ExerciseError, "rows 0-19 are right in every head: look at what changes at row 20"),
    (no_decay, ExerciseError, "there is no decay"),
    (diagonal_left_out, ExerciseError, "the diagonal is left out"),
    (sees_next_token, ExerciseError, "o_t also sees token t + 1"),
    (exp_not_exp2, ExerciseError, "raise 2 to it (tl.exp2, torch.exp2), not e"),
    (state_not_decayed, ExerciseError, "the state carried from one block to the next is off"),
    (fp32_for_bf16, ExerciseError, "o has dtype float32 for bfloat16 inputs"),
    (nan_in_last_row, ExerciseError, "o contains NaN, first at batch 0, head 0"),
    (factorised_decay, ExerciseError, "a negative power of lambda overflowed"),
    (heads_swapped, ExerciseError, "the heads and the sequence are swapped"),
    (returns_state_too, ExerciseError, "return o alone"),
    (scales_q_in_place, ExerciseError, "wrote into its input q"),
    (calls_the_package, IntegrityError, "calls lightning_edu.lightning_attention: write the algorithm yourself"),
    (calls_the_book_kernel, IntegrityError, "calls lightning_edu.triton_kernels.la2_fast.la2_fast_forward"),
]


@pytest.mark.parametrize("forward", [correct, correct_chunked], ids=lambda f: f.__name__)
def test_a_correct_submission_passes_on_fixed_and_fresh_inputs(forward, capsys):
    check_forward_kernel(forward)
    assert "Correct: forward matches the float64 reference on 4 float32 cases" in capsys.readouterr().out
    for seed in (1, 2, None):
        check_forward_kernel(forward, seed=seed)
    out = capsys.readouterr().out
    assert out.count("Correct:") == 3 and "fresh inputs, seed" in out


@pytest.mark.parametrize("forward, error, expected", PLANTED, ids=[p[0].__name__ for p in PLANTED])
def test_each_planted_mistake_is_refused_with_its_message(forward, error, expected):
    with pytest.raises(error) as info:
        check_forward_kernel(forward)
    message = str(info.value)
    assert expected in message, message
    assert "Traceback" not in message and "the check could not use" not in message


def test_a_wrong_value_is_located_by_batch_head_and_row():
    with pytest.raises(ExerciseError) as info:
        check_forward_kernel(state_not_decayed)
    message = str(info.value)
    # lambda = 1 needs no decay, so only the other heads go wrong, and first where block 1's state is decayed
    assert "case 1 of 5" in message and "o differs first at batch 0, head 0 (lambda = 0.9), row 32 of 37" in message
    assert "Only heads with lambda != 1 are wrong" in message
    with pytest.raises(ExerciseError, match=r"\[inputs of seed 5: check_forward_kernel\(state_not_decayed, seed=5\)"):
        check_forward_kernel(state_not_decayed, seed=5)


def _tf32(x):
    """x (float64 numpy) with its mantissa cut to tf32's 10 bits, as a GPU's tl.dot rounds fp32 operands."""
    import numpy as np

    m, e = np.frexp(x)
    return np.ldexp(np.round(m * 2.0**11) / 2.0**11, e)


def test_a_correct_answer_through_tf32_dots_passes_where_the_terms_cancel():
    # One token, q.k = 0.01 beside terms of size 1: the tf32 rounding of q and k moves the answer by more than
    # 0.5 % of itself, and ROUNDING (a fraction of the sum over absolute values) lets it pass; an answer off by
    # more than tf32 can explain (q.k off by 0.1) still fails.
    import numpy as np

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, 1, 32)) + 0.3 for _ in range(3))
    k[..., -1] -= ((q * k).sum() - 0.01) / q[..., -1]  # q.k = 0.01
    lams = (0.9,)
    got = contest._reference(_tf32(q), _tf32(k), _tf32(v), lams)
    ref = contest._reference(q, k, v, lams)
    rtol, rounding = contest.TOLERANCE["float32", "cuda"], contest.ROUNDING["float32", "cuda"]
    assert np.abs(got - ref).max() > rtol * np.abs(ref).max()  # the relative tolerance alone would refuse it
    with pytest.raises(ExerciseError, match="differs first at batch 0, head 0"):
        contest._diagnose(got, q, k, v, lams, rtol, "case", "float32")
    contest._diagnose(got, q, k, v, lams, rtol, "case", "float32", rounding)
    with pytest.raises(ExerciseError, match="differs first"):
        contest._diagnose(ref + 0.1 * v, q, k, v, lams, rtol, "case", "float32", rounding)


def test_what_the_submission_raises_becomes_a_short_message():
    def raises(q, k, v, log2_decay):
        raise RuntimeError("first line\nmore\nlast line")

    def placeholder(q, k, v, log2_decay):
        raise NotImplementedError()

    with pytest.raises(ExerciseError, match=r"your forward raised RuntimeError: first line \.\.\. last line"):
        check_forward_kernel(raises)
    with pytest.raises(ExerciseError, match="not implemented yet"):
        check_forward_kernel(placeholder)
    with pytest.raises(ExerciseError, match="needs your function"):
        check_forward_kernel("forward.py")


# ------------------------------------------------------------------------------------------- Triton kernels


def _write(folder: Path, name: str, source: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    return path


def test_the_starter_triton_kernel_passes_in_the_interpreter(tmp_path, capsys):
    forward = load_submission(_write(tmp_path, "starter.py", STARTER))
    check_forward_kernel(forward, seed=None)
    assert "Correct:" in capsys.readouterr().out


KERNEL_SLIPS = [  # (the starter's line, its replacement, what the message must say)
    ("kv = kv * tl.exp2(log2_lam * b.to(tl.float32)) + ", "kv = kv + ",
     "row 32, a block boundary (a multiple of 16), is the first wrong one"),
    ("q_decay = tl.exp2(log2_lam * (r + 1).to(tl.float32))", "q_decay = tl.exp2(log2_lam * r.to(tl.float32))",
     "row 16, a block boundary (a multiple of 16), is the first wrong one"),
    ("BLOCK=16)", "BLOCK=12)", "arange's range must be a power of 2\"). A Triton kernel failed to compile or launch"),
]


@pytest.mark.parametrize("line, slip, expected", KERNEL_SLIPS, ids=["state-not-decayed", "inter-power", "tiles-of-12"])
def test_a_broken_starter_kernel_is_refused_with_its_message(tmp_path, line, slip, expected):
    assert line in STARTER
    forward = load_submission(_write(tmp_path, "broken.py", STARTER.replace(line, slip)))
    with pytest.raises(ExerciseError) as info:
        check_forward_kernel(forward)
    message = str(info.value)
    assert expected in message, message
    assert "Traceback" not in message and len(message) < 1200


def test_a_kernel_that_uses_the_books_triton_helpers_is_refused(tmp_path):
    helper = "from lightning_edu.triton_kernels._tiles import apply_decay\n"
    source = STARTER.replace("import triton.language as tl\n", "import triton.language as tl\n" + helper)
    source = source.replace("        scores = tl.dot(q, tl.trans(k)) * intra_decay",
                            "        scores = apply_decay(tl.dot(q, tl.trans(k)), intra_decay)")
    forward = load_submission(_write(tmp_path, "helper.py", source))
    with pytest.raises(IntegrityError, match=r"calls lightning_edu\.triton_kernels\._tiles\.apply_decay \(through "
                                              r"_forward_kernel\)"):
        check_forward_kernel(forward)


# ------------------------------------------------------------------------------------------- loading


def _docstring_example() -> str:
    """The minimal torch submission shown in the module's docstring, as the file a student would hand in."""
    doc = contest.__doc__
    start = doc.index("for trying out the grader::") + len("for trying out the grader::")
    return textwrap.dedent(doc[start:doc.index("\n\nGrading runs", start)]).strip() + "\n"


# Correct and quadratic, what the docstring promises: it loads and passes the check below and ranks first in the
# graded folders. The planted slips replace its text; each graded one must then be refused by name, so a slip whose
# text the example no longer holds fails there.
TORCH_SOURCE = _docstring_example()


@pytest.mark.parametrize("source, expected", [
    ("def forward(q, k, v, log2_decay):\n    return q +\n", "does not compile (line 2): SyntaxError"),
    ("import torch\n\ndef kernel(q, k, v, log2_decay):\n    return v\n", "defines no function `forward"),
    ("forward = 3\n", "defines forward as a int, not a function"),
    ("import not_a_module_anywhere\n", "while loading: your forward raised ModuleNotFoundError"),
    ("import sys\nsys.exit(3)\n", "while loading: your forward raised SystemExit"),
], ids=["syntax", "no-forward", "not-callable", "import-error", "exit"])
def test_a_file_that_does_not_load_gets_a_message(tmp_path, source, expected):
    with pytest.raises(ExerciseError) as info:
        load_submission(_write(tmp_path, "student.py", source))
    assert expected in str(info.value)


def test_loading_reads_the_file_and_writes_nothing(tmp_path):
    path = _write(tmp_path, "alice.py", TORCH_SOURCE)
    before = (path.read_bytes(), path.stat().st_mtime_ns)
    forward = load_submission(path)
    check_forward_kernel(forward)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alice.py"]  # no __pycache__
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before
    with pytest.raises(ExerciseError, match="holds no submission.py"):
        load_submission(tmp_path)
    with pytest.raises(ExerciseError, match="a Python file ending in .py"):
        load_submission(tmp_path / "alice.txt")


def _folder(tmp_path: Path) -> Path:
    """One .py file per student, a sub-folder per student, and what goes wrong in real hand-ins."""
    root = tmp_path / "submitted"
    _write(root, "alice.py", TORCH_SOURCE)
    _write(root, "bob/submission.py", STARTER)
    _write(root, "carol.py", TORCH_SOURCE.replace("log2_decay.float()[:, None, None] * gap", "0.0 * gap"))
    _write(root, "dave.py", "def forward(q, k, v, log2_decay)\n    return v\n")
    _write(root, "erin.py", "import lightning_edu\n\ndef forward(q, k, v, log2_decay):\n    return "
                            "lightning_edu.lightning_attention(q, k, v, torch_decay(log2_decay), backend='torch')\n\n"
                            "def torch_decay(l2):\n    return (2.0 ** l2.double())\n")
    (root / "frank").mkdir()
    _write(root, "_helpers.py", "x = 1\n")
    return root


def test_find_submissions_names_students_by_file_stem_or_folder(tmp_path):
    root = _folder(tmp_path)
    found = find_submissions([root])
    assert sorted(found) == ["alice", "bob", "carol", "dave", "erin", "frank"]
    assert found["bob"] == root / "bob" and found["frank"] == root / "frank"
    assert find_submissions([root / "bob"]) == {"bob": root / "bob" / "submission.py"}
    assert find_submissions(str(root / "alice.py")) == {"alice": root / "alice.py"}
    with pytest.raises(ValueError, match="two submissions named 'alice'"):
        find_submissions([root, root / "alice.py"])
    with pytest.raises(ValueError, match="does not exist"):
        find_submissions([root / "nobody.py"])
    with pytest.raises(ValueError, match="is not a .py file"):
        find_submissions([_write(tmp_path, "notes.txt", "hi")])


# ------------------------------------------------------------------------------------------- grading


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns) if p.is_file() else None
            for p in sorted(root.rglob("*"))}


@pytest.mark.skipif(HAS_GPU, reason="the CPU-only leaderboard")
def test_grade_ranks_a_folder_and_says_speed_was_not_measured(tmp_path):
    root = _folder(tmp_path)
    before = _snapshot(root)
    report = grade(find_submissions([root]), seed=11)
    assert _snapshot(root) == before  # the students' files are read, never written
    rows = {r["student"]: r for r in report["entries"]}
    assert [r["student"] for r in report["entries"]] == ["alice", "bob", "carol", "dave", "erin", "frank"]
    assert {name: (r["rank"], r["correct"], r["points"]) for name, r in rows.items()} == {
        "alice": (1, True, 60), "bob": (1, True, 60), "carol": (3, False, 0), "dave": (3, False, 0),
        "erin": (3, False, 0), "frank": (3, False, 0)}
    assert "there is no decay" in rows["carol"]["message"] and "seed=11" in rows["carol"]["message"]
    assert "does not compile (line 1)" in rows["dave"]["message"]
    assert "calls lightning_edu.lightning_attention" in rows["erin"]["message"]
    assert "holds no submission.py" in rows["frank"]["message"]
    assert report["speed_measured"] is False and report["max_points"] == 60 and report["seed"] == 11
    assert all(r["speedup"] is None and r["best_floor_frac"] is None and r["timings"] is None for r in rows.values())
    json.dumps(report)  # JSON-ready
    text = leaderboard_markdown(report)
    assert "**Speed was not measured: no CUDA GPU in this run (correctness only" in text
    assert "plus 40 x min(speedup, 1) where speedup is the geometric mean" in text
    assert "| 1 | alice | yes | not measured | not measured | 60 / 60 |" in text
    assert "| 3 | carol | no | - | - | 0 / 60 |" in text
    table = [line.strip("| ").split(" | ") for line in text.splitlines()
             if line.startswith("| ") and not line.startswith("| rank")]
    assert len(table) == 6 and all(cells[3] in ("not measured", "-") and cells[4] in ("not measured", "-")
                                   for cells in table)  # no speedup, no fraction of the floor: nothing was timed
    assert "## Timings" not in text and "TB/s" not in text


def test_grade_takes_functions_and_checks_its_arguments():
    report = grade({"torch": correct, "slip": diagonal_left_out}, seed=0, measure_speed=False)
    ranked = [(r["student"], r["rank"], r["correct"]) for r in report["entries"]]
    assert ranked == [("torch", 1, True), ("slip", 2, False)]
    assert report["entries"][0]["source"] == "function correct"
    with pytest.raises(TypeError, match="non-empty dict"):
        grade({})
    with pytest.raises(TypeError, match="must be a path or a function"):
        grade({"a": 3})
    with pytest.raises(TypeError, match="student names must be non-empty strings"):
        grade({"": correct})
    with pytest.raises(ValueError, match="seed must be None or a non-negative int"):
        grade({"a": correct}, seed=-1)
    with pytest.raises(ValueError, match="speedup_cap must be positive"):
        grade({"a": correct}, speedup_cap=0)
    with pytest.raises(TypeError, match="speed_points must be a finite number"):
        grade({"a": correct}, speed_points=math.nan)
    with pytest.raises(ValueError, match="timing takes shapes"):
        grade({"a": correct}, timing={"repeat": 3})
    with pytest.raises(ValueError, match="rep must be a positive int"):
        grade({"a": correct}, timing={"rep": 0})
    with pytest.raises(TypeError, match="measure_speed must be None, True or False"):
        grade({"a": correct}, measure_speed="yes")
    with pytest.raises(TypeError, match="the dict that grade"):
        leaderboard_markdown([])


@pytest.mark.skipif(HAS_GPU, reason="the refusal without a GPU")
def test_timing_refuses_without_a_gpu():
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        time_forward_kernel(correct)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        grade({"a": correct}, measure_speed=True)


def test_timing_checks_its_arguments_before_anything_runs():
    with pytest.raises(TypeError, match="forward must be callable"):
        time_forward_kernel("forward.py")
    with pytest.raises(ValueError, match=r"a \(T, D\) pair of positive ints"):
        time_forward_kernel(correct, shapes=[(2048,)])
    with pytest.raises(ValueError, match="at least one"):
        time_forward_kernel(correct, shapes=[])
    with pytest.raises(TypeError, match="a sequence of"):
        time_forward_kernel(correct, shapes=2048)
    with pytest.raises(ValueError, match="heads must be a positive int"):
        time_forward_kernel(correct, heads=0)
    with pytest.raises(ValueError, match="bandwidth must be positive"):
        time_forward_kernel(correct, bandwidth=0.0)


def _timed(T, D, ms, book_ms, floor_ms, agrees=True):
    return {"T": T, "D": D, "ms": ms, "book_ms": book_ms, "speedup": book_ms / ms, "floor_frac": floor_ms / ms,
            "book_floor_frac": floor_ms / book_ms, "max_rel_diff_vs_book": 0.01 if agrees else 0.5,
            "agrees_with_book": agrees}


def test_the_points_rule_on_given_timings():
    """The speed share of the points from timing rows (the rows are made up here: this tests the arithmetic)."""
    def scored(timings, **rule):
        row = {"message": "Correct", "speedup": None, "best_floor_frac": None, "points": 0.0}
        contest._score_speed(row, timings, rule.get("correct", 60), rule.get("speed", 40), rule.get("cap", 1.0))
        return row

    half = scored([_timed(2048, 64, 2.0, 1.0, 0.5), _timed(8192, 64, 2.0, 1.0, 0.5)])
    assert half["speedup"] == pytest.approx(0.5) and half["points"] == pytest.approx(80)
    assert half["best_floor_frac"] == pytest.approx(0.25)
    mixed = scored([_timed(2048, 64, 1.0, 2.0, 0.5), _timed(8192, 64, 2.0, 1.0, 0.5)])  # 2x and 0.5x: geomean 1
    assert mixed["speedup"] == pytest.approx(1.0) and mixed["points"] == pytest.approx(100)
    capped = scored([_timed(2048, 64, 1.0, 3.0, 0.5)], cap=1.5)
    assert capped["points"] == pytest.approx(100)
    failed = scored([_timed(2048, 64, 1.0, 1.0, 0.5), {"T": 8192, "D": 128, "error": "out of resources"}])
    assert failed["points"] == 60 and failed["speedup"] is None and "failed at T = 8192, D = 128" in failed["message"]
    stray = scored([_timed(2048, 64, 0.1, 1.0, 0.05, agrees=False)])
    assert stray["points"] == 60 and "differs from the book's kernel's by 0.5" in stray["message"]


# ------------------------------------------------------------------------------------------- the command


def _cli(*args, cwd=None):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-m", "lightning_edu.exercises.contest", *args], capture_output=True,
                          text=True, cwd=cwd or ROOT, env=env, timeout=300)


@pytest.mark.skipif(HAS_GPU, reason="the CPU-only command")
def test_the_command_writes_the_starter_and_grades_a_folder(tmp_path):
    starter = tmp_path / "submitted" / "zoe.py"
    starter.parent.mkdir()
    done = _cli("starter", str(starter))
    assert done.returncode == 0 and starter.read_text() == STARTER
    again = _cli("starter", str(starter))
    assert again.returncode == 2 and "never overwrites" in again.stderr
    _write(tmp_path / "submitted", "yann.py", TORCH_SOURCE.replace("gap >= 0,", "gap > 0,"))
    out, md = tmp_path / "report.json", tmp_path / "leaderboard.md"
    done = _cli("grade", str(tmp_path / "submitted"), "--out", str(out), "--markdown", str(md), "--seed", "4")
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert [(r["student"], r["rank"], r["points"]) for r in report["entries"]] == [("zoe", 1, 60), ("yann", 2, 0)]
    assert "the diagonal is left out" in report["entries"][1]["message"]
    assert done.stdout == md.read_text() + "\n"
    assert "python -m lightning_edu.exercises.contest grade" in report["environment"]["command"]
    missing = _cli("grade", str(tmp_path / "nobody"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr


# ------------------------------------------------------------------------------------------- on a GPU


def _book_forward(q, k, v, log2_decay):
    from lightning_edu.triton_kernels import kernel_config
    from lightning_edu.triton_kernels.la2_fast import la2_fast_forward

    return la2_fast_forward(q, k, v, log2_decay, None, **kernel_config(q.shape[-1], v.shape[-1], q.dtype))[0]


@gpu
@needs_gpu
def test_the_books_kernel_passes_the_check_on_a_gpu(capsys):
    # .check is the check without the integrity layer, which would refuse the book's own kernel
    check_forward_kernel.check(_book_forward, seed=0)
    for seed in (1, 2, 3):
        check_forward_kernel.check(_book_forward, seed=seed)
    assert capsys.readouterr().out.count("Correct:") == 4


@gpu
@needs_gpu
def test_the_starter_passes_and_is_timed_beside_the_book_on_a_gpu(tmp_path, capsys):
    forward = load_submission(_write(tmp_path, "starter.py", STARTER))
    check_forward_kernel(forward, seed=None)
    rows = time_forward_kernel(forward, shapes=[(2048, 64)], warmup=5, rep=20)
    assert len(rows) == 1 and "error" not in rows[0], rows
    row = rows[0]
    assert row["agrees_with_book"] and row["ms"] > 0 and row["book_ms"] > 0
    assert row["speedup"] == pytest.approx(row["book_ms"] / row["ms"]) and 0 < row["floor_frac"] < 1.5


@gpu
@needs_gpu
def test_a_submission_that_calls_the_book_is_refused_at_the_timed_shape_too():
    rows = time_forward_kernel(calls_the_book_kernel, shapes=[(2048, 64)], warmup=5, rep=20)
    assert "ms" not in rows[0] and "calls lightning_edu.triton_kernels.la2_fast.la2_fast_forward" in rows[0]["error"]


@gpu
@needs_gpu
def test_grade_times_on_a_gpu(tmp_path):
    root = tmp_path / "submitted"
    _write(root, "alice.py", TORCH_SOURCE)
    _write(root, "bob.py", STARTER)
    _write(root, "carol.py", TORCH_SOURCE.replace("gap >= 0,", "gap > 0,"))
    report = grade(find_submissions([root]), seed=3, timing={"shapes": [(2048, 64)], "warmup": 5, "rep": 20})
    assert report["speed_measured"] and report["max_points"] == 100 and report["copy_bandwidth_bytes_per_s"] > 0
    rows = {r["student"]: r for r in report["entries"]}
    assert rows["carol"]["rank"] == 3 and rows["carol"]["points"] == 0
    for name in ("alice", "bob"):
        assert rows[name]["correct"] and rows[name]["speedup"] > 0 and 60 < rows[name]["points"] <= 100
    text = leaderboard_markdown(report)
    assert "## Timings" in text and "TB/s" in text and re.search(r"\| \d+\.\d\dx \|", text)


@pytest.mark.skipif(HAS_GPU, reason="the sample is the CPU-only run (a GPU adds bfloat16 cases and timings)")
def test_the_sample_leaderboard_in_instructors_md_is_what_a_run_gives(tmp_path):
    root = tmp_path / "submitted"
    _write(root, "alice.py", TORCH_SOURCE)
    _write(root, "bob/submission.py", STARTER)
    _write(root, "carol.py", STARTER.replace("kv = kv * tl.exp2(log2_lam * b.to(tl.float32)) + ", "kv = kv + "))
    _write(root, "dave.py", TORCH_SOURCE.replace("gap >= 0,", "gap > 0,"))
    _write(root, "erin.py", "import lightning_edu\nimport torch\n\n\ndef forward(q, k, v, log2_decay):\n    return "
                            "lightning_edu.lightning_attention(q, k, v, torch.exp2(log2_decay), backend='torch')\n")
    report = grade(find_submissions([root]), seed=7, measure_speed=False)
    text = leaderboard_markdown(report)
    doc = (ROOT / "INSTRUCTORS.md").read_text()
    section = doc[doc.index("### A sample leaderboard (CPU only, no timings)"):]
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert len(table) == 7 and "\n".join(table) in section
    messages = {r["student"]: r["message"] for r in report["entries"]}
    for name in ("dave", "erin"):
        assert f"{name}: {messages[name]}\n" in section, messages[name]


@pytest.fixture
def gpu_parts_stubbed(monkeypatch):
    """The timing path with what needs a GPU replaced: float32 CPU inputs (the interpreter's bfloat16 is wrong), a
    fixed copy bandwidth, one wall-clock call in place of do_bench. The numbers mean nothing; the logic is real."""
    import time

    import triton.testing

    import lightning_edu.measure as measure
    import lightning_edu.triton_kernels as kernels

    def inputs(batch, heads, T, d, dtype, seed=0):
        g = torch.Generator().manual_seed(seed)
        return tuple(torch.randn(batch, heads, T, d, generator=g) * d**-0.5 for _ in range(4))

    def one_call(fn, warmup=25, rep=100, return_mode="median"):
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    log2_decay_tensor = kernels.log2_decay_tensor
    monkeypatch.setattr(contest, "_require_gpu", lambda who: None)
    monkeypatch.setattr(measure, "benchmark_inputs", inputs)
    monkeypatch.setattr(measure, "copy_bandwidth", lambda nbytes=0: 1e12)
    monkeypatch.setattr(triton.testing, "do_bench", one_call)
    monkeypatch.setattr(kernels, "log2_decay_tensor", lambda decay, device: log2_decay_tensor(decay, "cpu"))


@pytest.mark.skipif(HAS_GPU, reason="stubs the GPU parts; on a GPU the gpu tests run them for real")
def test_the_timing_logic_with_the_gpu_parts_stubbed(tmp_path, gpu_parts_stubbed):
    small = dict(shapes=[(48, 16)], heads=2, tokens=96)
    starter = load_submission(_write(tmp_path, "starter.py", STARTER))
    (row,) = time_forward_kernel(starter, **small)
    assert (row["T"], row["D"], row["batch"], row["heads"]) == (48, 16, 2, 2)
    assert row["agrees_with_book"] and row["max_rel_diff_vs_book"] < 1e-5
    assert row["speedup"] == pytest.approx(row["book_ms"] / row["ms"])
    assert row["floor_frac"] == pytest.approx(4 * 2 * 48 * 2 * 16 * 4 / 1e12 * 1e3 / row["ms"])  # fp32 here
    (stray,) = time_forward_kernel(no_decay, **small)
    assert not stray["agrees_with_book"] and stray["max_rel_diff_vs_book"] > 0.5
    (refused,) = time_forward_kernel(calls_the_book_kernel, **small)
    assert "ms" not in refused and "calls lightning_edu.triton_kernels.la2_fast.la2_fast_forward" in refused["error"]

    report = grade({"starter": starter, "torch": correct, "slip": no_decay}, seed=0, measure_speed=True, timing=small)
    assert report["speed_measured"] and report["max_points"] == 100 and report["copy_bandwidth_bytes_per_s"] == 1e12
    rows = {r["student"]: r for r in report["entries"]}
    for name in ("starter", "torch"):
        assert rows[name]["speedup"] > 0 and 60 < rows[name]["points"] <= 100 and len(rows[name]["timings"]) == 1
    assert rows["slip"]["rank"] == 3 and rows["slip"]["points"] == 0 and rows["slip"]["timings"] is None
    text = leaderboard_markdown(report)
    assert "## Timings" in text and "TB/s" in text and "not measured" not in text
    assert re.search(r"\| 1 \| \w+ \| yes \| \d+\.\d\dx \| \d\.\d\d \| \d+(\.\d+)? / 100 \|", text), text
