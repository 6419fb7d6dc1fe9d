"""The course pipeline grades what survives: a student's code that kills its process, loops for ever, cheats from a
thread, or a submission with a check cell deleted or edited costs only its own exercise, every other exercise is
graded, feedback is written, autograde exits 0, and the log names the deleted and the edited check cell (and no
other).

One assignment made of the exercises of chapters 09 and 10 (their statement, answer and check cells, as the
chapters have them), through the config `python -m lightning_edu.assignments course` writes: generate_assignment,
three submissions, autograde, generate_feedback (skipped without nbgrader; about two minutes on two cores):

* ``correct``: the source, every answer the model answer;
* ``mixed``: 10.1's step calls ``os._exit`` (the process dies), 10.3's packed_forward never returns, 9.2's check
  cell deleted, 9.1's check cell edited to print "checked";
* ``crash-top``: 10.2's answer cell ends the kernel at its top level (``os._exit`` after the def), 10.1's step asks
  the package from a thread.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import nbformat
import pytest

from lightning_edu.assignments import BEGIN_SOLUTION, CONFIG_TEMPLATE, END_SOLUTION, exercises, normalise
from lightning_edu.book import repo_root
from course_fixtures import finish, kernel_options, nbgrader_at

ROOT = repo_root()
ASSIGNMENT, NAME = "survival", "survival.ipynb"
CALL_LIMIT = 3  # seconds: LIGHTNING_EDU_CALL_TIME_LIMIT for this autograde

STEP_DIES = "def step(q, k, v, state, lam):\n    import os\n    os._exit(3)\n"
PACKED_LOOPS = "def packed_forward(q, k, v, lam, cu_seqlens):\n    while True:\n        pass\n"
STEP_THREAD = (
    "import threading\n\ndef step(q, k, v, state, lam):\n    out = {}\n"
    "    def ask():\n        out['r'] = le.lightning_attention_step(q[None, None], k[None, None], v[None, None], "
    "state[None, None], lam, backend='numpy')\n"
    "    t = threading.Thread(target=ask)\n    t.start()\n    t.join()\n"
    "    new_state = lam * state + np.outer(k, v)\n    return q @ new_state, new_state\n"
)


def _read(path):
    return nbformat.read(str(path), as_version=4)


def _source_notebook():
    """The exercises of chapters 09 and 10, after one cell of imports, normalised as a chapter is."""
    cells = [nbformat.v4.new_code_cell("import numpy as np\nimport lightning_edu as le\nfrom lightning_edu import numpy_la3"),
             nbformat.v4.new_markdown_cell("## Exercises")]
    for chapter in ("09_la3_backward.ipynb", "10_inference.ipynb"):
        nb = _read(ROOT / "notebooks" / chapter)
        for ex in exercises(nb):
            for i in [ex.statement, *ex.answers, ex.check]:
                cell = copy.deepcopy(nb.cells[i])
                if cell.cell_type == "code":
                    cell.outputs, cell.execution_count = [], None
                cells.append(cell)
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    return normalise(nb)


def _grade_id(cell) -> str:
    return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id", "")


def _answer(source_cell) -> str:
    return "\n".join(line for line in source_cell.source.splitlines()
                     if BEGIN_SOLUTION not in line and END_SOLUTION not in line)


def _submission(release, source, answers: dict[str, str], *, delete=(), edit=None):
    """The release with every answer written (the model answer, or ``answers[grade_id]``), the check cells named
    in ``delete`` taken out and those in ``edit`` given a new source."""
    by_id = {_grade_id(c): c for c in source.cells if _grade_id(c)}
    nb = copy.deepcopy(release)
    kept = []
    for cell in nb.cells:
        grade_id = _grade_id(cell)
        if grade_id in delete:
            continue
        if grade_id.endswith("-answer"):
            cell.source = answers.get(grade_id, _answer(by_id[grade_id]))
        if grade_id in (edit or {}):
            cell.source = edit[grade_id]
        kept.append(cell)
    nb.cells = kept
    return nb


@pytest.fixture(scope="module")
def survival(tmp_path_factory):
    pytest.importorskip("nbgrader", reason="nbgrader is not installed: the course pipeline needs it "
                                           "(pip install -e '.[course]')")
    course = tmp_path_factory.mktemp("survival")
    (course / "nbgrader_config.py").write_text(CONFIG_TEMPLATE)
    (course / "source" / ASSIGNMENT).mkdir(parents=True)
    nbformat.write(_source_notebook(), str(course / "source" / ASSIGNMENT / NAME))
    db = f"--db=sqlite:///{course / 'gradebook.db'}"
    finish(nbgrader_at(course, "generate_assignment", ASSIGNMENT, "--force", db, lowest_priority=True),
           "generate_assignment")
    release, source = _read(course / "release" / ASSIGNMENT / NAME), _read(course / "source" / ASSIGNMENT / NAME)
    students = {
        "correct": source,
        "mixed": _submission(release, source, {"ex-10-1-answer": STEP_DIES, "ex-10-3-answer": PACKED_LOOPS},
                             delete={"ex-9-2-check"}, edit={"ex-9-1-check": 'print("checked")'}),
        "crash-top": _submission(release, source, {
            "ex-10-1-answer": STEP_THREAD,
            "ex-10-2-answer": _answer(next(c for c in source.cells if _grade_id(c) == "ex-10-2-answer"))
            + "\n\nimport os\nos._exit(1)\n"}),
    }
    for student, nb in students.items():
        target = course / "submitted" / student / ASSIGNMENT / NAME
        target.parent.mkdir(parents=True)
        nbformat.write(nb, str(target))
    log = finish(nbgrader_at(course, "autograde", ASSIGNMENT, db, *kernel_options(course, ASSIGNMENT, 300),
                             lowest_priority=True, env={"LIGHTNING_EDU_CALL_TIME_LIMIT": str(CALL_LIMIT)}),
                 "autograde", timeout=900)
    finish(nbgrader_at(course, "generate_feedback", ASSIGNMENT, db, lowest_priority=True), "generate_feedback")
    from nbgrader.api import Gradebook

    scores, feedback = {}, {}
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gradebook:
        for student in students:
            notebook = gradebook.find_submission(ASSIGNMENT, student).notebooks[0]
            scores[student] = {g.name: (g.score, g.max_score, g.needs_manual_grade) for g in notebook.grades}
    for student in students:
        path = course / "feedback" / student / ASSIGNMENT / NAME.replace(".ipynb", ".html")
        feedback[student] = path.read_text() if path.exists() else None
    return {"scores": scores, "feedback": feedback, "log": log}


CHECKS = ["ex-9-1-check", "ex-9-2-check", "ex-10-1-check", "ex-10-2-check", "ex-10-3-check"]
EXPECTED = {  # the points each check cell must get: 1 for the right answers, 0 for the broken ones
    "correct": dict.fromkeys(CHECKS, 1),
    "mixed": {"ex-9-1-check": 1, "ex-9-2-check": 1, "ex-10-1-check": 0, "ex-10-2-check": 1, "ex-10-3-check": 0},
    "crash-top": {"ex-9-1-check": 1, "ex-9-2-check": 1, "ex-10-1-check": 0, "ex-10-2-check": 0, "ex-10-3-check": 1},
}


@pytest.mark.parametrize("student", sorted(EXPECTED))
def test_each_exercise_gets_its_own_points(survival, student):
    scores = survival["scores"][student]
    got = {cell: scores[cell][0] for cell in CHECKS}
    assert got == EXPECTED[student], scores
    assert not any(manual for _, _, manual in scores.values()), f"left for manual grading: {scores}"


@pytest.mark.parametrize("student", sorted(EXPECTED))
def test_every_submission_gets_its_feedback(survival, student):
    assert survival["feedback"][student], f"no feedback file for {student}"


def test_a_process_that_dies_is_one_failed_exercise_with_a_message(survival):
    html = survival["feedback"]["mixed"]
    assert "your function step ended the process running the check, with exit code 3" in html
    assert "the notebook and the other exercises go on" in html


def test_a_function_that_never_returns_is_stopped_and_named(survival):
    html = survival["feedback"]["mixed"]
    assert f"your function packed_forward did not return within {CALL_LIMIT} s" in html


def test_a_call_of_the_package_from_a_thread_is_refused(survival):
    html = survival["feedback"]["crash-top"]
    assert "your function step calls lightning_edu.lightning_attention_step from a thread it started" in html


def test_a_kernel_that_dies_at_the_top_of_a_cell_is_restarted_and_grading_goes_on(survival):
    html = survival["feedback"]["crash-top"]
    assert "KernelDied" in html and "the kernel died while this cell ran" in html
    assert re.search(r"crash-top/survival/survival: the kernel died in cell \d+", survival["log"]), survival["log"][-3000:]


def test_the_log_names_the_deleted_and_the_edited_check_cell_and_no_other(survival):
    log = survival["log"]
    assert ("mixed/survival/survival: the check cell of exercise 9.2 (ex-9-2-check) is missing from the submission"
            in log), log[-3000:]
    assert "mixed/survival/survival: the check cell of exercise 9.1 (ex-9-1-check) was edited in the submission" in log
    edited = re.findall(r"(\S+): the check cell of exercise (\S+) \(\S+\) was edited", log)
    assert edited == [("mixed/survival/survival", "9.1")], edited
    assert "Attribute 'checksum'" not in log  # nbgrader's warning on every check cell (its hidden tests) is gone


def test_the_deleted_check_cell_is_put_back_and_graded(survival):
    html = survival["feedback"]["mixed"]
    assert "was missing from the submission. It was added back by nbgrader" in html
    assert html.count("Correct: the dQ phase matches numpy_la3.intra_dq") == 2  # its visible and hidden checks


# ------------------------------------------------------------------------------------------- the pieces, directly


def test_every_preprocessor_the_config_names_can_be_imported():
    pytest.importorskip("nbgrader")
    from traitlets.utils.importstring import import_item

    names = re.findall(r'"((?:nbgrader|nbconvert|lightning_edu)\.[\w.]+)"', CONFIG_TEMPLATE)
    assert "lightning_edu.assignments.OverwriteCheckCells" in names and "lightning_edu.assignments.ExecuteSurviving" in names
    for name in names:
        assert isinstance(import_item(name), type), name


def test_a_check_cell_as_released_is_the_source_without_its_hidden_tests():
    from lightning_edu.assignments import BEGIN_HIDDEN, END_HIDDEN, _same_code, without_hidden_tests

    source = f"from m import check_x\n\ncheck_x(f)\n{BEGIN_HIDDEN}\ncheck_x(f, seed=None)\n{END_HIDDEN}"
    assert without_hidden_tests(source) == "from m import check_x\n\ncheck_x(f)"
    assert _same_code(without_hidden_tests(source), "from m import check_x  \n\ncheck_x(f)\n\n")
    assert not _same_code(without_hidden_tests(source), "from m import check_x\n\nprint('checked')")


def test_a_kernel_that_dies_is_restarted_and_a_cell_that_loops_is_interrupted_with_a_message(tmp_path):
    pytest.importorskip("nbgrader")
    from lightning_edu.assignments import ExecuteSurviving

    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("x = 41"),
        nbformat.v4.new_code_cell("import os\nos._exit(1)"),
        nbformat.v4.new_code_cell("print(x + 1)"),  # the cells before the death ran again
        nbformat.v4.new_code_cell("while True:\n    pass"),
        nbformat.v4.new_code_cell("print('after', x)"),
    ])
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    sockets = tmp_path / "sockets"
    sockets.mkdir()
    executor = ExecuteSurviving(timeout=8, kernel_manager_class=_ipc_kernel_manager(sockets))
    out, _ = executor.preprocess(nb, {"metadata": {"path": str(tmp_path)}})
    died, after_death, loop, last = (out.cells[i].outputs for i in (1, 2, 3, 4))
    assert [o.ename for o in died] == ["KernelDied"] and "the kernel died while this cell ran" in died[0].evalue
    assert after_death[0].text == "42\n"
    assert loop[-1].ename == "CellTimeoutError" and "did not finish within 8 s and was interrupted" in loop[-1].evalue
    assert last[0].text == "after 41\n"


def _ipc_kernel_manager(folder: Path):
    """An AsyncKernelManager whose kernels talk over Unix sockets in ``folder`` (kernel_options says why)."""
    from jupyter_client.manager import AsyncKernelManager

    class IPCKernelManager(AsyncKernelManager):
        def __init__(self, **kwargs):
            super().__init__(transport="ipc", ip=str(folder / "k"), **kwargs)

    return IPCKernelManager
