"""A real browser: JupyterLab runs the book's sliders (chapters 03, 04 and 11) in Debian's Chromium, and they redraw.

Starts JupyterLab from .venv on a random loopback port (no token) over a temporary copy of the
notebook, opens it in /usr/bin/chromium through Playwright (never Playwright's own browser download),
runs all cells from the Run menu, focuses the explorer's block-size slider, presses ArrowRight, and
asserts that the readout and the plot change. A second test runs chapter 11's feature explorer and chapter 03's
decay explorer from a small notebook written into the same server's folder, moves their sliders with the
keyboard and picks the learned map in the feature explorer's dropdown. Screenshots go to test-artifacts/ (git-ignored). One JupyterLab serves the whole module.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "04_intra_inter_blocks.ipynb"
CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's chromium is not installed at /usr/bin/chromium (apt-get install chromium; .ci/setup does it as root)"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_settings(folder: Path) -> None:
    # Keep every cell in the DOM (no virtual scrolling) and keep JupyterLab off the network.
    settings = {
        "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false", "checkForUpdates": False},
    }
    for name, value in settings.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))


def _wait_for_server(url: str, proc: subprocess.Popen, log: Path, timeout: float = 40.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"jupyter lab exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "api/status", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"jupyter lab did not answer within {timeout} s:\n{log.read_text()[-3000:]}")


def _wait_for_a_new_image(page, selector: str, old_src: str) -> None:
    """Wait (30 s at most) until the first image matching ``selector`` shows another picture than ``old_src``."""
    page.wait_for_function(
        "([sel, old]) => { const img = document.querySelector(sel); return img && img.src && img.src !== old; }",
        arg=[selector, old_src],
        timeout=30_000,
    )


@pytest.fixture(scope="module")
def jupyter_server(tmp_path_factory):
    """A JupyterLab server over a temporary folder holding a copy of chapter 04; yields (base URL, that folder).

    Module-scoped: every test of this file talks to the same server (JupyterLab starts once)."""
    tmp_path = tmp_path_factory.mktemp("jupyter")
    root = tmp_path / "root"
    root.mkdir()
    shutil.copy(NOTEBOOK, root / NOTEBOOK.name)
    _write_settings(tmp_path / "settings")
    port = _free_port()
    env = dict(
        os.environ,
        JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "settings"),
        JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"),
        JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
    )
    log = tmp_path / "jupyter.log"
    jupyter = Path(sys.executable).parent / "jupyter"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                str(jupyter), "lab", "--allow-root", "--no-browser", "--ServerApp.token=", "--ServerApp.password=",
                "--ip=127.0.0.1", f"--port={port}", "--ServerApp.port_retries=0", f"--ServerApp.root_dir={root}",
                "--LabApp.news_url=", "--ServerApp.open_browser=False",
            ],
            cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        url = f"http://127.0.0.1:{port}/"
        _wait_for_server(url, proc, log)
        yield url, root
    finally:
        # The server was started in its own session: stop it and the kernel it started, by that group id.
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=5)


@pytest.fixture(scope="module")
def jupyter_lab(jupyter_server):
    """The base URL of the module's JupyterLab server."""
    return jupyter_server[0]


def test_block_size_slider_redraws_explorer_in_chromium(jupyter_lab):
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import expect, sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    started = time.monotonic()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(60_000)
            page.goto(jupyter_lab + "lab/tree/" + NOTEBOOK.name)
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
            indicator = page.locator(".jp-Notebook-ExecutionIndicator")
            # the status bar names the kernel once it is connected and idle
            expect(page.get_by_role("button", name=re.compile(r"Python 3 \(ipykernel\) \| Idle"))).to_be_visible(timeout=60_000)
            expect(indicator).to_have_attribute("data-status", "idle", timeout=60_000)

            for attempt in range(3):  # a click that lands while the page still settles is retried
                page.locator(".jp-Notebook").first.click(position={"x": 5, "y": 5})
                page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
                page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
                try:
                    page.wait_for_function(
                        "() => [...document.querySelectorAll('.jp-InputPrompt')].some(p => /\\[(\\*|\\d+)\\]/.test(p.textContent))",
                        timeout=15_000,
                    )
                    break
                except PlaywrightTimeout:
                    page.keyboard.press("Escape")
            else:
                raise AssertionError("Run > Run All Cells started no cell in three attempts")

            readout = page.locator(".lightning-explorer-readout").last
            expect(readout).to_contain_text("B = 64,", timeout=60_000)
            # the last cell's check prints this once everything above has run
            expect(page.get_by_text("Correct: Algorithm 1 matches the package")).to_be_attached(timeout=90_000)
            expect(indicator).to_have_attribute("data-status", "idle", timeout=30_000)

            slider = page.locator(".lightning-explorer-block-size").first
            slider.scroll_into_view_if_needed()
            explorer_box = slider.locator("xpath=ancestor::div[contains(@class, 'jp-OutputArea-output')][1]")
            image = page.locator(".lightning-explorer-plot").first
            src_before = image.get_attribute("src")
            text_before = readout.inner_text()
            shot_before = explorer_box.screenshot()
            assert src_before, "the explorer's plot image has no src"

            handle = slider.locator(".noUi-handle").first
            handle.focus()
            page.keyboard.press("ArrowRight")

            expect(readout).to_contain_text("B = 128,", timeout=30_000)
            _wait_for_a_new_image(page, ".lightning-explorer-plot", src_before)
            page.wait_for_timeout(500)  # let the new image paint before the screenshot
            text_after = readout.inner_text()
            shot_after = explorer_box.screenshot()
            explorer_box.screenshot(path=str(ARTIFACTS / "ch04_explorer_after_arrow_right.png"))
            page.screenshot(path=str(ARTIFACTS / "ch04_jupyterlab.png"))
        finally:
            browser.close()
    assert "B = 64," in text_before and "B = 128," in text_after
    assert text_after != text_before
    assert shot_after != shot_before, "the output area looks the same after moving the slider"
    assert time.monotonic() - started < 150


def test_feature_explorer_and_decay_explorer_sliders_redraw_in_chromium(jupyter_server):
    """Chapter 11's feature explorer and chapter 03's decay explorer in a small notebook of their own (one cell, one
    kernel start): the feature explorer's decay slider, moved with the keyboard, redraws its plot; choosing the
    learned map in the dropdown enables the d' slider and redraws again; the decay explorer's slider, moved with
    the keyboard, redraws its plot."""
    import nbformat
    from playwright.sync_api import expect, sync_playwright

    url, root = jupyter_server
    name = "feature_explorer_check.ipynb"
    notebook = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell("from IPython.display import display\n"
                                         "from lightning_edu.book.decay_view import decay_explorer\n"
                                         "from lightning_edu.book.feature_view import feature_explorer\n"
                                         "display(decay_explorer())\nfeature_explorer()")],
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}},
    )
    nbformat.write(notebook, root / name)
    ARTIFACTS.mkdir(exist_ok=True)
    started = time.monotonic()
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.set_default_timeout(60_000)
                # ?reset: a fresh workspace, not the layout the test before left (chapter 04 open beside it)
                page.goto(url + "lab/tree/" + name + "?reset")
                panel = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)").first
                panel.locator(".jp-Cell").first.wait_for(timeout=60_000)
                indicator = page.locator(".jp-Notebook-ExecutionIndicator")
                expect(page.get_by_role("button", name=re.compile(r"Python 3 \(ipykernel\) \| Idle"))).to_be_visible(timeout=60_000)
                expect(indicator).to_have_attribute("data-status", "idle", timeout=60_000)

                # run the one cell: select it, then Shift+Enter (retried if the page was still settling)
                image = page.locator(".lightning-feature-plot img").first
                for attempt in range(3):
                    panel.locator(".jp-Cell .jp-InputArea-editor").first.click()
                    page.keyboard.press("Shift+Enter")
                    try:
                        expect(image).to_be_visible(timeout=30_000)
                        break
                    except AssertionError:
                        page.keyboard.press("Escape")
                else:
                    raise AssertionError("the feature explorer's plot did not appear after three attempts to run the cell")
                expect(indicator).to_have_attribute("data-status", "idle", timeout=30_000)

                decay = page.locator(".lightning-feature-decay").first
                d_feature = page.locator(".lightning-feature-d-feature").first
                decay.scroll_into_view_if_needed()
                explorer_box = decay.locator("xpath=ancestor::div[contains(@class, 'jp-OutputArea-output')][1]")
                expect(decay).to_contain_text("1")  # the readout of lambda, the last choice
                expect(d_feature.locator(".noUi-target")).to_have_attribute("disabled", re.compile(".*"))
                src_before = image.get_attribute("src")
                assert src_before, "the feature explorer's plot image has no src"
                shot_before = explorer_box.screenshot()

                # lambda = 1 is the last choice: ArrowLeft moves to 0.99, released at once (a key press)
                decay.locator(".noUi-handle").first.focus()
                page.keyboard.press("ArrowLeft")
                expect(decay.locator(".widget-readout")).to_have_text("0.99", timeout=30_000)
                _wait_for_a_new_image(page, ".lightning-feature-plot img", src_before)
                page.wait_for_timeout(500)  # let the new image paint before the screenshot
                shot_after = explorer_box.screenshot()
                explorer_box.screenshot(path=str(ARTIFACTS / "ch11_feature_explorer_after_arrow_left.png"))

                # the dropdown: the learned map enables d' and redraws
                src_decay = page.locator(".lightning-feature-plot img").first.get_attribute("src")
                page.locator(".lightning-feature-map select").first.select_option("learned relu2")
                _wait_for_a_new_image(page, ".lightning-feature-plot img", src_decay)
                expect(d_feature.locator(".noUi-target")).not_to_have_attribute("disabled", re.compile(".*"), timeout=10_000)
                page.wait_for_timeout(500)
                explorer_box.screenshot(path=str(ARTIFACTS / "ch11_feature_explorer_learned.png"))
                page.screenshot(path=str(ARTIFACTS / "ch11_jupyterlab.png"))

                # chapter 03: lambda = 0.875 moves to the next choice, 0.9375, and the mask redraws
                slider = page.locator(".lightning-decay-slider").first
                slider.scroll_into_view_if_needed()
                expect(slider.locator(".widget-readout")).to_have_text("0.875")
                decay_src = page.locator(".lightning-decay-plot img").first.get_attribute("src")
                assert decay_src, "the decay explorer's plot image has no src"
                slider.locator(".noUi-handle").first.focus()
                page.keyboard.press("ArrowRight")
                expect(slider.locator(".widget-readout")).to_have_text("0.9375", timeout=30_000)
                _wait_for_a_new_image(page, ".lightning-decay-plot img", decay_src)
                page.wait_for_timeout(500)
                slider.locator("xpath=ancestor::div[contains(@class, 'jp-OutputArea-output')][1]").screenshot(
                    path=str(ARTIFACTS / "ch03_decay_explorer_after_arrow_right.png"))
            finally:
                browser.close()
    finally:
        (root / name).unlink(missing_ok=True)
    assert shot_after != shot_before, "the output area looks the same after moving the decay slider"
    assert time.monotonic() - started < 150
