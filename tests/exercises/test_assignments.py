"""Chapters as nbgrader assignments (lightning_edu.assignments), and a whole course run through nbgrader.

* Every chapter of book.toml is normalised: its exercise cells carry nbgrader's metadata and hidden tests (a new
  chapter fails here until `python -m lightning_edu.assignments normalise` has been run on it).
* normalise splits the older layout, is idempotent, refuses what it cannot read; `course` never overwrites.
* The pipeline (skipped without nbgrader): generate_assignment on two chapters; the students' copy holds no
  solution and no cell showing a function an exercise asks for; autograde gives a correct submission full
  points, the untouched release 0 with "not implemented", and each planted mistake costs exactly its exercise,
  with the check's message in the feedback.
"""

from __future__ import annotations

import re
import subprocess
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest

from lightning_edu import assignments
from lightning_edu.assignments import (
    BEGIN_HIDDEN,
    BEGIN_SOLUTION,
    CONFIG_TEMPLATE,
    END_HIDDEN,
    END_SOLUTION,
    NotNormalisable,
    exercises,
    layout_course,
    normalise,
    points_table,
    problems,
    student_source,
)
from lightning_edu.book import chapters, repo_root
from course_fixtures import chapter_four, finish, kernel_options, nbgrader_at

ROOT = repo_root()
CHAPTERS = chapters(ROOT)
IDS = [c.file for c in CHAPTERS]


def read(path):
    return nbformat.read(str(path), as_version=4)


# ------------------------------------------------------------------------------------------- the chapters


@pytest.mark.parametrize("chapter", CHAPTERS, ids=IDS)
def test_every_chapter_is_normalised(chapter):
    found = problems(read(chapter.path))
    assert not found, (
        f"{chapter.file} is not in nbgrader's layout: {found[:3]}. Run `python -m lightning_edu.assignments normalise "
        f"notebooks/{chapter.file}`, then re-execute the notebook"
    )


@pytest.mark.parametrize("chapter", CHAPTERS, ids=IDS)
def test_every_exercise_has_its_three_cells_and_a_declared_check(chapter):
    nb = read(chapter.path)
    found = exercises(nb)
    assert found, f"{chapter.file} has no exercises"
    for ex in found:
        assert ex.number.split(".")[0] == str(chapter.number)
        assert nb.cells[ex.statement].metadata["nbgrader"]["locked"] is True
        for i in ex.answers:
            meta = nb.cells[i].metadata["nbgrader"]
            assert meta["solution"] and not meta["grade"] and not meta["locked"]
        meta = nb.cells[ex.check].metadata["nbgrader"]
        assert meta["grade"] and meta["locked"] and meta["points"] > 0 and meta["grade_id"] == f"{ex.slug}-check"
        source = nb.cells[ex.check].source
        hidden = source.split(BEGIN_HIDDEN)[1] if BEGIN_HIDDEN in source else ""
        # fresh random inputs when graded; a check that draws none (10.2: the answer is an input) runs again
        assert "seed=None" in hidden or assignments.SAME_CHECK_COMMENT in hidden, f"{ex.number}: no hidden test"
        for check in assignments._checks_of(ex, assignments._imports(nb)):
            assert getattr(check, "exercise", None) == ex.number, (
                f"{check.__name__} is declared for exercise {getattr(check, 'exercise', None)}, used in {ex.number}"
            )
    ids = [c.metadata["nbgrader"]["grade_id"] for c in nb.cells if "nbgrader" in c.metadata]
    assert len(ids) == len(set(ids)), "grade ids repeat"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=IDS)
def test_the_students_copy_shows_no_source_an_exercise_asks_for(chapter):
    nb = read(chapter.path)
    modules = assignments._imports(nb)
    reveals = {name.rsplit(".", 1)[-1] for ex in exercises(nb) for check in assignments._checks_of(ex, modules)
               for name in getattr(check, "reveals", ())}
    copy = student_source(nb)
    for cell in copy.cells:
        for target in re.findall(r"show_source\(\s*([\w.]+)", cell.source):
            assert target.removesuffix(".fn").split(".")[-1] not in reveals, f"{chapter.file} still shows {target}"
    assert [c.source for c in read(chapter.path).cells] == [c.source for c in nb.cells]  # the book is untouched


def test_the_hidden_sources_are_the_ones_exercises_ask_for():
    copy = student_source(read(ROOT / "notebooks" / "04_intra_inter_blocks.ipynb"))
    notes = [c.source for c in copy.cells if "left out of this assignment" in c.source]
    assert any("The source of algorithm1 is left out of this assignment: exercises 4.1, 4.2, 4.3 ask you" in n for n in notes)
    assert any("block_factors" in n for n in notes)
    # a cell that only prints the note shows it before it runs (the website never runs it)
    note = next(c for c in copy.cells if "The source of algorithm1" in c.source)
    assert [o.get("text") for o in note.outputs] == [
        "The source of algorithm1 is left out of this assignment: exercises 4.1, 4.2, 4.3 ask you to write it.\n"]


def test_a_reveal_named_with_its_module_is_hidden_too():
    # 13.1 declares reveals=("lightning_edu.models.tgs.fit_tgs",); the chapter shows show_source(fit_tgs)
    copy = student_source(read(ROOT / "notebooks" / "13_models.ipynb"))
    shown = [t for c in copy.cells for t in re.findall(r"show_source\(\s*([\w.]+)", c.source)]
    assert "fit_tgs" not in shown
    assert any("The source of fit_tgs is left out of this assignment: exercise 13.1 asks you" in c.source for c in copy.cells)


def test_the_config_file_is_the_template():
    assert (ROOT / "nbgrader_config.py").read_text() == CONFIG_TEMPLATE, (
        "nbgrader_config.py differs from lightning_edu.assignments.CONFIG_TEMPLATE: "
        "`python -m lightning_edu.assignments config > nbgrader_config.py`"
    )


def test_instructors_md_lists_the_points_of_every_chapter():
    table = points_table([c.path for c in CHAPTERS])
    text = (ROOT / "INSTRUCTORS.md").read_text()
    assert table in text, (
        "INSTRUCTORS.md's points table is out of date: paste the output of `python -m lightning_edu.assignments points`"
    )


# ------------------------------------------------------------------------------------------- normalise


def test_normalise_splits_the_check_from_the_answer_and_is_idempotent():
    nb = chapter_four(summary=True)
    once = normalise(nb, points={"4.2": 3})
    assert len(once.cells) == 8 and len(nb.cells) == 7  # the input is left alone
    answer, check = once.cells[3], once.cells[4]
    assert "check_intra_block" not in answer.source and answer.source.startswith("def f(")
    assert check.source == (
        "from lightning_edu.exercises.ch04 import check_intra_block\n\ncheck_intra_block(f)\n"
        f"{BEGIN_HIDDEN}\ncheck_intra_block(f, seed=None){assignments.HIDDEN_COMMENT}\n{END_HIDDEN}"
    )
    assert check.metadata.nbgrader == {"grade": True, "grade_id": "ex-4-1-check", "locked": True, "points": 1,
                                       "schema_version": 3, "solution": False, "task": False}
    assert answer.metadata.nbgrader["solution"] and once.cells[2].metadata.nbgrader["locked"]
    assert once.cells[7].metadata.nbgrader["points"] == 3
    twice = normalise(once)
    assert [(c.source, c.metadata.get("nbgrader")) for c in twice.cells] == [
        (c.source, c.metadata.get("nbgrader")) for c in once.cells]
    assert problems(once) == [] and problems(nb)


@pytest.mark.parametrize("edit, words", [
    (lambda nb: nb.cells[1].__setitem__("source", "## Summary"), "no markdown cell with a '## Exercises' heading"),
    (lambda nb: nb.cells[0].__setitem__("source", "Write between BEGIN SOLUTION and END SOLUTION\n## x"), "reword"),
    (lambda nb: nb.cells[6].__setitem__("source", "print(1)"), "calls no check_...() function"),
    (lambda nb: nb.cells[6].__setitem__("source", "check_state_update(g)\nprint(g)"), "may hold only imports"),
    (lambda nb: nb.cells.pop(2), "exercise numbers repeat"),
], ids=["no-heading", "markers-in-markdown", "no-check", "extra-code-in-check", "one-statement-missing"])
def test_normalise_refuses_what_it_cannot_read(edit, words):
    nb = chapter_four(summary=True)
    if words == "exercise numbers repeat":
        nb.cells[4].source = "### Exercise 4.1: again"
        words = "exercise numbers repeat"
    else:
        edit(nb)
    with pytest.raises(NotNormalisable, match=re.escape(words)):
        normalise(nb)


def test_points_for_an_unknown_exercise_are_refused():
    with pytest.raises(NotNormalisable, match=r"\['4.9'\]"):
        normalise(chapter_four(summary=True), points={"4.9": 2})


def test_the_command_line_normalises_in_place_and_checks(tmp_path, capsys):
    path = tmp_path / "04_x.ipynb"
    nbformat.write(chapter_four(summary=True), str(path))
    assert assignments.main(["normalise", "--check", str(path)]) == 1
    assert assignments.main(["normalise", str(path), "--points", "4.1=2"]) == 0
    assert assignments.main(["normalise", "--check", str(path)]) == 0
    assert read(path).cells[4].metadata.nbgrader["points"] == 2
    assert path.read_text().endswith("}\n")


# ------------------------------------------------------------------------------------------- course layout


def test_course_layout_never_overwrites(tmp_path):
    course = tmp_path / "course"
    first = layout_course(course, ["03", "4"])
    names = sorted(p.relative_to(course).as_posix() for p in first["written"])
    assert names == ["nbgrader_config.py", "source/ch03/03_decay.ipynb", "source/ch04/04_intra_inter_blocks.ipynb"]
    work = course / "source" / "ch04" / "04_intra_inter_blocks.ipynb"
    work.write_text("a student's work, or an instructor's edit")
    (course / "nbgrader_config.py").write_text("c = get_config()\n")
    again = layout_course(course, ["03", "04"])
    assert again["written"] == [] and len(again["kept"]) == 3
    assert work.read_text() == "a student's work, or an instructor's edit"
    assert (course / "nbgrader_config.py").read_text() == "c = get_config()\n"


def test_course_refuses_an_unknown_chapter(tmp_path):
    with pytest.raises(ValueError, match="no chapter '99'"):
        layout_course(tmp_path, ["99"])


# ------------------------------------------------------------------------------------------- the pipeline

# One wrong answer per exercise of chapters 03 and 04, planted into a student's copy, with a fragment of the
# message its check must give. Two submissions hold them, so that each exercise is wrong in one and right in the
# other: slips-a (3.1, 3.3, 4.1, 4.2) and slips-b (3.2, 4.3). 4.3's answer calls 4.1's and 4.2's: its check
# uses the book's versions of those, so slips-a keeps 4.3's point.
SLIPS = {
    "3.1": ("a", "def my_decay_mask(n, decay):\n    t = np.arange(n)\n    gap = t[None, :] - t[:, None]\n"
                 "    return np.where(gap >= 0, float(decay) ** np.maximum(gap, 0), 0.0)\n",
            "is the transpose of M"),
    "3.2": ("b", "def decayed_recurrence(q, k, v, decay):\n    lam = np.asarray(decay)[None, :, None, None]\n"
                 "    kv = np.zeros(q.shape[:2] + (q.shape[-1], v.shape[-1]))\n    o = np.empty(q.shape[:-1] + (v.shape[-1],))\n"
                 "    for t in range(q.shape[2]):\n        kv = lam**2 * kv + k[:, :, t, :, None] * v[:, :, t, None, :]\n"
                 "        o[:, :, t] = np.einsum('bhk,bhkv->bhv', q[:, :, t], kv)\n    return o\n",
            "lambda^2 per step"),
    "3.3": ("a", "import math\n\ndef tokens_holding(decay, fraction):\n    if decay == 1.0:\n        return math.inf\n"
                 "    return math.ceil(math.log(1 - fraction) / math.log(decay))\n",
            "wrong side of a whole number"),
    "4.1": ("a", "def intra_block(q_i, k_i, v_i, decay):\n    return (q_i @ k_i.T) @ v_i\n", "left out the mask M"),
    "4.2": ("a", "def update_state(kv, k_i, v_i, decay):\n    b = len(k_i)\n"
                 "    return kv + (decay ** (b - 1 - np.arange(b))[:, None] * k_i).T @ v_i\n",
            "forgot to decay the old state"),
    "4.3": ("b", "def blockwise_attention(q, k, v, decay, block_size):\n    out = np.empty((len(q), v.shape[1]))\n"
                 "    kv = np.zeros((q.shape[1], v.shape[1]))\n    for start in range(0, len(q), block_size):\n"
                 "        rows = slice(start, min(start + block_size, len(q)))\n        r = np.arange(rows.stop - rows.start)[:, None]\n"
                 "        out[rows] = intra_block(q[rows], k[rows], v[rows], decay) + (decay ** r * q[rows]) @ kv\n"
                 "        kv = update_state(kv, k[rows], v[rows], decay)\n    return out\n",
            "one power short"),
}
PIPELINE_CHAPTERS = {"ch03": "03_decay.ipynb", "ch04": "04_intra_inter_blocks.ipynb"}
STUDENTS = ("correct", "blank", "slips-a", "slips-b")


def _nbgrader_at(course: Path, *args: str, lowest_priority: bool = False) -> subprocess.Popen:
    return nbgrader_at(course, *args, lowest_priority=lowest_priority)


_finish = finish
_kernel_options = kernel_options


def _answered(release_nb, source_nb, slips: dict[str, str]):
    """The release with every answer cell filled in, as a student would: the model answer (its code between the
    markers, markers dropped), or the planted slip for the exercises in ``slips``."""
    nb = nbformat.from_dict(release_nb)
    by_id = {c.metadata["nbgrader"]["grade_id"]: c for c in source_nb.cells if "nbgrader" in c.metadata}
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader", {})
        if not meta.get("solution"):
            continue
        number = meta["grade_id"].removeprefix("ex-").removesuffix("-answer").replace("-", ".")
        if number in slips:
            cell.source = slips[number]
        else:
            cell.source = "\n".join(line for line in by_id[meta["grade_id"]].source.splitlines()
                                    if BEGIN_SOLUTION not in line and END_SOLUTION not in line)
    return nb


def _grade_one_assignment(course: Path, assignment: str, name: str, lowest_priority: bool = False) -> tuple:
    """One assignment from release to feedback, the commands an instructor runs for it: generate_assignment, four
    submissions written, autograde, generate_feedback, all with the assignment's own gradebook. Returns its release
    and source notebooks."""
    db = f"--db=sqlite:///{course / f'gradebook-{assignment}.db'}"

    def _nbgrader(*args):
        return _nbgrader_at(course, *args, lowest_priority=lowest_priority)

    _finish(_nbgrader("generate_assignment", assignment, "--force", db), f"generate_assignment {assignment}")
    release, source = read(course / "release" / assignment / name), read(course / "source" / assignment / name)
    for student in STUDENTS:
        if student == "correct":
            nb = source
        elif student == "blank":
            nb = release
        else:
            group = student[-1]
            nb = _answered(release, source, {n: code for n, (g, code, _) in SLIPS.items() if g == group})
        target = course / "submitted" / student / assignment / name
        target.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, str(target))
    _finish(_nbgrader("autograde", assignment, db, *_kernel_options(course, assignment)), f"autograde {assignment}")
    _finish(_nbgrader("generate_feedback", assignment, db), f"generate_feedback {assignment}")
    return release, source


def run_pipeline(course: Path, lowest_priority: bool = False) -> dict:
    """Lay out a course of chapters 03 and 04 in ``course``, release them, autograde four students and write
    their feedback. Returns the releases, scores {(assignment, student): {grade_id: score}} and feedback HTML.
    ``lowest_priority``: every nbgrader command (and its kernels) at nice 19, for a run beside other tests."""
    layout_course(course, ["03", "04"])
    # Each assignment has a gradebook and a kernel socket folder of its own, and writes only under its own folders
    # (release/chNN, submitted/*/chNN, ...): the two assignments share nothing, so they go through the pipeline side
    # by side, one thread each (the machine has two cores; one chain of nbgrader commands keeps about one busy).
    # Each thread runs the same commands, in the same order, as an instructor grading that assignment alone.
    with ThreadPoolExecutor(max_workers=len(PIPELINE_CHAPTERS)) as pool:
        running = {assignment: pool.submit(_grade_one_assignment, course, assignment, name, lowest_priority)
                   for assignment, name in PIPELINE_CHAPTERS.items()}
        done = {assignment: future.result() for assignment, future in running.items()}  # a failure re-raises here
    releases = {assignment: release for assignment, (release, _) in done.items()}
    sources = {assignment: source for assignment, (_, source) in done.items()}
    scores, feedback = {}, {}
    for assignment, name in PIPELINE_CHAPTERS.items():
        from nbgrader.api import Gradebook

        with Gradebook(f"sqlite:///{course / f'gradebook-{assignment}.db'}") as gradebook:
            for student in STUDENTS:
                notebook = gradebook.find_submission(assignment, student).notebooks[0]
                scores[(assignment, student)] = {g.name: (g.score, g.max_score) for g in notebook.grades}
        for student in STUDENTS:
            feedback[(assignment, student)] = (course / "feedback" / student / assignment / name.replace(
                ".ipynb", ".html")).read_text()
    return {"releases": releases, "sources": sources, "scores": scores, "feedback": feedback}


_ALONGSIDE: list[Future] = []  # the pipeline started beside the other tests (conftest.py), once per session


def start_pipeline_alongside(items, course: Path) -> None:
    """When the selected tests in ``items`` use the pipeline and nbgrader is installed, start :func:`run_pipeline`
    in ``course`` on a thread of its own, its nbgrader commands at the lowest priority, so that it runs beside the
    tests before the ones that read it (conftest.py puts those last). The thread only waits on nbgrader's
    processes, which do the work: it holds no core of this process. Once per session."""
    if _ALONGSIDE or not any("pipeline" in getattr(item, "fixturenames", ()) for item in items):
        return
    try:
        import nbgrader  # noqa: F401
    except ImportError:
        return
    future: Future = Future()

    def run():
        try:
            future.set_result(run_pipeline(course, lowest_priority=True))
        except BaseException as exc:  # noqa: BLE001 - pytest.fail's Failed too: the fixture re-raises it
            future.set_exception(exc)

    _ALONGSIDE.append(future)
    # a daemon: a session that stops early does not wait for it
    threading.Thread(target=run, name="course pipeline", daemon=True).start()


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    pytest.importorskip("nbgrader", reason="nbgrader is not installed: the course pipeline needs it "
                                           "(pip install -e '.[course]')")
    if _ALONGSIDE:
        return _ALONGSIDE[0].result()
    return run_pipeline(tmp_path_factory.mktemp("course"))


def _lines(nb, *, in_solutions: bool) -> set[str]:
    """The stripped lines between the solution markers (those of 20 characters or more), or those outside them."""
    lines, inside = set(), False
    for cell in nb.cells:
        for line in cell.source.splitlines():
            if BEGIN_SOLUTION in line:
                inside = True
            elif END_SOLUTION in line:
                inside = False
            elif inside == in_solutions and (not in_solutions or len(line.strip()) >= 20):
                lines.add(line.strip())
    return lines


def _solution_lines(nb) -> set[str]:
    return _lines(nb, in_solutions=True)


def _lines_outside_solutions(nb) -> set[str]:
    return _lines(nb, in_solutions=False)


@pytest.mark.parametrize("assignment", PIPELINE_CHAPTERS)
def test_the_release_holds_no_solution_and_no_revealing_source(pipeline, assignment):
    release, source = pipeline["releases"][assignment], pipeline["sources"][assignment]
    text = "\n".join(c.source for c in release.cells)
    for marker in (BEGIN_SOLUTION, END_SOLUTION, BEGIN_HIDDEN, END_HIDDEN, "seed=None"):
        assert marker not in text
    released = {line.strip() for line in text.splitlines()}
    leaked = (_solution_lines(source) & released) - _lines_outside_solutions(source)
    assert not leaked, f"solution code in the release: {sorted(leaked)[:3]}"
    assert all(not c.get("outputs") for c in release.cells if c.cell_type == "code"), "outputs left in the release"
    assert text.count("raise NotImplementedError()") == len(exercises(source))
    modules = assignments._imports(source)
    for ex in exercises(source):
        for check in assignments._checks_of(ex, modules):
            for name in check.reveals:
                assert not re.search(rf"show_source\([\w.]*\b{name}\b", text), f"the release shows {name}"


@pytest.mark.parametrize("assignment", PIPELINE_CHAPTERS)
def test_a_correct_submission_gets_full_points(pipeline, assignment):
    scores = pipeline["scores"][(assignment, "correct")]
    assert len(scores) == 3 and all(score == top for score, top in scores.values()), scores


@pytest.mark.parametrize("assignment", PIPELINE_CHAPTERS)
def test_the_untouched_release_gets_nothing_and_says_not_implemented(pipeline, assignment):
    scores = pipeline["scores"][(assignment, "blank")]
    assert len(scores) == 3 and all(score == 0 for score, _ in scores.values()), scores
    html = pipeline["feedback"][(assignment, "blank")]
    assert html.count("not implemented yet: it raised NotImplementedError") >= 3


@pytest.mark.parametrize("number", sorted(SLIPS))
def test_a_planted_mistake_costs_exactly_its_exercise(pipeline, number):
    group, _, words = SLIPS[number]
    assignment = f"ch{int(number.split('.')[0]):02d}"
    cell = f"ex-{number.replace('.', '-')}-check"
    wrong = pipeline["scores"][(assignment, f"slips-{group}")]
    right = pipeline["scores"][(assignment, f"slips-{'b' if group == 'a' else 'a'}")]
    assert wrong[cell][0] == 0, wrong
    assert right[cell][0] == right[cell][1], f"{number} lost points in the submission where it is right: {right}"
    assert words in pipeline["feedback"][(assignment, f"slips-{group}")]
