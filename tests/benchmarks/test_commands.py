"""Every measuring driver runs as ``python -m benchmarks.<name>`` from the repository root, and every command a record
under notebooks/data names can be run again today, through book.MOVED where its module has moved."""

from __future__ import annotations

import importlib.util
import pkgutil
import re
import runpy
import sys

import pytest

import benchmarks
from lightning_edu.book import MOVED, current_command, describe_recorded, load_recorded, repo_root

RECORDS = sorted((repo_root() / "notebooks" / "data").glob("*.json"))
# The drivers: each benchmarks module with a __main__ block (common.py and two_ways.py are what drivers share).
DRIVERS = sorted(m.name for m in pkgutil.iter_modules(benchmarks.__path__)
                 if "__main__" in (repo_root() / "benchmarks" / f"{m.name}.py").read_text())


def _modules(command: str) -> list[str]:
    return re.findall(r"-m ((?:lightning_edu|benchmarks)[\w.]*)", command)


def test_the_package_never_imports_the_benchmarks():
    for path in (repo_root() / "lightning_edu").rglob("*.py"):
        source = path.read_text()
        assert not re.search(r"^\s*(from|import) benchmarks\b", source, re.M), path


@pytest.mark.parametrize("record", RECORDS, ids=lambda p: p.stem)
def test_a_recorded_command_names_modules_that_run_today(record):
    data = load_recorded(record.stem)
    line, today = describe_recorded(data), current_command(data["command"])
    for old, new in zip(_modules(data["command"]), _modules(today)):
        if old != new:  # moved: the record's line says where it lives now
            assert MOVED[old] == new and f"{old} is {new} today" in line, (record.name, old)
        assert new.removeprefix("benchmarks.") in DRIVERS if new.startswith("benchmarks.") else \
            importlib.util.find_spec(new) is not None, (record.name, new)


def test_every_recorded_driver_and_every_driver_is_run_below():
    recorded = {m.removeprefix("benchmarks.") for r in RECORDS for m in _modules(current_command(load_recorded(r.stem)["command"]))
                if m.startswith("benchmarks.")}
    assert recorded and recorded <= set(DRIVERS)


@pytest.mark.parametrize("driver", DRIVERS)
def test_python_m_driver_help_prints_its_usage_and_writes_nothing(driver, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [f"benchmarks.{driver}", "--help"])
    with pytest.raises(SystemExit) as exc:  # as `python -m benchmarks.<driver> --help` runs it
        runpy.run_module(f"benchmarks.{driver}", run_name="__main__", alter_sys=True)
    assert exc.value.code in (0, None)
    assert f"benchmarks.{driver}" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []  # "--help" was not taken for the output file
