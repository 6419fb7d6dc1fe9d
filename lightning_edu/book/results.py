"""Every measured record of the book on one page, generated from ``notebooks/data/*.json``, never typed by hand.

``python -m lightning_edu.book results [--out PATH]`` writes it as Markdown (``build/results.md`` by default), and
the website carries it as a page after the chapters (:mod:`.site`). For each record the page gives what it
measured (the first paragraph of its driver's docstring, where the command names one), the line
:func:`~lightning_edu.book.describe_recorded` prints above a chapter's plot (machine, date, versions, commit,
command), the record's own note, the chapters that mention it, and its headline figures: a table wherever the
record's layout is known (the benchmark's rows per head dim D and length T, in ms and as the best library's time
over ours; the GPU check's steps; decoding; training speed; quality; the paper's Figure 3), a short table or a
one-line summary otherwise.

:func:`headline_table` is the table of headline results that README.md carries between
``<!-- results:begin -->`` and ``<!-- results:end -->`` (``python -m lightning_edu.book headline`` prints it; a test
keeps the two in step), read from the latest records, like everything here.
"""

from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import current_command, describe_recorded, load_recorded, method_name
from .toc import Chapter, chapters, load_config, repo_root

__all__ = ["OURS", "LIBRARIES", "Links", "record_names", "records", "what_it_measured", "best_library",
           "headline_rows", "headline_table", "record_section", "results_page", "write_results", "DEFAULT_OUT"]

# The book's backend, and the libraries it is timed beside (the benchmark's anchors: they compute the same function,
# but for SDPA, which is softmax attention, the cost a model pays instead).
OURS = "triton"
LIBRARIES = ("fla_chunk", "fla_fused_chunk", "original", "sdpa_cudnn", "sdpa_flash")
METHODS = {
    "triton": "the book's backend, `lightning_attention(..., backend=\"triton\")`",
    "triton.la3": "the backend with chapter 09's recompute-heavy backward",
    "triton_user": "the backend called as a model calls it (validation and dispatch in every call)",
    "triton_pointers": "the backend with its tiles loaded through pointers instead of tensor descriptors (TMA)",
    "triton.la1": "Lightning Attention-1's kernel (chapter 08)",
    "triton.la2_literal": "Algorithm 1 and 2 written literally as kernels (chapters 07, 08)",
    "torch": "the chunk-parallel PyTorch rung (chapter 06)",
    "fla_chunk": "fla's `chunk_simple_gla` (flash-linear-attention)",
    "fla_fused_chunk": "fla's `fused_chunk_simple_gla`",
    "original": "the original Lightning Attention-2 implementation, `lightning_attn_func`",
    "sdpa_cudnn": "PyTorch's `scaled_dot_product_attention`, cuDNN backend (softmax attention)",
    "sdpa_flash": "PyTorch's `scaled_dot_product_attention`, FlashAttention backend (softmax attention)",
}
DEFAULT_OUT = Path("build") / "results.md"


@dataclass(frozen=True)
class Links:
    """Where the page points: a record's JSON file and a chapter, as the page's reader reaches them."""

    record: Callable[[str], str]
    chapter: Callable[[Chapter], str]


def _relative_links(root: Path, page: Path) -> Links:
    """Links from a page at ``page`` to the files of the repository at ``root``."""
    data = _data_dir(root)

    def rel(path: Path) -> str:
        return Path(os.path.relpath(path, page.parent)).as_posix()

    return Links(record=lambda name: rel(data / f"{name}.json"), chapter=lambda ch: rel(ch.path))


def _data_dir(root: Path) -> Path:
    return root / load_config(root)["lightning-edu"]["notebook-dir"] / "data"


def record_names(root: Path | None = None) -> list[str]:
    """The names of every record in notebooks/data/ (``NAME.json``), sorted."""
    return sorted(p.stem for p in _data_dir(root or repo_root()).glob("*.json"))


def records(root: Path | None = None) -> dict[str, dict]:
    """Every record, by name, read with :func:`~lightning_edu.book.load_recorded` (which refuses a record that does
    not say where and how it was measured)."""
    root = root or repo_root()
    return {name: load_recorded(name, root) for name in record_names(root)}


# ---------------------------------------------------------------- formatting


def _md(text) -> str:
    """Text for a Markdown paragraph or table cell: the characters Markdown or HTML would act on, escaped."""
    return re.sub(r"([\\`*<>|\[\]])", r"\\\1", " ".join(str(text).split()))


def _prose(text: str) -> str:
    """Markdown prose of our own (code spans kept) for a paragraph or a table cell: ``|`` and ``<`` escaped."""
    return re.sub(r"([|<>])", r"\\\1", " ".join(str(text).split()))


def _code(text: str) -> str:
    text = " ".join(str(text).split())
    ticks = "`" * (max((len(m) for m in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"


def _ms(x: float) -> str:
    return f"{x:.3f}" if x < 10 else f"{x:.2f}" if x < 100 else f"{x:.1f}"


def _num(x) -> str:
    """A number for a table: integers as they are, floats to four significant digits."""
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        return f"{x:.4g}"
    return _md(x)


def _tokens(n: int) -> str:
    """2048 -> 2K, 131072 -> 128K, 94208 -> 92K, 1000 -> 1000."""
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _duration(seconds: float) -> str:
    minutes, s = divmod(round(seconds), 60)
    return f"{minutes} min {s} s" if minutes else f"{seconds:.1f} s"


def _rate(x: float) -> str:
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}K" if x >= 1e3 else f"{x:.0f}"


def _table(header: list[str], rows: list[list[str]], align: str | None = None) -> str:
    align = align or "l" + "r" * (len(header) - 1)
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _date(data: dict) -> str:
    return str(data["date"]).split(" ")[0]


# ---------------------------------------------------------------- what a record measured


def _driver(command: str, root: Path) -> Path | None:
    """The Python file of the module ``command`` runs (``python -m benchmarks.bench ...``), where it exists."""
    match = re.search(r"-m ([A-Za-z_][\w.]*)", current_command(command))
    if not match:
        return None
    path = root.joinpath(*match.group(1).split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _first_paragraph(docstring: str) -> str:
    text = docstring.strip().split("\n\n")[0]
    text = re.sub(r":\w+:`~?([^`]+)`", lambda m: f"`{m.group(1).split('.')[-1]}`", text)  # :func:`x.y` -> `y`
    return " ".join(text.replace("``", "`").split())


# What a driver measured, where its docstring's first paragraph does not say it as a sentence on its own; the
# benchmark's --tune and --tiny modes measure something else than its default.
DESCRIPTIONS = {
    "benchmarks.bench": "Forward and forward + backward of the book's kernels beside the libraries a user would "
                        "otherwise call, timed on the GPU.",
    "benchmarks.bench --tune": "Tile sizes and warps swept for the backend's kernels (`--tune`), the GPU's time "
                               "alone by CUDA-graph replay.",
    "benchmarks.bench --tiny": "A tiny call (1 x 4 x 256 tokens) forward + backward timed by the host's clock "
                               "(`--tiny`): what the host costs a short call.",
    "benchmarks.drift": "How a float32 state drifts over a million tokens, for every input distribution, decay "
                        "(1 and 0.999), input dtype, update and state dtype. (Chapter 10.)",
    "benchmarks.torch_sweep": "The torch forms' time and peak memory against n (chapter 06).",
    "benchmarks.quality": "What linear attention costs in quality (chapter 13): a small language model and the "
                          "MQAR recall task, for every attention of a preset.",
    "lightning_edu.exercises.contest": "The kernel contest's starter submission, graded: correctness against "
                                       "float64 and speed beside the book's kernel (chapter 07).",
}


def what_it_measured(data: dict, root: Path | None = None) -> str:
    """One sentence (Markdown) on what a record measured: :data:`DESCRIPTIONS`, else its driver's docstring (first
    paragraph); for the GPU check and the GPU test suite, what they run."""
    root = root or repo_root()
    command = current_command(data["command"])
    if ".ci/gpu-check" in command:
        return ("The GPU check: the GPU test suite, then every chapter under nbval with CUDA "
                "(`bash .ci/gpu-check`, CONTRIBUTING.md).")
    if "pytest" in command:
        return "The GPU test suite (`python -m pytest -m gpu tests`): the cases that need CUDA."
    match = re.search(r"-m ([A-Za-z_][\w.]*)", command)
    if match:
        module = match.group(1)
        for flag in ("--tune", "--tiny"):
            if re.search(rf"(?<![\w-]){flag}(?![\w-])", command) and f"{module} {flag}" in DESCRIPTIONS:
                return DESCRIPTIONS[f"{module} {flag}"]
        if module in DESCRIPTIONS:
            return DESCRIPTIONS[module]
    path = _driver(command, root)
    if path is not None:
        doc = ast.get_docstring(ast.parse(path.read_text()))
        if doc:
            return _first_paragraph(doc)
    return "A measurement recorded by the command below."


def _mentions(root: Path) -> dict[str, list[Chapter]]:
    """Record name -> the chapters whose notebook mentions it (in code, text or output)."""
    names = record_names(root)
    # the longest first, so that bench_h100_d64_caller is not read as bench_h100_d64
    pattern = re.compile(r"(?<![\w])(" + "|".join(map(re.escape, sorted(names, key=len, reverse=True))) + r")(?![\w])")
    out: dict[str, list[Chapter]] = {name: [] for name in names}
    for ch in chapters(root):
        if ch.path.is_file() and names:
            for name in sorted(set(pattern.findall(ch.path.read_text()))):
                out[name].append(ch)
    return out


# ---------------------------------------------------------------- layouts


def _is_bench(data: dict) -> bool:
    rows = data["results"]
    return (isinstance(rows, list) and bool(rows) and all(isinstance(r, dict) for r in rows)
            and all({"method", "T", "D"} <= r.keys() for r in rows)
            and any(k in rows[0] for k in ("fwdbwd_ms", "fwdbwd_wall_ms")))


def best_library(rows: list[dict], D: int, T: int, key: str = "fwdbwd_ms") -> tuple[str, float] | None:
    """(method, time) of the fastest library at (D, T) among benchmark rows (current names), or None."""
    found = [(method_name(r["method"]), r[key]) for r in rows
             if r["D"] == D and r["T"] == T and method_name(r["method"]) in LIBRARIES and key in r]
    return min(found, key=lambda m: m[1]) if found else None


def _row(rows: list[dict], method: str, D: int, T: int) -> dict | None:
    return next((r for r in rows if method_name(r["method"]) == method and r["D"] == D and r["T"] == T), None)


def _bench_tables(data: dict) -> str:
    """Per head dim D a table: per length T, ours forward, ours forward + backward, the best library's time over
    ours, then every other method's forward + backward (ms, the fastest of the row in bold)."""
    rows = data["results"]
    key = "fwdbwd_ms" if "fwdbwd_ms" in rows[0] else "fwdbwd_wall_ms"
    methods = list(dict.fromkeys(method_name(r["method"]) for r in rows))
    ours_first = OURS in methods
    if ours_first:
        methods = [OURS] + [m for m in methods if m != OURS]
    has_fwd = any(method_name(r["method"]) == OURS and "fwd_ms" in r for r in rows)
    clock = "timed by the host's clock" if key == "fwdbwd_wall_ms" else "timed on the GPU"
    out = []
    for D in sorted({r["D"] for r in rows}, reverse=True):
        sample = next(r for r in rows if r["D"] == D)
        shape = f"batch x heads = {sample.get('batch', '?')} x {sample.get('heads', '?')} at the first length"
        out.append(f"**D = {D}** ({sample.get('dtype', '')}, {shape}; forward + backward in ms, {clock}; the "
                   "fastest of each row in bold; \"best library / ours\" is the fastest library's time over ours, "
                   "above 1 where ours is faster):")
        header = ["T"] + (["ours, forward"] if has_fwd else []) + [f"`{m}`" for m in methods]
        if ours_first:
            header.insert(header.index(f"`{OURS}`") + 1, "best library / ours")
        body = []
        for T in sorted({r["T"] for r in rows if r["D"] == D}):
            cells = [_tokens(T)]
            ours = _row(rows, OURS, D, T)
            if has_fwd:
                cells.append(_ms(ours["fwd_ms"]) if ours and "fwd_ms" in ours else "-")
            times = {m: (_row(rows, m, D, T) or {}).get(key) for m in methods}
            fastest = min((t for t in times.values() if t is not None), default=None)
            for m in methods:
                t = times[m]
                cells.append("-" if t is None else f"**{_ms(t)}**" if t == fastest else _ms(t))
                if m == OURS:
                    best = best_library(rows, D, T, key)
                    cells.append(f"{best[1] / ours[key]:.2f}x (`{best[0]}`)" if best and ours and key in ours
                                 else "-")
            body.append(cells)
        out.append(_table(header, body))
    return "\n\n".join(out)


def _gpu_check(data: dict) -> str:
    steps = data["results"]
    body = []
    for step, r in steps.items():
        body.append([step, f"{r.get('passed', '-')} of {r.get('tests', '-')}", str(r.get("failed", "-")),
                     str(r.get("errors", "-")), str(r.get("skipped", "-")),
                     _duration(r["wall_s"]) if r.get("wall_s") is not None else "-", _code(r.get("command", ""))])
    table = _table(["step", "passed", "failed", "errors", "skipped or xfailed", "wall time", "command"], body,
                   "lrrrrrl")
    verdict = "every test and every cell passed" if data.get("passed") else "not every test or cell passed"
    took = f", in {_duration(data['wall_s'])} in all" if data.get("wall_s") else ""
    lines = [f"Result: {verdict}{took}.", "", table]
    failures = [f for r in steps.values() for f in r.get("failures", [])]
    if failures:
        lines += ["", "Failures: " + "; ".join(_md(f) for f in failures)]
    return "\n".join(lines)


def _decode(data: dict) -> str:
    rows = data["results"]
    contexts = sorted({r["context"] for r in rows if r.get("context")})
    sdpa = sorted({r["method"] for r in rows if r["method"].startswith("sdpa ")})
    header = ["batch", "ours, kernel", "ours, `lightning_attention_step`"] + [
        f"{m.replace('sdpa', 'SDPA')}, {_tokens(c)} cache" for c in contexts for m in sdpa]
    body = []
    for batch in sorted({r["batch"] for r in rows}):
        def cell(method, context=None):
            r = next((r for r in rows if r["batch"] == batch and r["method"] == method
                      and r.get("context") == context), None)
            if r is None:
                skipped = next((r for r in rows if r["batch"] == batch and r.get("context") == context
                                and "skipped" in r), None)
                return "not run" if skipped else "-"
            timed = f"{r['ms'] * 1000:.1f} ({r['graph_ms'] * 1000:.1f})"
            return f"{r['loop_ms'] * 1000:.1f} / {timed}" if "loop_ms" in r else timed
        body.append([str(batch), cell("ours kernel"), cell("ours api")] + [cell(m, c) for c in contexts for m in sdpa])
    parts = [f"One decoding step of one layer ({data.get('speed_heads', '?')} heads, d = {data.get('head_dim', '?')}, "
             f"{data.get('dtype', '')}), in µs: "
             + ("called back to back from Python / " if any("loop_ms" in r for r in rows) else "")
             + "from Python, each call timed alone (from a CUDA graph); \"not run\": the KV cache would not "
             "fit the run's memory limit.", "", _table(header, body)]
    memory = data.get("memory")
    if memory:
        mem_rows = []
        for n in sorted({m["tokens"] for m in memory}):
            got = {m["method"]: m["peak_extra_bytes"] for m in memory if m["tokens"] == n}
            mem_rows.append([_tokens(n)] + [f"{got[k] / 2**20:,.1f}" if k in got else "-" for k in ("ours", "sdpa")])
        model = data.get("model", {})
        parts += ["", f"Memory while decoding 16 tokens after a context, one layer of {model.get('heads', '?')} heads "
                  "(MiB allocated beyond the inputs):", "",
                  _table(["context", "ours (the state)", "SDPA (the KV cache)"], mem_rows)]
    return "\n".join(parts)


def _pivot(rows, row_key, col_key, value, row_label, fmt_row=str, fmt_col=str) -> str:
    cols = list(dict.fromkeys(r[col_key] for r in rows))
    body = []
    for rv in sorted({r[row_key] for r in rows}):
        cells = [fmt_row(rv)]
        for cv in cols:
            r = next((r for r in rows if r[row_key] == rv and r[col_key] == cv), None)
            cells.append(value(r) if r is not None else "-")
        body.append(cells)
    return _table([row_label] + [fmt_col(c) for c in cols], body)


# The models of the training-speed records, as chapter 13 names them.
TGS_MODELS = {"tnl": "TNL, LA-2 (this book's kernel)", "tnl_fla": "TNL, fla `chunk_simple_gla`",
              "llama": "LLaMA, softmax (SDPA)", "tnl_la1": "TNL, LA-1"}


def _tgs(data: dict) -> str:
    rows = [r for r in data["results"] if "tgs" in r]
    out = []
    for size in dict.fromkeys(r["size"] for r in rows):
        sized = [r for r in rows if r["size"] == size]
        out.append(f"Training speed of a {size} model, tokens per GPU per second (TGS), against the context:")
        out.append(_pivot(sized, "context", "model", lambda r: f"{r['tgs']:,.0f}", "context", _tokens,
                          lambda m: TGS_MODELS.get(m, f"`{m}`")))
    if data.get("skipped"):
        out.append("Not run: " + "; ".join(_md(s) for s in data["skipped"]))
    return "\n\n".join(out)


def _quality(data: dict) -> str:
    rows = data["results"]
    if rows and "accuracy" in rows[0]:
        text = "Recall accuracy (MQAR) after training, per attention and number of key-value pairs:"
        table = _pivot(rows, "pairs", "kind", lambda r: f"{r['accuracy']:.3f}", "pairs", str, lambda k: f"`{k}`")
        out = [text, "", table]
        if data.get("skipped"):
            out += ["", "Not run: " + "; ".join(_md(s) for s in data["skipped"])]
        return "\n".join(out)
    body = [[f"`{r['kind']}`", f"{r['params']:,}", f"{r['best_valid_loss']:.4f}", str(r.get("best_step", "-")),
             f"{r['seconds']:.0f} s"] for r in rows]
    return ("A small byte-level language model per attention: the best validation loss (nats per byte):\n\n"
            + _table(["attention", "parameters", "best validation loss", "at step", "training time"], body))


def _figure3(data: dict) -> str:
    rows = data["results"]
    sample = rows[0]
    return (f"Forward / backward in ms (D = {sample['D']}, {sample['heads']} heads, {sample['dtype']}):\n\n"
            + _pivot(rows, "T", "method", lambda r: f"{_ms(r['fwd_ms'])} / {_ms(r['bwd_ms'])}", "T", _tokens,
                     lambda m: f"`{m}`"))


def _scalar(v) -> bool:
    return isinstance(v, (int, float, bool)) or (isinstance(v, str) and len(v) <= 60)


def _generic(data: dict) -> str:
    results = data["results"]
    if isinstance(results, dict):
        lines = []
        for key, value in results.items():
            if value is None:
                continue
            if isinstance(value, list):
                lines.append(f"- {_md(key)}: " + ("none" if not value else f"{len(value)} entries"))
            elif isinstance(value, dict):
                lines.append(f"- {_md(key)}: " + ", ".join(_md(k) for k in value))
            else:
                lines.append(f"- {_md(key)}: {_num(value)}")
        return "\n".join(lines)
    rows = [r for r in results if isinstance(r, dict)]
    keys = [k for k in dict.fromkeys(k for r in rows for k in r) if all(_scalar(r.get(k, 0)) for r in rows)]
    nested = [k for k in dict.fromkeys(k for r in rows for k in r) if k not in keys]
    if rows and len(rows) <= 24 and 0 < len(keys) <= 12:
        table = _table([_md(k) for k in keys], [[_num(r[k]) if k in r else "-" for k in keys] for r in rows],
                       "".join("r" if isinstance(rows[0].get(k), (int, float)) else "l" for k in keys))
        more = f"\n\nEach row also holds: {', '.join(_md(k) for k in nested)}." if nested else ""
        return table + more
    fields = ", ".join(_md(k) for k in dict.fromkeys(k for r in rows for k in r))
    return f"{len(results)} rows, each with: {fields}."


def _figures(data: dict) -> str:
    if _is_bench(data):
        return _bench_tables(data)
    results = data["results"]
    if isinstance(results, dict) and {"tests", "notebooks"} <= results.keys():
        return _gpu_check(data)
    if isinstance(results, list) and results and isinstance(results[0], dict):
        first = results[0]
        if "memory" in data and "method" in first and "batch" in first and "graph_ms" in first:
            return _decode(data)
        if {"model", "context", "tgs"} <= first.keys():
            return _tgs(data)
        if "kind" in first and ("best_valid_loss" in first or "accuracy" in first):
            return _quality(data)
        if {"method", "T", "fwd_ms", "bwd_ms"} <= first.keys():
            return _figure3(data)
    return _generic(data)


# ---------------------------------------------------------------- headlines


def _latest(recs: dict[str, dict], prefix: str, D: int) -> tuple[str, dict] | None:
    found = [(data["date"], name, data) for name, data in recs.items()
             if name.startswith(prefix) and _is_bench(data) and any(r["D"] == D for r in data["results"])]
    return max(found)[1:] if found else None


def _failed(step: dict) -> str:
    failed, skipped = step.get("failed", 0), step.get("skipped", 0)
    text = "none failed" if not failed else f"{failed} failed"
    return text + (f" ({skipped} skipped or expected to fail)" if skipped else "")


_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def _dtype(name: str) -> str:
    return _DTYPES.get(str(name).removeprefix("torch."), str(name))


def headline_rows(recs: dict[str, dict]) -> list[dict]:
    """The headline results, each {"what", "result", "where", "record"}: the training call (forward + backward)
    beside the fastest library at D = 128 and D = 64 from the latest ``anchors_*`` records, the decoding step from
    ``decode_*``, and the GPU check from ``gpu_check_*``."""
    out = []
    for D in (128, 64):
        found = _latest(recs, "anchors_", D)
        if not found:
            continue
        name, data = found
        rows = [r for r in data["results"] if r["D"] == D]
        ratios = []
        for T in sorted({r["T"] for r in rows}):
            ours, best = _row(rows, OURS, D, T), best_library(rows, D, T)
            if ours and best:
                ratios.append((T, best[1] / ours["fwdbwd_ms"]))
        if not ratios:
            continue
        lo, hi = min(r for _, r in ratios), max(r for _, r in ratios)
        sample = rows[0]
        out.append({
            "what": f"Training call (forward + backward), head dim D = {D}, {_dtype(sample['dtype'])}, "
                    f"{sample['heads']} heads, sequences of {_tokens(ratios[0][0])} to {_tokens(ratios[-1][0])} tokens",
            "result": f"{lo:.2f}x to {hi:.2f}x the speed of the fastest library at each length",
            "where": f"{data['machine']}, {_date(data)}", "record": name,
        })
    decode = sorted(((d["date"], n, d) for n, d in recs.items() if n.startswith("decode_")), reverse=True)
    if decode:
        _, name, data = decode[0]
        rows = data["results"]
        batch = max(r["batch"] for r in rows if r["method"] == "ours kernel")
        ours = next(r for r in rows if r["method"] == "ours kernel" and r["batch"] == batch)
        contexts = [r["context"] for r in rows
                    if r["batch"] == batch and r.get("context") and "graph_tokens_per_s" in r]
        if contexts:
            context = min(contexts)
            sdpa = max(r["graph_tokens_per_s"] for r in rows if r["batch"] == batch and r.get("context") == context
                       and "graph_tokens_per_s" in r)
            out.append({
                "what": f"One decoding step at batch {batch}, one layer of {data['speed_heads']} heads "
                        f"(d = {data['head_dim']}, {_dtype(data['dtype'])}), from a CUDA graph",
                "result": f"{_rate(ours['graph_tokens_per_s'])} tokens/s, {ours['graph_tokens_per_s'] / sdpa:.1f}x "
                          f"softmax attention (SDPA) over a {_tokens(context)}-token KV cache",
                "where": f"{data['machine']}, {_date(data)}", "record": name,
            })
    checks = sorted(((d["date"], n, d) for n, d in recs.items() if n.startswith("gpu_check_")), reverse=True)
    if checks:
        _, name, data = checks[0]
        tests, cells = data["results"]["tests"], data["results"]["notebooks"]
        out.append({
            "what": "The GPU check: every GPU test, then every chapter's cells with CUDA",
            "result": f"{tests['passed']} of {tests['tests']} GPU tests passed, {_failed(tests)}; "
                      f"{cells['passed']} of {cells['tests']} chapter cells passed, {_failed(cells)}; "
                      f"{_duration(data['wall_s'])} in all",
            "where": f"{data['machine']}, {_date(data)}", "record": name,
        })
    return out


def headline_table(root: Path | None = None, links: Links | None = None) -> str:
    """The table of headline results (:func:`headline_rows`), its records linked as README.md links them (from the
    repository root) unless ``links`` says otherwise."""
    root = (root or repo_root()).resolve()
    links = links or _relative_links(root, root / "README.md")
    body = [[_md(h["what"]), _md(h["result"]), _md(h["where"]), f"[`{h['record']}.json`]({links.record(h['record'])})"]
            for h in headline_rows(records(root))]
    return _table(["measured", "result", "machine, date", "record"], body, "llll")


# ---------------------------------------------------------------- the page


def record_section(name: str, data: dict, links: Links, root: Path | None = None,
                   mentioned: list[Chapter] | None = None) -> str:
    """One record's part of the page: heading, what it measured, where and how, note, chapters, figures."""
    root = root or repo_root()
    line = describe_recorded(data)
    command = data["command"]
    line = _md(line.replace(f" by: {command}", " by: \0")).replace("\0", _code(command))
    parts = [f"## {name}", "", f"[`{name}.json`]({links.record(name)}): {_prose(what_it_measured(data, root))}", "",
             line + "."]
    if data.get("note"):
        parts += ["", f"Note: {_md(data['note'])}"]
    earlier = data.get("earlier_runs")
    if earlier:
        parts += ["", f"The record also keeps {len(earlier)} earlier run{'s' if len(earlier) > 1 else ''} of the "
                  "same measurement."]
    if mentioned:
        parts += ["", "Mentioned in " + ", ".join(f"[chapter {ch.number:02d}]({links.chapter(ch)})" for ch in mentioned)
                  + "."]
    parts += ["", _figures(data)]
    return "\n".join(parts)


def results_page(root: Path | None = None, links: Links | None = None) -> str:
    """The whole page (Markdown): the headlines, an index of every record, the method names, then each record."""
    root = (root or repo_root()).resolve()
    links = links or _relative_links(root, root / DEFAULT_OUT)
    recs = records(root)
    mentions = _mentions(root)
    index = [[f"[{name}](#{name})", _prose(what_it_measured(data, root)), _md(data["machine"]), _date(data),
              ", ".join(f"{ch.number:02d}" for ch in mentions[name]) or "-"] for name, data in recs.items()]
    methods = "\n".join(f"- `{m}`: {text}" for m, text in METHODS.items())
    parts = [
        "# Measured results",
        "",
        f"Every measurement the book quotes, read from its record when this page was built: {len(recs)} records "
        "in `notebooks/data/`. Each record names the machine, the versions, the commit and the command that "
        "produced it; the command runs again from the repository root (where a driver has moved since, the line "
        "says where it lives today). A chapter without a GPU shows these recordings in place of its GPU cells.",
        "",
        "## Headlines",
        "",
        headline_table(root, links),
        "",
        "## Every record",
        "",
        _table(["record", "what it measured", "machine", "date", "chapters"], index, "lllll"),
        "",
        "The benchmark's methods, as the tables name them:",
        "",
        methods,
    ]
    for name, data in recs.items():
        parts += ["", record_section(name, data, links, root, mentions[name])]
    return "\n".join(parts) + "\n"


def write_results(out: Path | str | None = None, root: Path | None = None, links: Links | None = None) -> Path:
    """Write :func:`results_page` to ``out`` (default ``build/results.md`` under the repository root); return it."""
    root = (root or repo_root()).resolve()
    out = Path(out) if out is not None else root / DEFAULT_OUT
    if not out.is_absolute():
        out = Path.cwd() / out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(results_page(root, links or _relative_links(root, out)))
    return out
