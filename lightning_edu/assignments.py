"""The book's chapters as nbgrader assignments, and a course laid out from them.

Every chapter ends with ``## Exercises``: for each exercise a markdown statement ``### Exercise N.k: ...``, a code
cell with the model answer between ``### BEGIN SOLUTION`` and ``### END SOLUTION``, and a code cell that calls
its check from :mod:`lightning_edu.exercises`. :func:`normalise` gives those cells nbgrader's metadata (the
statement locked, the answer a solution cell, the check a locked grade cell worth its points) and a hidden test
(the same check on fresh random inputs, ``seed=None``; for a check that draws none, whose answer is an input the
reader built, the same call again) between ``### BEGIN HIDDEN TESTS`` and ``### END HIDDEN TESTS``; a check
written at the end of the answer cell is split into its own cell. It is idempotent, and it is how a new chapter
becomes an assignment.

Commands (``python -m lightning_edu.assignments ...``)::

    normalise notebooks/*.ipynb [--points 4.3=2 ...] [--check]   make chapters nbgrader-native (or only report)
    course DIR --chapters 04 05 [--points 4.3=2 ...]              lay out DIR/source/chNN/NN_x.ipynb for a course
    points [notebooks/*.ipynb]                                    the points per exercise, a markdown table
    config                                                        print the course's nbgrader_config.py

``course`` never overwrites a file that exists in DIR (students' work included); in the students' copy it
leaves out the cells that display the source of a package function an exercise asks the reader to write
(:func:`student_source`). A command refused (points that are not a number >= 0 or name an exercise none of the
chapters given has, a chapter that is not in the book, a missing or unreadable notebook, a course folder that is a
file, a file system that refuses the writes) prints one line naming the problem and exits with status 2, having
changed nothing: every notebook is read and normalised before the first write, and a write that fails takes back
the others. INSTRUCTORS.md walks through a whole course.

The course's ``nbgrader_config.py`` (:data:`CONFIG_TEMPLATE`) has ``nbgrader autograde`` grade what survives, with
two of nbgrader's preprocessors replaced by those here (made on first use, nbgrader being needed only for a
course): :class:`OverwriteCheckCells` puts back a check cell a student deleted, and the log names the check cells
deleted or edited (not every check cell, as nbgrader's own warning on the hidden tests does);
:class:`ExecuteSurviving` restarts a kernel that dies in a cell, runs the cells before it again and goes on, so
that the exercises after it are graded and the feedback written.
"""

from __future__ import annotations

import argparse
import ast
import copy
import importlib
import inspect
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

__all__ = [
    "NotNormalisable", "Exercise", "exercises", "normalise", "problems", "points_table", "student_source",
    "layout_course", "CONFIG_TEMPLATE", "without_hidden_tests",
]

BEGIN_SOLUTION, END_SOLUTION = "### BEGIN SOLUTION", "### END SOLUTION"
BEGIN_HIDDEN, END_HIDDEN = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"
HIDDEN_COMMENT = "  # fresh random inputs each run, their seed printed"
# nbgrader finds its markers anywhere in a line (ClearSolutions, ClearHiddenTests): these may appear only in
# the cells that carry them.
_MARKER_WORDS = ("BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN TESTS", "END HIDDEN TESTS")
_EXERCISES = re.compile(r"^## Exercises\s*$", re.M)
_STATEMENT = re.compile(r"^### Exercise (\d+)\.(\d+)\s*:", re.M)
_CHECK_CALL = re.compile(r"^(check_\w+)\s*\(")
_SCHEMA = 3
DEFAULT_POINTS = 1


class NotNormalisable(ValueError):
    """A chapter whose exercise cells do not follow the layout :func:`normalise` understands."""


@dataclass
class Exercise:
    """One exercise of a chapter: its number "N.k", title, cells (indices) and points."""

    number: str
    title: str
    statement: int
    answers: list[int] = field(default_factory=list)
    check: int | None = None
    checks: list[str] = field(default_factory=list)
    points: float = DEFAULT_POINTS

    @property
    def slug(self) -> str:
        return "ex-" + self.number.replace(".", "-")


# ------------------------------------------------------------------------------------------- reading


def _source(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _exercises_heading(nb) -> int:
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown" and _EXERCISES.search(_source(cell)):
            return i
    raise NotNormalisable("no markdown cell with a '## Exercises' heading: a chapter's exercises follow it")


def _is_answer(cell) -> bool:
    return cell.cell_type == "code" and BEGIN_SOLUTION in _source(cell)


def _top_level_checks(source: str) -> list[str]:
    """The names of the check functions a cell calls at its top level (not inside a def)."""
    names = []
    for line in source.splitlines():
        match = _CHECK_CALL.match(line)
        if match:
            names.append(match.group(1))
    return names


def exercises(nb) -> list[Exercise]:
    """The exercises of a chapter, from its ``## Exercises`` heading on (the layout of the module docstring)."""
    start = _exercises_heading(nb)
    found: list[Exercise] = []
    for i in range(start + 1, len(nb.cells)):
        cell = nb.cells[i]
        source = _source(cell)
        if cell.cell_type == "markdown":
            match = _STATEMENT.search(source)
            if match:
                title = source[match.end():].splitlines()[0].strip() if source[match.end():] else ""
                found.append(Exercise(f"{match.group(1)}.{match.group(2)}", title, i))
            continue
        if cell.cell_type != "code":
            continue
        if _is_answer(cell):
            if not found:
                raise NotNormalisable(f"cell {i} holds a solution before the first '### Exercise N.k:' statement")
            found[-1].answers.append(i)
            if _top_level_checks(source):
                found[-1].checks = _top_level_checks(source)
        elif _top_level_checks(source):
            if not found or not found[-1].answers:
                raise NotNormalisable(f"cell {i} calls {_top_level_checks(source)} before an answer cell of its exercise")
            if found[-1].check is not None:
                raise NotNormalisable(f"exercise {found[-1].number} has two check cells ({found[-1].check} and {i})")
            found[-1].check = i
            found[-1].checks = _top_level_checks(source.split(BEGIN_HIDDEN)[0])
            points = cell.metadata.get("nbgrader", {}).get("points")
            if points is not None:
                found[-1].points = points
    for ex in found:
        if not ex.answers:
            raise NotNormalisable(f"exercise {ex.number} (cell {ex.statement}) has no code cell with '{BEGIN_SOLUTION}'")
        if not ex.checks:
            raise NotNormalisable(f"exercise {ex.number} (cell {ex.statement}) calls no check_...() function after its answer")
    numbers = [ex.number for ex in found]
    if len(set(numbers)) != len(numbers):
        raise NotNormalisable(f"exercise numbers repeat: {numbers}")
    return found


# ------------------------------------------------------------------------------------------- writing


def _meta(grade_id: str, *, solution=False, grade=False, locked=False, points=None) -> dict:
    meta = {"grade": grade, "grade_id": grade_id, "locked": locked, "schema_version": _SCHEMA, "solution": solution,
            "task": False}
    if grade:
        meta["points"] = points
    return meta


def _imports(nb) -> dict[str, str]:
    """check name -> the module a cell of the notebook imports it from."""
    modules = {}
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        code = "\n".join("#" + line if line.lstrip().startswith(("%", "!")) else line
                         for line in _source(cell).splitlines())
        try:
            tree = ast.parse(code)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_edu.exercises"):
                for alias in node.names:
                    if alias.name.startswith("check_"):
                        modules[alias.asname or alias.name] = node.module
    return modules


def _is_check_import(line: str) -> bool:
    match = re.match(r"^from (lightning_edu\.exercises(?:\.\w+)?) import (.+)$", line.strip())
    if not match:
        return False
    names = [n.strip().split(" as ")[0] for n in match.group(2).strip("()").split(",") if n.strip()]
    return bool(names) and all(n.startswith("check_") for n in names)


def _split_answer(source: str) -> tuple[str, list[str]]:
    """The answer cell without its top-level check calls and check imports; and those calls."""
    kept, calls = [], []
    for line in source.splitlines():
        if _CHECK_CALL.match(line):
            calls.append(line.strip())
        elif _is_check_import(line):
            continue
        else:
            kept.append(line)
    while kept and not kept[0].strip():
        kept.pop(0)
    while kept and not kept[-1].strip():
        kept.pop()
    return "\n".join(kept), calls


SAME_CHECK_COMMENT = "  # the input is the answer itself: the same check, run again when graded"


def _hidden_call(call: str, takes_seed: bool = True) -> str:
    """The hidden test of one visible check call: the same check with ``seed=None`` (fresh random inputs), or, for
    a check that draws no random inputs (its answer is an input the reader built), the same call again."""
    try:
        node = ast.parse(call).body[0]
    except SyntaxError as exc:
        raise NotNormalisable(f"cannot read the check call {call!r}: {exc}") from exc
    if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)):
        raise NotNormalisable(f"a check cell holds {call!r}; it may hold only imports and check_...(your_function) calls")
    if not takes_seed:
        return ast.unparse(node) + SAME_CHECK_COMMENT
    node.value.keywords = [k for k in node.value.keywords if k.arg != "seed"]
    node.value.keywords.append(ast.keyword(arg="seed", value=ast.Constant(None)))
    return ast.unparse(node) + HIDDEN_COMMENT


def _check_module(name: str, modules: dict[str, str], chapter: int) -> str:
    """The module a chapter's check ``name`` comes from: the one the notebook imports it from, else the chapter's
    own ``lightning_edu.exercises.chNN``."""
    return modules.get(name, f"lightning_edu.exercises.ch{chapter:02d}")


def _check_function(name: str, modules: dict[str, str], chapter: int):
    """The check called ``name`` in a chapter's check cells, from :func:`_check_module`."""
    return getattr(importlib.import_module(_check_module(name, modules, chapter)), name)


def _takes_seed(name: str, modules: dict[str, str], chapter: int) -> bool:
    """Whether the check ``name`` draws random inputs (has a ``seed`` parameter); True when it cannot be imported
    here (the hidden test then asks for fresh inputs, as for every other check)."""
    try:
        check = _check_function(name, modules, chapter)
    except (ImportError, AttributeError):
        return True
    return "seed" in inspect.signature(check).parameters


def _check_source(calls: list[str], modules: dict[str, str], chapter: int) -> str:
    names = []
    for call in calls:
        name = _CHECK_CALL.match(call).group(1)
        if name not in names:
            names.append(name)
    by_module: dict[str, list[str]] = {}
    for name in names:
        by_module.setdefault(_check_module(name, modules, chapter), []).append(name)
    lines = [f"from {module} import {', '.join(sorted(group))}" for module, group in by_module.items()]
    hidden = [_hidden_call(c, _takes_seed(_CHECK_CALL.match(c).group(1), modules, chapter)) for c in calls]
    lines += [""] + calls + [BEGIN_HIDDEN] + hidden + [END_HIDDEN]
    return "\n".join(lines)


def _visible_calls(source: str) -> list[str]:
    visible = source.split(BEGIN_HIDDEN)[0]
    calls = []
    for line in visible.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#") or _is_check_import(stripped):
            continue
        if not _CHECK_CALL.match(line):
            raise NotNormalisable(f"a check cell holds {stripped!r}; it may hold only imports of check functions and "
                                  "check_...(your_function) calls (put anything else in a cell of its own)")
        calls.append(stripped)
    return calls


def _markers_outside(nb, allowed: set[int]) -> list[str]:
    found = []
    for i, cell in enumerate(nb.cells):
        if i in allowed:
            continue
        source = _source(cell)
        for word in _MARKER_WORDS:
            if word in source:
                found.append(f"cell {i} ({cell.cell_type}) contains '{word}'")
    return found


def normalise(nb, points: dict[str, float] | None = None):
    """A copy of the chapter ``nb`` in nbgrader's layout (see the module docstring); ``nb`` is left unchanged.

    ``points`` maps exercise numbers to points ({"4.3": 2}); an exercise not named keeps the points its check
    cell has, or gets :data:`DEFAULT_POINTS`. Raises :class:`NotNormalisable` with the reason when the chapter
    does not follow the layout.
    """
    nb = copy.deepcopy(nb)
    # Saved widget state: restored without a kernel (a release opened offline, a static export) it draws
    # sliders that redraw nothing. Jupyter's execution stores it by default; the chapters keep none.
    nb.metadata.pop("widgets", None)
    points = {str(k): v for k, v in (points or {}).items()}
    found = exercises(nb)
    unknown = sorted(set(points) - {ex.number for ex in found})
    if unknown:
        raise NotNormalisable(f"--points names exercises this chapter does not have: {unknown}")
    modules = _imports(nb)
    inserted = 0
    for ex in found:
        ex.statement += inserted
        ex.answers = [i + inserted for i in ex.answers]
        if ex.check is not None:
            ex.check += inserted
        chapter = int(ex.number.split(".")[0])
        nb.cells[ex.statement].metadata["nbgrader"] = _meta(f"{ex.slug}-statement", locked=True)
        split_calls = []
        for j, index in enumerate(ex.answers):
            cell = nb.cells[index]
            kept, calls = _split_answer(_source(cell))
            if calls:
                cell.source = kept
                cell.outputs = []
                cell.execution_count = None
                split_calls += calls
            suffix = "" if j == 0 else f"-{j + 1}"
            cell.metadata["nbgrader"] = _meta(f"{ex.slug}-answer{suffix}", solution=True)
        if ex.check is None:
            check = nbformat.v4.new_code_cell(source="")
            check.id = f"{ex.slug}-check"
            at = ex.answers[-1] + 1
            nb.cells.insert(at, check)
            ex.check = at
            inserted += 1
            calls = split_calls
        else:
            check = nb.cells[ex.check]
            calls = split_calls + _visible_calls(_source(check))
        new_source = _check_source(calls, modules, chapter)
        if _source(check) != new_source:
            check.source = new_source
            check.outputs = []
            check.execution_count = None
        ex.points = points.get(ex.number, check.metadata.get("nbgrader", {}).get("points", DEFAULT_POINTS))
        check.metadata["nbgrader"] = _meta(f"{ex.slug}-check", grade=True, locked=True, points=ex.points)
    marked = {i for ex in found for i in ex.answers} | {ex.check for ex in found}
    stray = _markers_outside(nb, marked)
    if stray:
        raise NotNormalisable("nbgrader's markers may appear only in answer and check cells (it acts on them "
                              "anywhere, in markdown too); reword: " + "; ".join(stray))
    return nb


def problems(nb, points: dict[str, float] | None = None) -> list[str]:
    """What :func:`normalise` would change in ``nb`` (empty: the chapter is normalised)."""
    try:
        want = normalise(nb, points)
    except NotNormalisable as exc:
        return [str(exc)]
    return _differences(nb, want)


def _differences(nb, want) -> list[str]:
    if len(want.cells) != len(nb.cells):
        return [f"{len(want.cells) - len(nb.cells)} check cell(s) to split from their answer cells"]
    out = ["saved widget state to drop"] if "widgets" in nb.metadata and "widgets" not in want.metadata else []
    for i, (a, b) in enumerate(zip(nb.cells, want.cells)):
        if _source(a) != _source(b):
            out.append(f"cell {i}: source differs from the normalised layout")
        if a.metadata.get("nbgrader") != b.metadata.get("nbgrader"):
            out.append(f"cell {i}: nbgrader metadata {a.metadata.get('nbgrader')} should be {b.metadata.get('nbgrader')}")
    return out


def _read(path: Path):
    return nbformat.read(str(path), as_version=4)


def _write(nb, path: Path) -> None:
    # nbformat's own layout (indent 1, unicode kept, a final newline): what `jupyter nbconvert --inplace` writes.
    with open(path, "w", encoding="utf-8") as f:
        nbformat.write(nb, f)


def normalise_file(path, points: dict[str, float] | None = None, check: bool = False) -> list[str]:
    """Normalise the notebook at ``path`` in place (unless ``check``); return what was (or would be) changed."""
    path = Path(path)
    nb = _read(path)
    want = normalise(nb, points)
    found = _differences(nb, want)
    if found and not check:
        _write(want, path)
    return found


# ------------------------------------------------------------------------------------------- points


def points_table(paths) -> str:
    """A markdown table of the exercises and points of each chapter, read from the notebooks' metadata."""
    rows = ["| chapter | assignment | exercises (points) | total |", "|---|---|---|---|"]
    for path in paths:
        path = Path(path)
        found = exercises(_read(path))
        listed = ", ".join(f"{ex.number} {_plain(ex.title)} ({_fmt(ex.points)})" for ex in found)
        total = sum(ex.points for ex in found)
        rows.append(f"| `{path.name}` | `ch{path.name[:2]}` | {listed} | {_fmt(total)} |")
    return "\n".join(rows)


def _plain(title: str) -> str:
    return title.replace("|", "\\|")


def _fmt(x) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


# ------------------------------------------------------------------------------------------- the students' copy

_SHOW_SOURCE = re.compile(r"^(\s*)show_source\(\s*([\w.]+?)\s*\)\s*(#.*)?$")


def _checks_of(ex: Exercise, modules: dict[str, str]):
    chapter = int(ex.number.split(".")[0])
    for name in ex.checks:
        yield _check_function(name, modules, chapter)


def student_source(nb):
    """The chapter as students get it before nbgrader strips the solutions: a cell before ``## Exercises``
    that displays the source of a function an exercise asks them to write (its check's ``reveals``) prints a
    line saying so instead. A copy; ``nb`` is left unchanged."""
    nb = copy.deepcopy(nb)
    start = _exercises_heading(nb)
    modules = _imports(nb)
    hidden: dict[str, list[str]] = {}
    for ex in exercises(nb):
        for check in _checks_of(ex, modules):
            for name in getattr(check, "reveals", ()):  # a dotted name (module.function) is matched by its last part
                hidden.setdefault(name.rsplit(".", 1)[-1], []).append(ex.number)
    for cell in nb.cells[:start]:
        if cell.cell_type != "code" or "show_source" not in _source(cell):
            continue
        lines, printed, others = [], [], False
        for line in _source(cell).splitlines():
            match = _SHOW_SOURCE.match(line)
            target = match.group(2).removesuffix(".fn").split(".")[-1] if match else None
            if target in hidden:
                numbers = hidden[target]
                which = f"exercise {numbers[0]} asks" if len(numbers) == 1 else f"exercises {', '.join(numbers)} ask"
                printed.append(f"The source of {target} is left out of this assignment: {which} you to write it.")
                lines.append(f'{match.group(1)}print("{printed[-1]}")')
            else:
                lines.append(line)
                others = others or bool(line.strip()) and not line.strip().startswith("#")
        if printed:
            cell.source = "\n".join(lines)
            # what the cell prints, shown before it runs (on the website it never runs); a cell that does more
            # than print these lines gets its outputs when it runs
            cell.outputs = [] if others else [nbformat.v4.new_output("stream", name="stdout",
                                                                     text="\n".join(printed) + "\n")]
            cell.execution_count = None
    return nb


# ------------------------------------------------------------------------------------------- autograding

# nbgrader's own lists with two of their preprocessors replaced (CONFIG_TEMPLATE): what `nbgrader autograde` runs.
_GRADE_ID = re.compile(r"^ex-(\d+)-(\d+)-(check|answer(?:-\d+)?|statement)$")


def _cell_words(grade_id: str) -> str:
    """How the log names a cell: "the check cell of exercise 9.2 (ex-9-2-check)"."""
    match = _GRADE_ID.match(grade_id or "")
    if not match:
        return f"cell {grade_id}"
    kind = {"check": "check cell", "statement": "statement"}.get(match.group(3), "answer cell")
    return f"the {kind} of exercise {match.group(1)}.{match.group(2)} ({grade_id})"


def without_hidden_tests(source: str) -> str:
    """A check cell as the students get it: the lines between the hidden-test markers taken out, markers included
    (what nbgrader's ClearHiddenTests does)."""
    kept, inside = [], False
    for line in source.split("\n"):
        if BEGIN_HIDDEN.removeprefix("### ") in line:
            inside = True
        elif END_HIDDEN.removeprefix("### ") in line:
            inside = False
        elif not inside:
            kept.append(line)
    return "\n".join(kept)


def _same_code(a: str, b: str) -> bool:
    """Equal sources but for trailing spaces and blank lines at the end (what an editor may change)."""
    def lines(text):
        out = [line.rstrip() for line in text.split("\n")]
        while out and not out[-1]:
            out.pop()
        return out
    return lines(a) == lines(b)


def _is_check_cell(cell) -> bool:
    meta = cell.get("metadata", {}).get("nbgrader", {})
    return bool(meta.get("grade")) and not meta.get("solution")


def _autograde_classes() -> dict:
    """The preprocessors CONFIG_TEMPLATE gives ``nbgrader autograde``, built on first use (nbgrader is needed only
    for a course): ``OverwriteCheckCells`` and ``ExecuteSurviving``."""
    from nbclient.exceptions import DeadKernelError
    from nbclient.util import ensure_async, run_sync
    from nbformat.notebooknode import NotebookNode
    from nbgrader.preprocessors import Execute, OverwriteCells
    from traitlets import Bool, Integer

    class OverwriteCheckCells(OverwriteCells):
        """nbgrader's OverwriteCells (a submission's locked cells get the source's version back), for the book's
        chapters. A check cell deleted from the submission is put back where it was, after its answer cell, and
        graded (nbgrader's ``add_missing_cells``, on by default here and placed after the nearest cell that is
        still there); the log names it. A check cell whose source differs from the release only by its hidden
        tests (every one: the release has them taken out) is put back without a warning, so that the warning
        names only a check cell the student edited."""

        add_missing_cells = Bool(True, help="Put back a grade cell deleted from a submission (and say so)."
                                 ).tag(config=True)

        def preprocess(self, nb, resources):
            info = resources.get("nbgrader", {})
            self._who = "/".join(str(info.get(k, "?")) for k in ("student", "assignment", "notebook"))
            self._cell = None
            return super().preprocess(nb, resources)

        def preprocess_cell(self, cell, resources, cell_index):
            self._cell, self._submitted = cell, cell.get("source", "")
            try:
                return super().preprocess_cell(cell, resources, cell_index)
            finally:
                self._cell = None

        def report_change(self, name, attr, old, new):
            if attr == "checksum" and self._cell is not None:
                try:
                    source = self.gradebook.find_source_cell(name, self.notebook_id, self.assignment_id).source
                except Exception:  # noqa: BLE001 - then the warning below, as nbgrader's own
                    source = None
                if source is not None and _same_code(without_hidden_tests(source), self._submitted):
                    self.log.debug("%s: %s as released; its hidden tests are put back", self._who, _cell_words(name))
                    return
                self.log.warning("%s: %s was edited in the submission; the source's version is put back and graded",
                                 self._who, _cell_words(name))
                return
            self.log.warning("%s: %s: its %s was changed in the submission (should be %s, got %s); put back",
                             self._who, _cell_words(name), attr, old, new)

        def add_missing_grade_cells(self, nb, resources):
            source_nb = self.gradebook.find_notebook(self.notebook_id, self.assignment_id)
            order = [cell.name for cell in source_nb.source_cells]
            sources = {cell.name: cell for cell in source_nb.source_cells}
            solutions = {cell.name for cell in source_nb.solution_cells}
            for grade_cell in source_nb.grade_cells:
                present = {c.metadata["nbgrader"]["grade_id"]: i for i, c in enumerate(nb.cells)
                           if c.get("metadata", {}).get("nbgrader", {}).get("grade_id")}
                name = grade_cell.name
                if name in present or name not in sources:
                    continue
                at = 0
                for earlier in reversed(order[:order.index(name)]):
                    if earlier in present:
                        at = present[earlier] + 1
                        break
                self.log.warning("%s: %s is missing from the submission (deleted): put back from the source after "
                                 "cell %d and graded", self._who, _cell_words(name), at - 1)
                nb.cells.insert(at, self.missing_cell_transform(sources[name], grade_cell.max_score,
                                                                is_solution=name in solutions))
            return nb, resources

    class ExecuteSurviving(Execute):
        """nbgrader's Execute, which survives a kernel that dies. nbgrader drops a notebook whose kernel dies (all
        its exercises then wait for manual grading, with no feedback); here the cell where it died gets an error
        output saying so (0 points if it is a check cell), the kernel is restarted, the code cells before that
        cell run again (their outputs are kept from the first run; check cells are not run again), and execution
        goes on with the next cell. A check itself never kills the kernel (it runs in a process of its own,
        lightning_edu.exercises._isolation): this is for an answer cell that crashes at its top level. A cell that
        runs past ``timeout`` is interrupted with a message saying so."""

        max_restarts = Integer(5, help="Kernel restarts per notebook before a death ends the notebook's grading "
                                       "as nbgrader's Execute would.").tag(config=True)

        def preprocess(self, nb, resources=None, km=None):
            self._restarts = 0
            info = (resources or {}).get("nbgrader", {})
            self._who = "/".join(str(info.get(k, "?")) for k in ("student", "assignment", "notebook"))
            if self.timeout and self.interrupt_on_timeout:
                words = (f"this cell did not finish within {self.timeout} s and was interrupted: an endless loop at "
                         "its top level, or a call that never returns")
                self.error_on_timeout = {"ename": "CellTimeoutError", "evalue": words,
                                         "traceback": [f"\x1b[0;31mCellTimeoutError\x1b[0m: {words}"]}
            return super().preprocess(nb, resources, km)

        def preprocess_cell(self, cell, resources, index):
            try:
                return super().preprocess_cell(cell, resources, index)
            except DeadKernelError:
                if self._restarts >= self.max_restarts:
                    raise
            self._restarts += 1
            words = ("the kernel died while this cell ran (a crash, os._exit, or the machine running out of memory): "
                     "it was restarted, the cells before this one were run again, and grading went on")
            cell.outputs = list(cell.get("outputs", [])) + [NotebookNode(
                output_type="error", ename="KernelDied", evalue=words,
                traceback=[f"\x1b[0;31mKernelDied\x1b[0m: {words}"])]
            grade_id = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")
            self.log.warning("%s: the kernel died in cell %d%s; restarted, cells 0-%d run again", self._who, index,
                             f" ({_cell_words(grade_id)})" if grade_id else "", index - 1)
            run_sync(self._async_revive)(index)
            return cell, self.resources

        async def _async_revive(self, index: int) -> None:
            await ensure_async(self.km.restart_kernel(now=True))
            if self.kc is not None:
                await ensure_async(self.kc.stop_channels())
            self.kc = self.km.client()
            await ensure_async(self.kc.start_channels())
            await ensure_async(self.kc.wait_for_ready(timeout=self.startup_timeout))
            self.kc.allow_stdin = False
            for i in range(index):
                kept = self.nb.cells[i]
                if kept.cell_type != "code" or not kept.source.strip() or _is_check_cell(kept):
                    continue
                try:
                    await self.async_execute_cell(copy.deepcopy(kept), i, store_history=False)
                finally:
                    self.nb.cells[i] = kept  # the first run's outputs are the ones graded and shown

    return {"OverwriteCheckCells": OverwriteCheckCells, "ExecuteSurviving": ExecuteSurviving}


_AUTOGRADE = ("OverwriteCheckCells", "ExecuteSurviving")


def __getattr__(name: str):
    """``OverwriteCheckCells`` and ``ExecuteSurviving`` (nbgrader preprocessors) are made when first asked for:
    the rest of this module works without nbgrader."""
    if name in _AUTOGRADE:
        made = _autograde_classes()
        globals().update(made)
        return made[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------------------------------- a course

CONFIG_TEMPLATE = '''\
# nbgrader configuration of a course built from "Lightning Attention, from the Math to the Kernel".
# `python -m lightning_edu.assignments course DIR --chapters ...` writes it into the course folder DIR (the
# course root: run nbgrader there). INSTRUCTORS.md explains each step.
c = get_config()  # noqa: F821 - nbgrader's config loader defines get_config

# One assignment per chapter: source/chNN/NN_name.ipynb, released into release/chNN/.
c.CourseDirectory.source_directory = "source"
c.CourseDirectory.release_directory = "release"
# c.CourseDirectory.course_id = "lightning-attention"   # release_assignment and collect need it
# c.Exchange.root = "/srv/nbgrader/exchange"             # where release_assignment puts the students' copies

# The chapters' markers (nbgrader's defaults, stated so that another default cannot break them). nbgrader acts
# on them anywhere in a cell, markdown too, so the chapters write them only in answer and check cells.
c.ClearSolutions.begin_solution_delimeter = "BEGIN SOLUTION"
c.ClearSolutions.end_solution_delimeter = "END SOLUTION"
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\\nraise NotImplementedError()"}
c.ClearSolutions.enforce_metadata = True
c.ClearHiddenTests.begin_test_delimeter = "BEGIN HIDDEN TESTS"
c.ClearHiddenTests.end_test_delimeter = "END HIDDEN TESTS"

# Autograding runs a chapter top to bottom: 3 to 45 s a chapter on a 2-core CPU, the Triton chapters (07-09)
# included, whose kernels run in the CPU interpreter without a GPU. Each check stops a call of the student's
# function after 60 s and itself after 240 s (LIGHTNING_EDU_CALL_TIME_LIMIT, LIGHTNING_EDU_CHECK_TIME_LIMIT in the
# environment of `nbgrader autograde` change them); a cell is interrupted after 10 minutes.
c.Execute.timeout = 600
c.Execute.interrupt_on_timeout = True

# Grading what survives (INSTRUCTORS.md): a check cell deleted from a submission is put back and graded, and the
# log names a check cell that was deleted or edited (not the hidden tests, which every check cell gets back); a
# kernel that dies in a cell is restarted, the cells before it run again, and the cells after it are graded.
c.Autograde.sanitize_preprocessors = [
    "nbgrader.preprocessors.ClearOutput",
    "nbgrader.preprocessors.DeduplicateIds",
    "nbgrader.preprocessors.OverwriteKernelspec",
    "lightning_edu.assignments.OverwriteCheckCells",
    "nbgrader.preprocessors.CheckCellMetadata",
]
c.Autograde.autograde_preprocessors = [
    "lightning_edu.assignments.ExecuteSurviving",
    "nbgrader.preprocessors.IgnorePattern",
    "nbconvert.preprocessors.ClearMetadataPreprocessor",
    "nbgrader.preprocessors.LimitOutput",
    "nbgrader.preprocessors.SaveAutoGrades",
    "nbgrader.preprocessors.AssignLatePenalties",
    "nbgrader.preprocessors.CheckCellMetadata",
]
'''


def _chapter_paths(root: Path, specs) -> list[Path]:
    from .book.toc import chapters

    known = {c.file[:2]: c.path for c in chapters(root)}
    paths = []
    for spec in specs:
        key = f"{int(spec):02d}" if str(spec).isdigit() else str(spec)[:2]
        if key not in known:
            raise ValueError(f"no chapter {spec!r} in book.toml (chapters: {', '.join(sorted(known))})")
        paths.append(known[key])
    return paths


def layout_course(course: Path, chapters, *, points: dict[str, float] | None = None, root: Path | None = None) -> dict:
    """Lay out ``course/source/chNN/NN_x.ipynb`` for each chapter (numbers, e.g. ["04", "05"]) and
    ``course/nbgrader_config.py``; a file that exists is never overwritten. Returns {"written": [...], "kept": [...]}.

    All or nothing: every chapter is read and normalised, and ``points`` checked against them (each exercise
    named must be one of theirs), before anything is written, and a write that fails (a read-only file system)
    takes back the files and folders this call made. A refused call (ValueError, :class:`NotNormalisable`, or
    the OSError of the write) leaves the course folder as it was, or absent.
    """
    from .book.toc import repo_root

    course = Path(course)
    root = Path(root) if root else repo_root()
    _check_folder(course)
    paths = _chapter_paths(root, chapters)
    _points_name_these_chapters(points, paths)
    files = [(course / "nbgrader_config.py", CONFIG_TEMPLATE)]
    for path in paths:
        try:
            nb = student_source(normalise(_read_notebook(path), _points_for(points, path)))
        except NotNormalisable as exc:
            raise NotNormalisable(f"{path.name}: {exc}") from None
        files.append((course / "source" / f"ch{path.name[:2]}" / path.name, nbformat.writes(nb) + "\n"))
    return _write_all_new(files)


def _check_folder(course: Path) -> None:
    """``course`` and every folder above it that exists must be folders (mkdir would fail half way)."""
    for folder in (course, *course.parents):
        if folder.exists():
            if not folder.is_dir():
                what = "the course folder" if folder == course else f"a folder above the course folder {course}"
                raise ValueError(f"{folder} is a file, not a folder: it cannot be {what}")
            return


def _read_notebook(path: Path):
    """A notebook, or a ValueError that names it and the problem (missing, a folder, not JSON, not a notebook)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: no such notebook")
    if path.is_dir():
        raise ValueError(f"{path}: a folder, not a notebook")
    try:
        return _read(path)
    except nbformat.reader.NotJSONError:
        raise ValueError(f"{path}: not a notebook (its text is not JSON)") from None
    except (nbformat.ValidationError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path}: not a valid notebook ({_one_line(exc)})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a notebook (its bytes are not UTF-8 text)") from None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _points_for(points, path: Path):
    if not points or not path.name[:2].isdigit():
        return None
    prefix = f"{int(path.name[:2])}."
    return {k: v for k, v in points.items() if k.startswith(prefix)} or None


def _points_name_these_chapters(points, paths) -> None:
    """Each exercise ``points`` names must belong to one of the notebooks (chapter NN from the name NN_x.ipynb):
    points for a chapter not given would be dropped without a word."""
    chapters = {int(p.name[:2]) for p in map(Path, paths) if p.name[:2].isdigit()}
    stray = sorted((k for k in (points or {}) if int(k.split(".")[0]) not in chapters), key=_exercise_order)
    if stray:
        given = ", ".join(f"{c:02d}" for c in sorted(chapters)) or "none"
        raise ValueError(f"--points names {', '.join(stray)}, not an exercise of the chapters given ({given})")


def _exercise_order(number: str) -> tuple[int, int]:
    chapter, k = number.split(".")
    return int(chapter), int(k)


def _write_all_new(files) -> dict:
    """Write each (path, text) whose path does not exist; on an OSError remove what was written and the folders
    made for it, then raise it again."""
    result = {"written": [], "kept": []}
    made: list[Path] = []
    try:
        for path, text in files:
            if path.exists():
                result["kept"].append(path)
                continue
            missing = [d for d in (path.parent, *path.parent.parents) if not d.exists()]
            for folder in reversed(missing):  # the outermost first
                folder.mkdir()
                made.append(folder)
            with open(path, "x", encoding="utf-8") as f:  # "x": fails rather than overwrite, even in a race
                result["written"].append(path)
                f.write(text)
    except OSError:
        for path in reversed(result["written"]):
            path.unlink(missing_ok=True)
        for folder in reversed(made):  # the innermost first
            try:
                folder.rmdir()
            except OSError:
                pass
        raise
    return result


# ------------------------------------------------------------------------------------------- command line


def _parse_points(items) -> dict[str, float]:
    """{"4.3": 2} from ["4.3=2"]; a ValueError names an item that is not N.k=P with P a finite number >= 0, and an
    exercise named twice."""
    points = {}
    for item in items or ():
        number, _, value = item.partition("=")
        if not re.fullmatch(r"\d+\.\d+", number) or not value:
            raise ValueError(f"--points takes N.k=P, e.g. 4.3=2; got {item!r}")
        try:
            parsed = float(value) if re.search(r"[.eEnN]", value) else int(value)
        except ValueError:
            raise ValueError(f"--points takes N.k=P with P a number, e.g. 4.3=2; got {item!r}") from None
        if not math.isfinite(parsed) or parsed < 0:
            raise ValueError(f"--points: the points of an exercise must be a finite number >= 0, got {item!r}")
        if number in points:
            raise ValueError(f"--points names exercise {number} twice")
        points[number] = parsed
    return points


def _fail(message: str) -> int:
    """The one line a refused command prints (to stderr); its exit status."""
    print(f"python -m lightning_edu.assignments: {message}", file=sys.stderr)
    return 2


def _os_problem(exc: OSError) -> str:
    where = f" {exc.filename}" if exc.filename else ""
    return f"cannot write{where}: {exc.strerror or _one_line(exc)}"


def main(argv=None) -> int:
    """The command line (the module docstring). A refused command prints one line naming the problem and returns 2,
    having written nothing (``normalise`` writes no notebook unless every one given can be normalised)."""
    parser = argparse.ArgumentParser(prog="python -m lightning_edu.assignments", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("normalise", help="give chapters nbgrader's cell metadata and hidden tests (in place)")
    p.add_argument("notebooks", nargs="+")
    p.add_argument("--points", nargs="*", metavar="N.k=P", help="points of an exercise (default: the points it has, else 1)")
    p.add_argument("--check", action="store_true", help="only report what would change; exit 1 if anything would")
    p = sub.add_parser("course", help="lay out a course folder from chapters (never overwrites a file)")
    p.add_argument("dir")
    p.add_argument("--chapters", nargs="+", required=True, metavar="NN")
    p.add_argument("--points", nargs="*", metavar="N.k=P")
    p = sub.add_parser("points", help="print the points per chapter as a markdown table")
    p.add_argument("notebooks", nargs="*")
    sub.add_parser("config", help="print the nbgrader_config.py a course uses")
    args = parser.parse_args(argv)
    try:
        return _command(args)
    except BrokenPipeError:  # the reader of the output went away (`... points | head`): nothing to report
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - Python flushes stdout again at exit
        return 1
    except OSError as exc:
        return _fail(_os_problem(exc))
    except ValueError as exc:  # NotNormalisable included
        return _fail(_one_line(exc))


def _command(args) -> int:
    if args.command == "normalise":
        return _normalise_command(args)
    if args.command == "course":
        result = layout_course(Path(args.dir), args.chapters, points=_parse_points(args.points))
        for path in result["written"]:
            print(f"wrote {path}")
        for path in result["kept"]:
            print(f"kept  {path} (exists; never overwritten)")
        print("next: cd into the course folder and run `nbgrader generate_assignment chNN` (INSTRUCTORS.md)")
        return 0
    if args.command == "points":
        from .book.toc import chapters, repo_root

        paths = args.notebooks or [c.path for c in chapters(repo_root())]
        for path in paths:
            try:
                exercises(_read_notebook(path))
            except NotNormalisable as exc:
                raise ValueError(f"{path}: {exc}") from None
        print(points_table(paths))
        return 0
    print(CONFIG_TEMPLATE, end="")
    return 0


def _normalise_command(args) -> int:
    points = _parse_points(args.points)
    paths = [Path(name) for name in args.notebooks]
    _points_name_these_chapters(points, paths)
    planned, refused = [], []
    for path in paths:  # every notebook read and normalised before any is written
        nb = _read_notebook(path)
        try:
            want = normalise(nb, _points_for(points, path))
        except NotNormalisable as exc:
            refused.append(f"{path}: not normalisable: {_one_line(exc)}")
            continue
        planned.append((path, want, _differences(nb, want)))
    if refused:
        for line in refused:
            _fail(line)
        return 2
    if not args.check:
        _rewrite_all([(path, want) for path, want, changes in planned if changes])
    status = 0
    for path, _, changes in planned:
        if changes:
            verb = "would change" if args.check else "normalised (re-execute it to refresh its outputs)"
            print(f"{path}: {verb}: " + "; ".join(changes[:3]) + (" ..." if len(changes) > 3 else ""))
            status = max(status, 1 if args.check else 0)
        else:
            print(f"{path}: already normalised")
    return status


def _rewrite_all(notebooks) -> None:
    """Write each (path, notebook) in place; on an OSError put back the bytes of those already written (and of
    the one that failed), then raise it again."""
    written: list[tuple[Path, bytes]] = []
    for path, nb in notebooks:
        before = path.read_bytes()
        try:
            _write(nb, path)
        except OSError:
            for done, text in [*written, (path, before)]:
                try:
                    done.write_bytes(text)
                except OSError:
                    pass
            raise
        written.append((path, before))


if __name__ == "__main__":
    raise SystemExit(main())
