"""``python -m lightning_edu.book COMMAND``: the book's table of contents, headlines, website and results page.

* (nothing) or ``table``: print the README's chapter table (from book.toml);
* ``headline``: print the README's table of headline results (read from the records in notebooks/data/);
* ``summary``: write mdBook's sources (one Markdown page per chapter, SUMMARY.md) into book.toml's ``src``;
* ``build``: build the book as a website into book.toml's ``build-dir`` (see :mod:`lightning_edu.book.site`): the
  students' edition (the exercises as nbgrader releases them); ``--instructor``: the instructors' edition, with the
  model answers and hidden tests, into that folder with ``-instructor`` added;
* ``results``: write the page of every measured record (:mod:`lightning_edu.book.results`) as Markdown, to
  ``build/results.md`` or ``--out PATH``;
* ``install-katex``: install the pinned KaTeX that typesets the website's math (``.ci/setup`` runs it).
"""

import sys
from pathlib import Path

from . import chapter_table, write_mdbook_sources

USAGE = ("usage: python -m lightning_edu.book "
         "[table | headline | summary | build [--instructor] | results [--out PATH] | install-katex]")
COMMANDS = ("table", "headline", "summary", "build", "results", "install-katex")


def _shown(path: Path) -> Path:
    try:
        return path.relative_to(Path.cwd())
    except ValueError:
        return path


def _options(command: str, rest: list[str]) -> dict | None:
    """The options of ``command`` from the arguments after it; None when they are not its options."""
    if command == "build":
        if rest in ([], ["--instructor"]):
            return {"instructor": bool(rest)}
        return None
    if command == "results":
        if not rest:
            return {"out": None}
        if len(rest) == 2 and rest[0] == "--out":
            return {"out": rest[1]}
        if len(rest) == 1 and rest[0].startswith("--out="):
            return {"out": rest[0].removeprefix("--out=")}
        return None
    return {} if not rest else None


def main(argv: list[str]) -> int:
    command = argv[0] if argv else "table"
    options = _options(command, argv[1:]) if command in COMMANDS else None
    if options is None:
        print(USAGE, file=sys.stderr)
        return 2
    if command == "table":
        print(chapter_table())
        return 0
    if command == "headline":
        from .results import headline_table

        print(headline_table())
        return 0
    if command == "results":
        from .results import write_results

        print(f"wrote {_shown(write_results(options['out']))}")
        return 0
    from .site import SiteBuildError, build_site, install_katex

    try:
        if command == "summary":
            print(write_mdbook_sources())
        elif command == "build":
            out = _shown(build_site(instructor=options["instructor"]))
            print(f"open {out / 'index.html'} in a browser, or serve it: python -m http.server -d {out}")
        else:
            print(install_katex())
    except SiteBuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
