"""The table of contents: book.toml's chapters in book order, and where the repository root is.

It sits in a module of its own, below the rest of :mod:`lightning_edu.book`, because both the package's
notebook helpers and the website builder (:mod:`.site`) need it, and the package in turn hands its build
command to :mod:`.site`. Import these names from :mod:`lightning_edu.book`, which re-exports them.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Chapter", "repo_root", "load_config", "chapters"]


@dataclass(frozen=True)
class Chapter:
    number: int
    file: str
    title: str
    path: Path


def repo_root() -> Path:
    """The folder holding book.toml (the repository root in a source checkout)."""
    here = Path(__file__).resolve().parents[2]
    for candidate in (here, Path.cwd(), *Path.cwd().parents):
        if (candidate / "book.toml").exists():
            return candidate
    raise FileNotFoundError("book.toml not found next to the package or above the working directory")


def load_config(root: Path | None = None) -> dict:
    root = root or repo_root()
    with open(root / "book.toml", "rb") as f:
        return tomllib.load(f)


def chapters(root: Path | None = None) -> list[Chapter]:
    """Chapters in book order, as book.toml's [lightning-edu] table lists them."""
    root = root or repo_root()
    table = load_config(root)["lightning-edu"]
    folder = root / table["notebook-dir"]
    out = []
    for entry in table["chapters"]:
        number = int(entry["file"].split("_", 1)[0])
        out.append(Chapter(number, entry["file"], entry["title"], folder / entry["file"]))
    return out
