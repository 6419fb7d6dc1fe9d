"""The book's own tools: the table of contents (:mod:`.toc`, re-exported here), the notebook helpers (here), the
figures' style (:mod:`.plots`) and the widgets with their static twins (:mod:`.decay_view`, :mod:`.explorer`).

The table of contents is read from ``book.toml``, the one place that declares chapter order.
``python -m lightning_edu.book`` prints the README's chapter table; ``python -m lightning_edu.book build`` builds
the book as a website (every executed notebook, rendered by mdBook into book.toml's ``build-dir``; see
:mod:`.site`), and ``... summary`` writes only mdBook's Markdown sources and ``SUMMARY.md``.
"""

from __future__ import annotations

from pathlib import Path

from .toc import Chapter, chapters, load_config, repo_root

__all__ = [
    "Chapter", "repo_root", "load_config", "chapters", "chapter_table",
    "setup_notebook", "show_source", "load_recorded", "describe_recorded", "recorded_series", "tensor_maker",
    "RECORDED_NAMES", "method_name", "with_current_names", "MOVED", "current_command",
]


def chapter_table(root: Path | None = None) -> str:
    """The Markdown table of chapters that README.md carries (a test keeps the two in step)."""
    lines = ["| # | Chapter | Notebook |", "|---|---|---|"]
    for ch in chapters(root):
        lines.append(f"| {ch.number:02d} | {ch.title} | [`notebooks/{ch.file}`](notebooks/{ch.file}) |")
    return "\n".join(lines)


def write_mdbook_sources(root: Path | None = None) -> Path:
    """Write every chapter as Markdown under book.toml's ``src``, with SUMMARY.md, and return that folder.

    Each page carries its notebook's stored outputs (figures as files beside it), its math typeset by KaTeX,
    and a line on how to open the live notebook; :func:`lightning_edu.book.site.write_sources` does the work
    and ``python -m lightning_edu.book build`` then runs mdBook over it.
    """
    from .site import write_sources

    return write_sources(root)


def setup_notebook() -> str:
    """First code cell of every chapter: configure and report where code runs. Returns "cuda" or "cpu".

    Importing lightning_edu sets TRITON_INTERPRET=1 when there is no CUDA device, before any Triton
    kernel is defined, so kernels run in Triton's CPU interpreter (fp32/fp16 only there).
    """
    import os

    import matplotlib.pyplot as plt
    import numpy as np
    import torch

    import lightning_edu  # noqa: F401  (configures the interpreter)

    np.set_printoptions(precision=4, suppress=False, linewidth=100)
    plt.rcParams.update({"figure.dpi": 100, "savefig.dpi": 100, "axes.titlesize": 11, "font.size": 10})
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mode = "GPU kernels" if device == "cuda" else f"Triton CPU interpreter (TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')})"
    print(f"device: {device}; Triton runs as: {mode}")
    return device


def show_source(obj) -> object:
    """Display the source of a package function or class, syntax-highlighted (the book never copies code)."""
    import inspect

    from IPython.display import Code

    return Code(inspect.getsource(obj), language="python")


def load_recorded(name: str, root: Path | None = None) -> dict:
    """A recorded GPU measurement from notebooks/data/<name>.json (machine, command, date, results)."""
    import json

    root = root or repo_root()
    path = root / load_config(root)["lightning-edu"]["notebook-dir"] / "data" / f"{name}.json"
    with open(path) as f:
        data = json.load(f)
    for key in ("machine", "command", "date", "results"):
        if key not in data:
            raise ValueError(f"{path} lacks the key {key!r}: recorded data must say where and how it was measured")
    return data


# Where a recorded command's module or folder lives today, for records made before it moved. The measuring drivers
# moved out of the package into the repository's benchmarks/ folder: run them from the repository root.
_DRIVERS = ("bench", "decode", "drift", "figure3", "first_call", "host", "kernels", "la3_sweep", "lookback", "prepass",
            "quality", "redo", "segments", "slices", "tgs", "tma", "torch_sweep", "two_ways")
MOVED = {
    "lightning_edu.bench": "benchmarks.bench",
    "lightning_edu.torch_sweep": "benchmarks.torch_sweep",
    **{f"lightning_edu.perf.{name}": f"benchmarks.{name}" for name in _DRIVERS},
    "tests/gpu": "tests (the GPU tests carry the marker gpu: python -m pytest -m gpu tests)",
}


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package that no longer exists
        return False


def _gone(old: str, command: str) -> bool:
    """Whether ``command`` names the module or folder ``old`` (a key of :data:`MOVED`) and it no longer exists."""
    import re

    if "/" in old:
        return bool(re.search(rf"(?<![\w/]){re.escape(old)}(?![\w])", command)) and not (repo_root() / old).exists()
    return bool(re.search(rf"-m {re.escape(old)}(?![\w.])", command)) and not _importable(old)


def _moved(command: str) -> list[str]:
    """The notes "X is Y today" for the names of ``command`` that :data:`MOVED` lists and that no longer exist."""
    return [f"{old} is {new} today" for old, new in MOVED.items() if _gone(old, command)]


def current_command(command: str) -> str:
    """``command`` with each module :data:`MOVED` lists (and that no longer exists) replaced by where it lives
    today: the command to run again, from the repository root."""
    import re

    for old, new in MOVED.items():
        if "/" not in old and _gone(old, command):
            command = re.sub(rf"-m {re.escape(old)}(?![\w.])", f"-m {new}", command)
    return command


def describe_recorded(data: dict) -> str:
    """One line naming where a recorded measurement came from, printed above its plot: the machine, the date, the
    versions, the commit and the command; for a record made before a module or folder it names moved, where that
    lives today (:data:`MOVED`), so that the command can be run again."""
    facts = [f"{k} {data[k]}" for k in ("torch", "triton", "driver") if k in data]
    if data.get("commit"):  # a short hash, and whatever follows it ("+local changes": measured off a commit)
        sha, _, rest = data["commit"].partition("+")
        facts.append(f"commit {sha[:12]}" + (f" + {rest.strip()}" if rest else ""))
    else:  # the earliest records named no commit
        facts.append("commit not recorded")
    facts = f" ({', '.join(facts)})" if facts else ""
    moved = _moved(data["command"])
    moved = f" [{'; '.join(moved)}]" if moved else ""
    return f"Recorded on {data['machine']} on {data['date']}{facts} by: {data['command']}{moved}"


def recorded_series(rows, method: str, key: str, *, x: str = "T", **where):
    """(x values, ``key`` values) of one method from recorded or live result rows, in increasing x.

    ``rows`` is a list of dicts (a record's ``results``, or a sweep); rows of other methods, rows that fail
    a ``where`` filter (e.g. ``D=128``) and rows without ``key`` (a failed or skipped point) are left out.
    Returns two numpy arrays, empty when nothing matches.
    """
    import numpy as np

    picked = sorted((r for r in rows if r.get("method") == method and key in r
                     and all(r.get(k) == v for k, v in where.items())), key=lambda r: r[x])
    return np.array([r[x] for r in picked]), np.array([r[key] for r in picked])


def tensor_maker(device: str):
    """A converter numpy -> torch tensor on ``device`` (float32 unless a dtype is given), for the kernel chapters."""
    import torch

    def to_tensor(x, dtype=torch.float32):
        return torch.tensor(x, dtype=dtype, device=device)

    return to_tensor


# Names that recorded files (notebooks/data/bench_*.json) and their commands use for our kernels, and the
# registry names they stand for today. The one place an old name is translated; no name is ever parsed.
RECORDED_NAMES = {
    "la1": "triton.la1",
    "la2_literal": "triton.la2_literal",
    "la2_fast_noseg": "triton.la2_fast.one_segment",
    "la2_fast_nosave": "triton.la2_fast.no_state_reuse",
    "la2_fast_fused_bwd": "triton.la2_fast.fused_dkdv",
}


def method_name(name: str) -> str:
    """The current name of a method, given a current name or one from :data:`RECORDED_NAMES`."""
    return RECORDED_NAMES.get(name, name)


def with_current_names(data: dict) -> dict:
    """A copy of a recorded benchmark (``python -m benchmarks.bench --out``) under current names."""
    out = dict(data)
    out["results"] = [{**r, "method": method_name(r["method"])} if "method" in r else r for r in data["results"]]
    for key in ("correctness_rel_err", "unavailable"):
        if key in data:
            out[key] = {method_name(name): value for name, value in data[key].items()}
    return out
