"""``python -m lightning_edu.book [table | summary | build | install-katex]``.

* (nothing) or ``table``: print the README's chapter table (from book.toml);
* ``summary``: write mdBook's sources (one Markdown page per chapter, SUMMARY.md) into book.toml's ``src``;
* ``build``: build the book as a website into book.toml's ``build-dir`` (see :mod:`lightning_edu.book.site`);
* ``install-katex``: install the pinned KaTeX that typesets the website's math (``.ci/setup`` runs it).
"""

import sys
from pathlib import Path

from . import chapter_table, write_mdbook_sources

COMMANDS = ("table", "summary", "build", "install-katex")


def main(argv: list[str]) -> int:
    command = argv[0] if argv else "table"
    if len(argv) > 1 or command not in COMMANDS:
        print(f"usage: python -m lightning_edu.book [{' | '.join(COMMANDS)}]", file=sys.stderr)
        return 2
    if command == "table":
        print(chapter_table())
        return 0
    from .site import SiteBuildError, build_site, install_katex

    try:
        if command == "summary":
            print(write_mdbook_sources())
        elif command == "build":
            out = build_site()
            try:
                out = out.relative_to(Path.cwd())
            except ValueError:
                pass
            print(f"open {out / 'index.html'} in a browser, or serve it: python -m http.server -d {out}")
        else:
            print(install_katex())
    except SiteBuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
