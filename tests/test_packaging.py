"""Packaging and book metadata agree with each other: pyproject.toml, environment.yml, README.md, book.toml, .ci/run."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml  # the dev extra pins pyyaml; packaging comes with pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from lightning_edu.book import chapter_table, chapters

ROOT = Path(__file__).resolve().parent.parent


def pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def book_toml() -> dict:
    with open(ROOT / "book.toml", "rb") as f:
        return tomllib.load(f)


def readme() -> str:
    return (ROOT / "README.md").read_text()


def normalised(specs) -> dict:
    """{canonical name: SpecifierSet} for requirement strings (duplicates are an error)."""
    out = {}
    for spec in specs:
        req = Requirement(spec)
        name = canonicalize_name(req.name)
        assert name not in out, f"{name} listed twice"
        out[name] = req.specifier
    return out


def environment_specs() -> tuple[list[str], list[str]]:
    """(conda dependencies, pip dependencies) of environment.yml, 'pip' itself and '-e .' left out."""
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda, pip = [], []
    for entry in env["dependencies"]:
        if isinstance(entry, dict):
            assert list(entry) == ["pip"], f"unexpected mapping in environment.yml dependencies: {entry}"
            pip.extend(entry["pip"])
        elif entry != "pip":
            conda.append(entry)
    return conda, pip


def constraints() -> dict:
    """{canonical name: SpecifierSet} of constraints.txt, the versions the book is tested with."""
    lines = [ln.split("#")[0].strip() for ln in (ROOT / "constraints.txt").read_text().splitlines()]
    return normalised([ln for ln in lines if ln])


def test_environment_yml_lists_the_same_dependencies_as_pyproject():
    """The same names as pyproject's dependencies and dev extra, each at the book's pin where constraints.txt has
    one (a conda environment is the book's environment) and at pyproject's specifier otherwise."""
    project = pyproject()["project"]
    wanted = normalised(project["dependencies"] + project["optional-dependencies"]["dev"])
    wanted.update({n: s for n, s in constraints().items() if n in wanted})
    wanted["python"] = Requirement("python" + project["requires-python"]).specifier
    conda, pip = environment_specs()
    assert "-e ." in pip, "environment.yml must install lightning_edu itself (`-e .` in the pip section)"
    given = normalised(conda + [p for p in pip if p != "-e ."])
    missing = {n: str(s) for n, s in wanted.items() if n not in given}
    extra = {n: str(s) for n, s in given.items() if n not in wanted}
    differ = {n: (str(wanted[n]), str(given[n])) for n in wanted.keys() & given.keys() if wanted[n] != given[n]}
    assert not missing and not extra and not differ, (
        f"environment.yml vs pyproject.toml: missing {missing}, extra {extra}, different specifiers "
        f"(pyproject, environment.yml) {differ}"
    )


def test_python_version_is_3_11_or_later_on_both_sides():
    assert pyproject()["project"]["requires-python"] == ">=3.11"
    conda, _ = environment_specs()
    assert "python>=3.11" in conda


def test_environment_yml_uses_conda_forge_and_a_name():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert env["channels"] == ["conda-forge"]
    assert isinstance(env["name"], str) and env["name"]


def test_the_book_pins_torch_and_triton_inside_the_ranges_the_package_supports():
    deps, pins = normalised(pyproject()["project"]["dependencies"]), constraints()
    assert (str(pins["torch"]), str(pins["triton"])) == ("==2.13.0", "==3.7.1")
    assert set(pins) <= set(deps), "constraints.txt pins only the package's own dependencies"
    for name, pin in pins.items():
        (version,) = [spec.version for spec in pin]
        assert version in deps[name], f"{name} {version} is outside pyproject's {deps[name]}"
    # a GPU machine's CUDA build stays: torch 2.11 with Triton 3.6 lie in the ranges; no unbounded range
    assert "2.11.0" in deps["torch"] and "3.6.0" in deps["triton"]
    assert all(any(spec.operator in ("<", "<=", "==") for spec in deps[n]) for n in ("torch", "triton"))


def test_setup_installs_with_the_constraints():
    setup = (ROOT / ".ci/setup").read_text()
    installs = [ln for ln in setup.splitlines() if "pip install" in ln and "-e " in ln]
    assert installs and all("-c constraints.txt" in ln for ln in installs)


def test_dev_extra_holds_the_test_tools():
    dev = normalised(pyproject()["project"]["optional-dependencies"]["dev"])
    assert {"pytest", "nbval", "hypothesis"} <= set(dev)


def test_runtime_dependencies_cover_what_the_package_imports():
    deps = set(normalised(pyproject()["project"]["dependencies"]))
    assert {"numpy", "torch", "triton", "matplotlib", "ipywidgets", "jupyterlab"} <= deps


# ---------------------------------------------------------------- README


def readme_chapter_table() -> str:
    text = readme()
    match = re.search(r"<!-- chapters:begin -->\n(.*?)\n<!-- chapters:end -->", text, flags=re.S)
    assert match, "README.md lacks the <!-- chapters:begin --> ... <!-- chapters:end --> block"
    return match.group(1).strip()


def test_readme_chapter_table_equals_book_toml():
    assert readme_chapter_table() == chapter_table(ROOT), (
        "README's chapter table is out of step with book.toml; regenerate it with `python -m lightning_edu.book`"
    )


def code_block_after(label: str) -> str:
    """The first ```bash block after the paragraph that starts with **label**."""
    text = readme()
    start = text.find(f"**{label}**")
    assert start >= 0, f"README.md lacks the **{label}** paragraph"
    match = re.search(r"```bash\n(.*?)\n```", text[start:], flags=re.S)
    assert match, f"no ```bash block after **{label}**"
    return match.group(1).strip()


def test_readme_read_the_book_command():
    cmd = code_block_after("Read the book")
    assert "\n" not in cmd, "one command, one line"
    assert cmd.startswith("bash .ci/setup && ")
    assert "jupyter lab" in cmd and "--allow-root" in cmd
    assert "notebooks/00_how_to_read.ipynb" in cmd


def test_readme_test_command_is_what_ci_runs():
    cmd = code_block_after("Run every test")
    assert "\n" not in cmd, "one command, one line"
    assert cmd.startswith("bash .ci/setup && ")
    assert "--nbval" in cmd and cmd.endswith(" tests notebooks")
    lines = [ln.strip() for ln in (ROOT / ".ci/run").read_text().splitlines()]
    commands = [ln for ln in lines if ln and not ln.startswith("#")]
    assert commands[-1] == cmd


def test_ci_scripts_fail_fast_and_setup_installs_the_dev_extra():
    for script in ("run", "setup"):
        text = (ROOT / ".ci" / script).read_text()
        assert text.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in text
    assert "-e '.[dev]'" in (ROOT / ".ci/setup").read_text()


# ---------------------------------------------------------------- book.toml


def test_book_toml_is_an_mdbook_config():
    book = book_toml()["book"]
    assert isinstance(book["title"], str) and book["title"]
    assert isinstance(book["authors"], list) and book["authors"] and all(isinstance(a, str) and a for a in book["authors"])
    assert book["language"] == "en"
    assert isinstance(book["src"], str) and book["src"]
    assert book["title"] == "Lightning Attention, from the Math to the Kernel"
    assert readme().splitlines()[0] == f"# {book['title']}"


def test_book_toml_chapters_are_numbered_in_order():
    entries = book_toml()["lightning-edu"]["chapters"]
    files = [e["file"] for e in entries]
    assert len(set(files)) == len(files)
    numbers = [int(f.split("_", 1)[0]) for f in files]
    assert numbers == list(range(len(files))), f"chapter numbers must run 0, 1, 2, ... in order, got {numbers}"
    for e in entries:
        assert re.fullmatch(r"\d\d_[a-z0-9_]+\.ipynb", e["file"]), e["file"]
        assert e["title"].strip() == e["title"] and e["title"]
    # lightning_edu.book reads the same list, in the same order.
    assert [c.file for c in chapters(ROOT)] == files
    assert [c.title for c in chapters(ROOT)] == [e["title"] for e in entries]


def test_every_notebook_is_listed_in_book_toml():
    table = book_toml()["lightning-edu"]
    listed = {e["file"] for e in table["chapters"]}
    on_disk = {p.name for p in (ROOT / table["notebook-dir"]).glob("*.ipynb")}
    assert not on_disk - listed, f"notebooks not listed in book.toml: {sorted(on_disk - listed)}"


def test_every_listed_notebook_exists():
    # One failure naming every missing file; tests/test_notebook_format.py has one test per chapter as well.
    missing = [c.file for c in chapters(ROOT) if not c.path.is_file()]
    assert not missing, f"book.toml lists notebooks that do not exist: {missing}"
