"""Every chapter follows the book's notebook format (the book's notebook format).

Tests are parametrised per chapter of book.toml: a missing notebook fails once, in
``test_notebook_exists``, and its other format tests are skipped with a pointer to that failure.
"""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

import nbformat
import pytest

from lightning_edu.book import chapters

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = chapters(ROOT)
IDS = [c.file for c in CHAPTERS]

SETUP_CELL = """\
# Setup: Triton kernels run in the CPU interpreter when there is no GPU (set before any kernel is defined).
from lightning_edu.book import setup_notebook, show_source
DEVICE = setup_notebook()"""

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
CHECK_CALL = re.compile(r"\bcheck_\w+\s*\(")


@lru_cache(maxsize=None)
def _read(path: Path):
    return nbformat.read(path, as_version=4)


def notebook(chapter):
    if not chapter.path.is_file():
        pytest.skip(f"{chapter.file} is missing (test_notebook_exists fails for it)")
    return _read(chapter.path)


def code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def is_exercise_cell(cell) -> bool:
    return cell.cell_type == "code" and BEGIN in cell.source and END in cell.source


def heading_index(nb, heading: str) -> int | None:
    """Index of the first markdown cell with a line exactly ``heading``."""
    pattern = re.compile(rf"^{re.escape(heading)}\s*$", flags=re.M)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown" and pattern.search(cell.source):
            return i
    return None


@lru_cache(maxsize=None)
def public_package_functions() -> frozenset[str]:
    """Names of the public top-level functions of every lightning_edu module, read with ast (no imports)."""
    names = set()
    for path in (ROOT / "lightning_edu").rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                names.add(node.name)
    return frozenset(names)


def test_public_function_list_is_meaningful():
    # Guards the redefinition test below against silently checking nothing.
    assert {"lightning_attention", "causal_linear_recurrent", "blockwise_forward", "decay_mask", "setup_notebook"} <= (
        public_package_functions()
    )


@pytest.mark.parametrize("chapter", CHAPTERS, ids=IDS)
def test_notebook_exists(chapter):
    assert chapter.path.is_file(), f"book.toml lists {chapter.file} but {chapter.path} does not exist"
    nbformat.validate(_read(chapter.path))


@pytest.mark.parametrize("chapter", CHAPTERS, ids=IDS)
def test_kernel_is_python3(chapter):
    spec = notebook(chapter).metadata.get("kernelspec", {})
    assert spec.get("name") == "python3", spec
    assert spec.get("display_name") == "Python 3 (ipykernel)", spec


@pytest.mark.parametrize("chapter", CHAPTERS, ids=IDS)
def test_first_cell_title_goals_and_prerequisites(chapter):
    first = notebook(chapter).cells[0]
    assert first.cell_type == "markdown", "the first cell must be markdown"
    lines = first.source.splitlines()
    assert lines[0] == f"# Chapter {chapter.number}: {chapter.title}", (
        f"first line must be '# Chapter {chapter.number}: {chapter.title}' (title exactly as in book.toml), got {lines[0]!r}"
    )
    assert re.search(r"^## Goals\s*$", first.source, flags=re.M), "the first cell needs a '## Goals' section"
    goals = first.source.split("## Goals", 1)[1]
    assert re.search(r"^\s*[-*] \S", goals, flags=re.M), "## Goals needs bullet points"
    assert re.search(r"prerequisite", first.source, flags=re.I), "the first cell needs a line on prerequisites"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=IDS)
def test_first_code_cell_is_the_setup_cell(chapter):
    cells = code_cells(notebook(chapter))
    assert cells, "no code cells"
    got = "\n".join(line.rstrip() for line in cells[0].source.strip().splitlines())
    assert "setup_notebook()" in got, "the first code cell must call setup_notebook()"
    assert got == SETUP_CELL, f"the first code cell must be exactly:\n{SETUP_CELL}\ngot:\n{got}"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=IDS)
def test_summary_then_exercises(chapter):
    nb = notebook(chapter)
    summary, exercises = heading_index(nb, "## Summary"), heading_index(nb, "## Exercises")
    assert summary is not None, "no markdown cell with a '## Summary' heading"
    assert exercises is not None, "no markdown cell with a '## Exercises' heading"
    if summary == exercises:  # both headings in one cell: compare their positions inside it
        source = nb.cells[summary].source
        assert source.index("## Summary") < source.index("## Exercises"), "## Summary must come before ## Exercises"
    else:
        assert summary < exercises, "## Summary must come before ## Exercises"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=IDS)
def test_exercises_have_solutions_and_checks(chapter):
    nb = notebook(chapter)
    exercises = heading_index(nb, "## Exercises")
    assert exercises is not None, "no '## Exercises' heading"
    statements = [
        i for i, c in enumerate(nb.cells)
        if c.cell_type == "markdown" and re.search(r"^### Exercise \d+\.\d+", c.source, flags=re.M)
    ]
    assert statements, f"no '### Exercise {chapter.number}.k: ...' markdown cell"
    for i in statements:
        number = re.search(r"^### Exercise (\d+)\.\d+", nb.cells[i].source, flags=re.M).group(1)
        assert int(number) == chapter.number, f"cell {i}: exercise numbered {number}.k in chapter {chapter.number}"
    solution_cells = [i for i, c in enumerate(nb.cells) if is_exercise_cell(c)]
    assert solution_cells, f"no code cell with both '{BEGIN}' and '{END}'"
    for i in solution_cells:
        source = nb.cells[i].source
        assert source.index(BEGIN) < source.index(END), f"cell {i}: {END} comes before {BEGIN}"
        assert i > exercises and any(s < i for s in statements), f"cell {i}: a solution cell before its exercise statement"
        following = [c for c in nb.cells[i + 1:] if c.cell_type == "code"][:1]
        if not CHECK_CALL.search(source):
            assert following and CHECK_CALL.search(following[0].source), (
                f"cell {i}: neither the solution cell nor the next code cell calls a check_...() function"
            )
    text = "\n".join(c.source for c in code_cells(nb))
    assert f"lightning_edu.exercises.ch{chapter.number:02d}" in text, (
        f"the checks must come from lightning_edu.exercises.ch{chapter.number:02d}"
    )


@pytest.mark.parametrize("chapter", CHAPTERS, ids=IDS)
def test_executed_in_order_top_to_bottom(chapter):
    counts = [c.get("execution_count") for c in code_cells(notebook(chapter))]
    assert counts == list(range(1, len(counts) + 1)), (
        f"execution counts must be 1..{len(counts)} in order (run the notebook top to bottom and save), got {counts}"
    )


@pytest.mark.parametrize("chapter", CHAPTERS, ids=IDS)
def test_no_error_outputs(chapter):
    for i, cell in enumerate(notebook(chapter).cells):
        for out in cell.get("outputs", []):
            assert out.output_type != "error", f"cell {i} has an error output: {out.get('ename')}: {out.get('evalue')}"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=IDS)
def test_no_package_function_redefined(chapter):
    public = public_package_functions()
    for i, cell in enumerate(notebook(chapter).cells):
        if cell.cell_type != "code" or is_exercise_cell(cell):
            continue
        defined = set(re.findall(r"^\s*def\s+(\w+)\s*\(", cell.source, flags=re.M))
        clash = sorted(defined & public)
        assert not clash, (
            f"cell {i} re-defines {clash}, which lightning_edu defines: import it and show it with show_source instead"
        )


# nbval recognises a marker only when the whole comment is the marker: `# NBVAL_IGNORE_OUTPUT (timings)` is
# silently NOT a marker, and the cell's output is then compared after all.
NBVAL_MARKERS = {"NBVAL_IGNORE_OUTPUT", "NBVAL_CHECK_OUTPUT", "NBVAL_RAISES_EXCEPTION", "NBVAL_SKIP"}


def test_nbval_marker_rule_matches_nbval():
    from nbval.plugin import comment_markers, find_comment_markers

    assert NBVAL_MARKERS <= set(comment_markers)
    assert list(find_comment_markers("# NBVAL_IGNORE_OUTPUT\nx = 1")) == [("check", False)]
    assert list(find_comment_markers("# NBVAL_IGNORE_OUTPUT (timings)\nx = 1")) == []  # the trap this test guards


@pytest.mark.parametrize("chapter", CHAPTERS, ids=IDS)
def test_nbval_markers_are_exact(chapter):
    for i, cell in enumerate(notebook(chapter).cells):
        if cell.cell_type != "code":
            continue
        for line in cell.source.splitlines():
            stripped = line.strip()
            if stripped.startswith("#") and "NBVAL_" in stripped:
                comment = stripped.lstrip("#").strip()
                assert comment in NBVAL_MARKERS, (
                    f"cell {i}: {stripped!r} is not an nbval marker (nbval needs the comment to be exactly one of "
                    f"{sorted(NBVAL_MARKERS)}); put any explanation on the next line"
                )


@pytest.mark.parametrize("chapter", CHAPTERS, ids=IDS)
def test_no_saved_widget_state(chapter):
    """Restored without a kernel (a static export, the website), saved widget state draws sliders that move and
    redraw nothing; each widget's own text says what it needs instead (lightning_edu.book.widgets)."""
    assert "widgets" not in notebook(chapter).metadata, (
        f"{chapter.file} stores widget state: `python -m lightning_edu.assignments normalise` drops it")
