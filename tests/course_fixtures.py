"""A small chapter 4 in nbgrader's layout, for the course tools' tests (tests/test_assignments.py and the fast
tests/test_assignments_cli.py, which must not import the former: its course pipeline starts at collection)."""

import nbformat

from lightning_edu.assignments import BEGIN_SOLUTION, END_SOLUTION


def chapter_four(summary: bool = False):
    """A chapter 4 with exercises 4.1 and 4.2 (their checks those of lightning_edu.exercises.ch04); ``summary``
    puts a Summary section in the cell before the exercises, as the chapters had it before ``normalise``."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell("# Chapter 4: x"),
        nbformat.v4.new_markdown_cell("## Summary\n\n- s\n\n## Exercises" if summary else "## Exercises"),
        nbformat.v4.new_markdown_cell("### Exercise 4.1: one\n\nWrite `f`."),
        nbformat.v4.new_code_cell("from lightning_edu.exercises.ch04 import check_intra_block\n\n"
                                  f"def f(q, k, v, lam):\n    {BEGIN_SOLUTION}\n    return q\n    {END_SOLUTION}\n\n"
                                  "check_intra_block(f)"),
        nbformat.v4.new_markdown_cell("### Exercise 4.2: two\n\nWrite `g`."),
        nbformat.v4.new_code_cell(f"def g(kv, k, v, lam):\n    {BEGIN_SOLUTION}\n    return kv\n    {END_SOLUTION}"),
        nbformat.v4.new_code_cell("from lightning_edu.exercises.ch04 import check_state_update\n\ncheck_state_update(g)"),
    ]
    return nb
