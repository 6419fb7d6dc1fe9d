"""The results page (``python -m lightning_edu.book results``) and README's headline table, against the records.

Every expected figure here is read from notebooks/data/*.json with ``json`` directly, not through the code under
test: the page must list every record, and the figures it prints must be the records' own.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lightning_edu.book import results
from lightning_edu.book.__main__ import main

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "notebooks" / "data"
LIBRARIES = ("fla_chunk", "fla_fused_chunk", "original", "sdpa_cudnn", "sdpa_flash")


def record(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def page() -> str:
    return results.results_page(ROOT)


def section(page: str, name: str) -> str:
    start = page.index(f"\n## {name}\n")
    end = page.find("\n## ", start + 1)
    return page[start:end if end > 0 else len(page)]


def table_row(text: str, first_cell: str) -> str:
    rows = [line for line in text.splitlines() if line.startswith(f"| {first_cell} |")]
    assert rows, f"no table row starting with {first_cell!r}"
    return rows[0]


def test_the_page_lists_every_record(page):
    names = sorted(p.stem for p in DATA.glob("*.json"))
    assert names, "notebooks/data/ holds no record"
    headings = re.findall(r"^## (\S+)$", page, flags=re.M)
    assert [h for h in headings if h in names] == names, "every record, once, in name order"
    for name in names:
        data = record(name)
        text = section(page, name)
        assert f"({name}.json)" in text or f"/{name}.json)" in text, f"{name}: no link to its record"
        assert data["machine"] in text and data["command"] in text, f"{name}: machine or command missing"
        if data.get("commit"):
            assert f"commit {data['commit'].partition('+')[0][:12]}" in text, f"{name}: commit missing"
        assert f"[{name}](#{name})" in page, f"{name} is not in the index"


def test_a_benchmark_figure_is_the_records(page):
    data = record("anchors_h200_d128")
    rows = data["results"]
    T = 32768
    ours = next(r for r in rows if r["method"] == "triton" and r["T"] == T)
    best = min((r for r in rows if r["method"] in LIBRARIES and r["T"] == T), key=lambda r: r["fwdbwd_ms"])
    row = table_row(section(page, "anchors_h200_d128"), "32K")
    assert f"{ours['fwdbwd_ms']:.3f}" in row and f"{ours['fwd_ms']:.3f}" in row
    assert f"{best['fwdbwd_ms'] / ours['fwdbwd_ms']:.2f}x (`{best['method']}`)" in row


def test_the_gpu_check_figures_are_the_records(page):
    data = record("gpu_check_h200")
    text = section(page, "gpu_check_h200")
    for step in ("tests", "notebooks"):
        r = data["results"][step]
        assert f"{r['passed']} of {r['tests']}" in table_row(text, step)
    assert ("every test and every cell passed" in text) == bool(data["passed"])


@pytest.mark.parametrize("name", ["decode_h100", "decode_h200"])
def test_decoding_figures_are_the_records(page, name):
    data = record(name)
    r = next(r for r in data["results"] if r["method"] == "ours kernel" and r["batch"] == 256)
    timed = f"{r['ms'] * 1000:.1f} ({r['graph_ms'] * 1000:.1f})"
    cell = f"{r['loop_ms'] * 1000:.1f} / {timed}" if "loop_ms" in r else timed
    assert cell in table_row(section(page, name), "256")


def test_readme_carries_the_headline_table():
    readme = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- results:begin -->\n(.*?)\n<!-- results:end -->", readme, flags=re.S)
    assert match, "README.md lacks the <!-- results:begin --> ... <!-- results:end --> block"
    assert match.group(1).strip() == results.headline_table(ROOT), (
        "README's headline table is out of step with the records; regenerate it with "
        "`python -m lightning_edu.book headline`"
    )


def test_headline_figures_are_the_records():
    table = results.headline_table(ROOT)
    for D in (128, 64):
        data = record(f"anchors_h200_d{D}")
        ratios = []
        for T in sorted({r["T"] for r in data["results"]}):
            ours = next(r for r in data["results"] if r["method"] == "triton" and r["T"] == T)
            best = min(r["fwdbwd_ms"] for r in data["results"] if r["method"] in LIBRARIES and r["T"] == T)
            ratios.append(best / ours["fwdbwd_ms"])
        row = next(line for line in table.splitlines() if f"D = {D}," in line)
        assert f"{min(ratios):.2f}x to {max(ratios):.2f}x" in row and f"anchors_h200_d{D}.json" in row
    check = record("gpu_check_h200")["results"]
    row = next(line for line in table.splitlines() if "gpu_check_h200.json" in line)
    assert f"{check['tests']['passed']} of {check['tests']['tests']} GPU tests passed" in row
    assert f"{check['notebooks']['passed']} of {check['notebooks']['tests']} chapter cells passed" in row
    dec = record("decode_h200")["results"]  # the newest decoding record
    ours = next(r for r in dec if r["method"] == "ours kernel" and r["batch"] == 256)
    sdpa = max(r["graph_tokens_per_s"] for r in dec if r["batch"] == 256 and r.get("context") == 4096
               and "graph_tokens_per_s" in r)
    row = next(line for line in table.splitlines() if "decode_h200.json" in line)
    assert f"{ours['graph_tokens_per_s'] / sdpa:.1f}x" in row and f"{ours['graph_tokens_per_s'] / 1e6:.2f}M" in row


def test_results_command_writes_the_page_with_links_that_resolve(tmp_path, capsys):
    out = tmp_path / "sub" / "results.md"
    assert main(["results", "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    text = out.read_text()
    assert text.startswith("# Measured results\n")
    links = re.findall(r"\]\(([^)#\s]+)\)", text)
    assert any(link.endswith(".json") for link in links) and any(link.endswith(".ipynb") for link in links)
    missing = sorted({link for link in links if "://" not in link and not (out.parent / link).exists()})
    assert not missing, f"links that resolve to nothing from {out}: {missing[:5]}"


@pytest.mark.parametrize("argv", [["results", "--out"], ["results", "x.md"], ["build", "--teacher"],
                                  ["table", "--instructor"], ["headline", "x"], ["nonsense"]])
def test_the_command_line_refuses_what_it_does_not_take(argv, capsys):
    assert main(argv) == 2
    assert "usage:" in capsys.readouterr().err
