"""One record of where a measurement was taken: machine, versions, commit, command. (All recorded data.)

Every file recorded with this module carries such a record, so a reader can tell which machine, which versions
and which commit of this book produced each number; the older H200 files (bench_h200_*, tune_h200, torch_sweep_h200,
and the first run kept in gpu_tests_h200) name no commit. The GPU driver version comes from NVML
(``nvidia-ml-py``) where it is installed, else it is left unnamed rather than guessed.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

__all__ = ["environment_record", "git_commit", "save_record"]


def git_commit() -> str | None:
    """``$LIGHTNING_EDU_COMMIT`` when set (code run from a copy of a checkout, whose .git may be stale or absent),
    else the commit of this checkout, marked "+local changes" when tracked files differ from it."""
    if os.environ.get("LIGHTNING_EDU_COMMIT"):
        return os.environ["LIGHTNING_EDU_COMMIT"]
    root = Path(__file__).resolve().parents[1]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return out.stdout.strip() + ("+local changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def _driver() -> str | None:
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # no NVIDIA driver on this machine
        return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment_record(command: str | None = None, device: str = "cuda") -> dict:
    """Machine, versions, date, commit and command of a measurement, as a JSON-ready dict.

    ``device`` "cuda" describes GPU 0 (name, SM count, driver); "cpu" the processor and its cores.
    ``command`` defaults to how this Python process was started.
    """
    import torch

    record = {}
    if device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        record.update(machine=props.name, sm_count=props.multi_processor_count,
                      memory_GiB=round(props.total_memory / 2**30, 1), driver=_driver())
    else:
        record.update(machine=_cpu_name(), cpu_cores=os.cpu_count(), torch_threads=torch.get_num_threads())
    try:
        import triton

        record["triton"] = triton.__version__
    except ImportError:  # pragma: no cover - triton is a dependency
        record["triton"] = None
    record.update(
        torch=torch.__version__,
        python=platform.python_version(),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        commit=git_commit(),
        command=command or "python " + " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
    )
    return record


def save_record(path, record: dict) -> None:
    """Write ``record`` to ``path`` as JSON (indented one space, as every recorded file is), whole or not at all:
    into a temporary file beside it, then renamed over it. The measuring modules save after every shape so that a
    run cut short still leaves what it measured; a run cut short while writing leaves the last whole record."""
    path = os.fspath(path)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
