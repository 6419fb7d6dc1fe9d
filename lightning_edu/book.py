"""The book's table of contents, read from ``book.toml`` (the one place that declares chapter order).

``python -m lightning_edu.book`` prints the README's chapter table; ``python -m lightning_edu.book summary``
writes the mdBook ``SUMMARY.md`` (with each notebook converted to Markdown by nbconvert) into the
``src`` folder that book.toml names, so ``mdbook build`` renders the executed notebooks.
"""

from __future__ import annotations

import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Chapter", "repo_root", "load_config", "chapters", "chapter_table"]


@dataclass(frozen=True)
class Chapter:
    number: int
    file: str
    title: str
    path: Path


def repo_root() -> Path:
    """The folder holding book.toml (the repository root in a source checkout)."""
    here = Path(__file__).resolve().parent.parent
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


def chapter_table(root: Path | None = None) -> str:
    """The Markdown table of chapters that README.md carries (a test keeps the two in step)."""
    lines = ["| # | Chapter | Notebook |", "|---|---|---|"]
    for ch in chapters(root):
        lines.append(f"| {ch.number:02d} | {ch.title} | [`notebooks/{ch.file}`](notebooks/{ch.file}) |")
    return "\n".join(lines)


def write_mdbook_sources(root: Path | None = None) -> Path:
    """Convert every chapter to Markdown under book.toml's ``src`` and write SUMMARY.md there."""
    import nbformat
    from nbconvert import MarkdownExporter

    root = root or repo_root()
    src = root / load_config(root)["book"]["src"]
    src.mkdir(parents=True, exist_ok=True)
    summary = ["# Summary", ""]
    exporter = MarkdownExporter()
    for ch in chapters(root):
        body, resources = exporter.from_notebook_node(nbformat.read(ch.path, as_version=4))
        name = ch.file.replace(".ipynb", ".md")
        (src / name).write_text(body)
        for fname, data in resources.get("outputs", {}).items():
            (src / fname).write_bytes(data)
        summary.append(f"- [{ch.title}](./{name})")
    (src / "SUMMARY.md").write_text("\n".join(summary) + "\n")
    return src


if __name__ == "__main__":
    if sys.argv[1:] == ["summary"]:
        print(write_mdbook_sources())
    else:
        print(chapter_table())
