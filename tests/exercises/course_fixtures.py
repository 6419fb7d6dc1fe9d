"""A small chapter 4 in nbgrader's layout, for the course tools' tests (tests/exercises/test_assignments.py and the fast
tests/exercises/test_assignments_cli.py, which must not import the former: its course pipeline starts at collection), and
the commands that run nbgrader in a course folder (tests/exercises/test_assignments.py, tests/exercises/test_assignments_survival.py)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

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


# The environment nbgrader's commands start from: the one this module was imported with (at collection, before any
# test runs). The course pipeline starts its commands on a thread beside the other tests, and those change
# os.environ for a while: monkeypatch.setenv, and each guarded check of the exercises, which puts its sentinels
# first on PYTHONPATH while the reader's function runs. A command started from os.environ at such a moment would
# grade with the sentinels switched on, or with a one-second time limit.
_ENVIRONMENT = dict(os.environ)


def nbgrader_at(course: Path, *args: str, lowest_priority: bool = False, env: dict | None = None) -> subprocess.Popen:
    """``nbgrader ARGS`` started in the course folder. nbgrader runs `alembic` from PATH to set up its gradebook: the
    interpreter's bin folder goes first, as an activated virtual environment would have it. ``lowest_priority``: the
    command and its kernels run at nice 19; ``env``: variables added to the environment (its kernels inherit it),
    which starts as the one of the session's start (``_ENVIRONMENT``), not as it is at the call."""
    env = dict(_ENVIRONMENT, **(env or {}),
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    nice = ["nice", "-n", "19"] if lowest_priority and shutil.which("nice") else []  # not preexec_fn: threads
    return subprocess.Popen([*nice, sys.executable, "-m", "nbgrader", *args], cwd=course, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)


def finish(process: subprocess.Popen, what: str, timeout: float = 600) -> str:
    """The output of an nbgrader command started with :func:`nbgrader_at`; the test fails if it runs past
    ``timeout`` seconds or exits with an error."""
    try:
        out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, _ = process.communicate()
        pytest.fail(f"nbgrader {what} was still running after {timeout:g} s; its last output:\n{out[-4000:]}")
    assert process.returncode == 0, f"nbgrader {what} failed:\n{_the_failure(out)}"
    return out


def _the_failure(out: str, width: int = 4000) -> str:
    """What to show of a failed command's output: from its first traceback or error line (nbgrader logs the
    traceback of a failed student before it goes on with the others), and its last lines."""
    starts = [i for i in (out.find("Traceback"), out.find("| ERROR]")) if i >= 0]
    if not starts or min(starts) >= len(out) - width:
        return out[-width:]
    first = min(starts)
    return f"{out[first:first + width]}\n[...]\n{out[-width // 2:]}"


def kernel_options(course: Path, assignment: str, cell_timeout: int = 120) -> list[str]:
    """Options for an autograde run: its kernels talk over Unix sockets in a folder of the course's own, not over
    TCP ports, which jupyter_client picks, frees and hands to the kernel to bind again, so that a kernel of another
    process on the machine can take one in between (an autograde once waited ten minutes on a kernel that never
    answered). Each assignment has a folder of its own: jupyter_client names an IPC socket by the first free number
    in its folder, so two autogrades running side by side in one folder could pick the same name. One cell may
    take ``cell_timeout`` seconds: a hang fails with its cell named, not with the whole run's timeout. A kernel may
    take 10 minutes to start (nbgrader's default is one): beside the other tests at nice 19, on two busy cores, the
    first kernel of a run can wait that long for its imports."""
    sockets = course / "kernel-sockets" / assignment
    sockets.mkdir(parents=True, exist_ok=True)
    return ["--KernelManager.transport=ipc", f"--KernelManager.ip={sockets / 'k'}", f"--Execute.timeout={cell_timeout}",
            "--Execute.startup_timeout=600"]
