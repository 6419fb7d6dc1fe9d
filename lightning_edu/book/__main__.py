"""``python -m lightning_edu.book`` prints the README's chapter table; ``... summary`` writes mdBook's sources."""

import sys

from . import chapter_table, write_mdbook_sources

if sys.argv[1:] == ["summary"]:
    print(write_mdbook_sources())
else:
    print(chapter_table())
