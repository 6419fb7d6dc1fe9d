"""The GPU check: the GPU test suite, then every chapter under nbval with CUDA, and a record of both.

Run through ``bash .ci/gpu-check`` (which puts the carried wheels and this checkout on the path); CONTRIBUTING.md
says when. Two steps, each a pytest run in a process of its own:

1. ``pytest -m gpu -n W --dist loadgroup tests``: every cuda case, in a Triton cache made empty for the run, so
   its wall time is that of a fresh machine (the suite's budget is stated against it).
2. ``pytest --nbval-lax -n W --dist loadfile notebooks``: every chapter top to bottom with its GPU cells live.
   Lax: the committed outputs are those of a machine without CUDA, and the GPU cells print other things; what
   is checked is that every cell runs and every assertion in it holds.

The record, ``notebooks/data/gpu_check_<gpu>.json`` (``--out`` changes the folder), holds the machine, the
versions, the commit, under ``results`` each step's command, counts, wall time and failures, and the earlier runs of the same
file under ``earlier_runs``. Exit status: 0 when both steps pass, 1 when a test or a cell fails, 2 when the
check cannot start (no CUDA, no nbval: one line says which).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Not GPU tests, and costly to collect: the course pipeline starts nbgrader at collection.
NOT_COLLECTED = ("tests/exercises/test_assignments.py", "tests/exercises/test_exercise_robustness.py", "tests/test_notebook_format.py")


def refuse(message: str) -> None:
    print(f"gpu-check: {message}", file=sys.stderr)
    raise SystemExit(2)


def parse_args(argv):
    cores = os.cpu_count() or 1
    p = argparse.ArgumentParser(prog="bash .ci/gpu-check", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=cores, help="pytest-xdist workers for the tests (default: cores)")
    p.add_argument("--notebook-workers", type=int, default=min(8, cores),
                   help="workers for the chapters, one chapter at a time each (default: min(8, cores))")
    p.add_argument("--out", default=str(ROOT / "notebooks" / "data"), help="folder of the record")
    p.add_argument("--commit", default=None, help="the commit checked (default: git rev-parse, where there is .git)")
    p.add_argument("--only", choices=("tests", "notebooks"), default=None, help="one step alone")
    p.add_argument("--logs", default=None, help="a folder to keep each step's log and JUnit XML in")
    p.add_argument("-k", dest="keyword", default=None, help="passed to both pytest runs (a partial check)")
    try:
        args = p.parse_args(argv)
    except SystemExit as exc:
        raise SystemExit(0 if exc.code == 0 else 2) from None
    for name in ("workers", "notebook_workers"):
        if getattr(args, name) < 1:
            refuse(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    return args


def machine() -> dict:
    import torch
    import triton

    out = {"machine": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(), "cpu_cores": os.cpu_count(),
           "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()}
    try:
        out["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=30).stdout.split("\n")[0].strip()
    except (OSError, subprocess.SubprocessError):
        out["driver"] = None
    for name in ("nbval", "ipykernel", "pytest", "xdist"):
        try:
            out[name if name != "xdist" else "pytest_xdist"] = __import__(name).__version__
        except (ImportError, AttributeError):
            pass
    return out


def commit(given: str | None) -> str:
    if given:
        return given
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=30)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def node_id(junit_name: str) -> str:
    """pytest's node id of a JUnit "classname::name" (tests.test_x.TestY::test_z[p] -> tests/test_x.py::TestY::test_z[p]),
    without the "@group" that pytest-xdist's loadgroup appends."""
    classname, _, name = junit_name.partition("::")
    if classname.endswith(".ipynb"):  # nbval: notebooks.01_x.ipynb::Cell 3
        return classname.replace(".", "/", 1) + "::" + name
    parts = classname.split(".")
    split = next((i for i in range(len(parts), 0, -1) if (ROOT / Path(*parts[:i])).with_suffix(".py").exists()),
                 len(parts))
    return "::".join(["/".join(parts[:split]) + ".py", *parts[split:], name.split("@")[0]])


def junit_counts(path: Path) -> dict:
    """Counts and failures from pytest's JUnit XML (each failure: the test's id and the first line of its error)."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures = []
    durations = []
    for suite in suites:
        for case in suite.iter("testcase"):
            counts["tests"] += 1
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            durations.append((float(case.get("time", 0) or 0), name))
            kinds = {child.tag for child in case}
            if "failure" in kinds or "error" in kinds:
                counts["failed" if "failure" in kinds else "errors"] += 1
                child = case.find("failure") if "failure" in kinds else case.find("error")
                first = (child.get("message") or child.text or "").strip().split("\n")[0][:300]
                failures.append({"test": name, "error": first})
            elif "skipped" in kinds:
                counts["skipped"] += 1
            else:
                counts["passed"] += 1
    durations.sort(reverse=True)
    counts["worker_s"] = round(sum(d for d, _ in durations), 1)
    counts["slowest_s"] = [[round(d, 2), n] for d, n in durations[:15]]
    # every case's seconds by node id: tests/conftest.py runs the longest first on the next GPU run
    counts["durations_s"] = {node_id(n): round(d, 2) for d, n in durations}
    counts["failures"] = failures
    return counts


def step(name: str, command: list[str], env: dict, scratch: Path) -> dict:
    """Run one pytest step; its output streams to the terminal and to ``scratch/<name>.log``."""
    xml = scratch / f"{name}.xml"
    command = [*command, f"--junitxml={xml}"]
    print(f"gpu-check: {name}: {' '.join(command[2:])}", flush=True)
    start = time.monotonic()
    with open(scratch / f"{name}.log", "w") as log:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True)
        for line in process.stdout:
            sys.stdout.write(line)
            log.write(line)
        process.wait()
    wall = time.monotonic() - start
    summary = ""
    for line in reversed((scratch / f"{name}.log").read_text().splitlines()):
        if re.search(r"\d+ (passed|failed|error)", line):
            summary = line.strip("= ").strip()
            break
    result = {"command": " ".join(["python", "-m", *command[2:-1]]), "exit_status": process.returncode,
              "wall_s": round(wall, 1), "summary": summary}
    if xml.exists():
        result.update(junit_counts(xml))
    return result


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        import torch
    except ImportError:
        refuse("torch is not installed")
    if not torch.cuda.is_available():
        refuse("no CUDA device here: the GPU check runs on a machine with one (CI checks the CPU side)")
    if args.only != "tests":
        try:
            import ipykernel  # noqa: F401
            import nbval  # noqa: F401
        except ImportError as exc:
            refuse(f"{exc.name} is missing: run `bash .ci/gpu-check --fetch` where PyPI is reachable and bring .whl/")
    try:
        import xdist  # noqa: F401
    except ImportError:
        refuse("pytest-xdist is missing (pip install pytest-xdist)")
    out_dir = Path(args.out)
    if not out_dir.is_dir():
        refuse(f"--out {args.out}: no such folder")
    record = {**machine(), "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "commit": commit(args.commit), "command": "bash .ci/gpu-check " + " ".join(argv or sys.argv[1:])}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    extra = ["-k", args.keyword] if args.keyword else []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as scratch_name:
        scratch = Path(args.logs or scratch_name)  # each step's log and JUnit XML, written as it runs
        scratch.mkdir(parents=True, exist_ok=True)
        steps = {}
        if args.only != "notebooks":
            # Inductor compiles in each worker's own process: with N workers its default pool of one compile
            # process per core would start N x cores processes on the machine's cores.
            tests_env = {**env, "TRITON_CACHE_DIR": str(Path(scratch_name) / "triton_cache"),
                         "TORCHINDUCTOR_COMPILE_THREADS": "1"}
            ignores = [x for path in NOT_COLLECTED for x in ("--ignore", path)]
            steps["tests"] = step("tests", [sys.executable, "-m", "pytest", "-m", "gpu", "-n", str(args.workers),
                                            "--dist", "loadgroup", "-q", "-p", "no:cacheprovider", "tests", *ignores,
                                            "--durations=15", *extra], tests_env, scratch)
        if args.only != "tests":
            threads = str(max(1, (os.cpu_count() or 1) // args.notebook_workers))
            nb_env = {**env, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
            steps["notebooks"] = step("notebooks", [sys.executable, "-m", "pytest", "--nbval-lax", "-n",
                                                    str(args.notebook_workers), "--dist", "loadfile", "-q", "-p",
                                                    "no:cacheprovider", "--nbval-cell-timeout", "900", "notebooks",
                                                    *extra], nb_env, scratch)
    record["wall_s"] = round(time.monotonic() - started, 1)
    record["results"] = steps
    record["passed"] = all(s["exit_status"] == 0 for s in steps.values())
    slug = re.sub(r"[^a-z0-9]+", "_", record["machine"].lower().replace("nvidia", "")).strip("_").split("_")[0]
    path = out_dir / f"gpu_check_{slug}.json"
    previous = path if path.exists() else ROOT / "notebooks" / "data" / path.name  # the committed record
    if previous.exists():
        try:
            earlier = json.loads(previous.read_text())
        except ValueError:
            earlier = None
        if earlier:
            record["earlier_runs"] = [{k: v for k, v in earlier.items() if k != "earlier_runs"},
                                      *earlier.get("earlier_runs", [])]
    path.write_text(json.dumps(record, indent=1) + "\n")
    for name, s in steps.items():
        print(f"gpu-check: {name}: {s.get('summary') or 'no summary'} (exit {s['exit_status']}, {s['wall_s']:.0f} s)")
        for f in s.get("failures", []):
            print(f"  FAILED {f['test']}: {f['error']}")
    print(f"gpu-check: {'passed' if record['passed'] else 'FAILED'} in {record['wall_s']:.0f} s; record {path}")
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
