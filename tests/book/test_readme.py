"""README.md is the book's front door: short, its taste of the package runs, and its CPU-only advice comes first.

The README's commands, chapter table and headline table are checked where they are made: tests/test_packaging.py
(the two commands, the chapter table), tests/book/test_site.py (the command that opens the book), tests/book/test_results.py
(the headline table, against the records).
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme() -> str:
    return (ROOT / "README.md").read_text()


def test_readme_is_a_front_door():
    lines = readme().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; measurements belong on the results page"


def test_readme_names_at_most_three_commits():
    text = re.sub(r"\]\([^)]*\)", "]()", readme())  # link targets are not prose
    hashes = {h for h in re.findall(r"(?<![\w/.-])[0-9a-f]{7,40}(?![\w/.-])", text)
              if re.search(r"[a-f]", h) and re.search(r"\d", h)}
    assert len(hashes) <= 3, f"commit hashes in README.md: {sorted(hashes)}"


def test_readme_avoids_the_books_jargon():
    text = readme()
    for word in ("rung", "HBM floor", "LA-3 note"):
        assert not re.search(rf"\b{re.escape(word)}\b", text, flags=re.I), f"README.md uses {word!r} undefined"


def test_the_taste_of_the_package_runs():
    text = readme()
    start = text.index("## A taste")
    code = re.search(r"```python\n(.*?)\n```", text[start:], flags=re.S).group(1)
    assert len(code.splitlines()) <= 10
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md (A taste)", "exec"), {})
    error = float(printed.getvalue().split()[-1])
    assert error < 1e-12, "the blockwise float64 forward is the float64 recurrence"


def test_the_cpu_only_install_comes_before_the_commands_and_pins_the_books_torch():
    text = readme()
    cpu = text.index("without a GPU")
    assert cpu < text.index("**Read the book**") and cpu < text.index("**Run every test**")
    command = re.search(r"```bash\n(.*?)\n```", text[cpu:], flags=re.S).group(1)
    pins = dict(re.findall(r"^(torch)==(\S+)", (ROOT / "constraints.txt").read_text(), flags=re.M))
    assert f"torch=={pins['torch']}" in command, "the CPU build of the book's own torch (constraints.txt)"
    assert "--index-url https://download.pytorch.org/whl/cpu" in command and ".venv/bin/pip" in command
    # .ci/setup's installs then keep that torch: pip leaves a requirement that is already satisfied alone
    installs = [ln for ln in (ROOT / ".ci/setup").read_text().splitlines() if "pip install" in ln]
    assert installs and not any(flag in ln for ln in installs for flag in ("--upgrade", " -U ", "--force-reinstall"))


def test_the_readmes_links_resolve():
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme())
    local = [t for t in targets if "://" not in t]
    assert local, "README.md links to nothing in the repository"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"
    for page in ("CONTRIBUTING.md", "INSTRUCTORS.md"):
        assert page in local, f"README.md does not link to {page}"
