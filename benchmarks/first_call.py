"""What the first call costs: compile time of the triton backend per (dtype, head dim), on a GPU. (Chapter 14.)

    python -m benchmarks.first_call OUT.json

Each configuration runs in a fresh Python process with an empty Triton cache directory, so the figure is
what a new user's first call costs: forward + backward on (1, 4, 1024, d) inputs, wall time from the call
to its gradients, then the second call's wall time for comparison. Each configuration runs twice: as the
backend runs by default ("ahead": the first call compiles its kernels side by side,
:func:`lightning_edu.triton_kernels._tiles.compile_ahead`) and under ``plan.override(compile_ahead=False)`` ("lazy":
each kernel compiles at its first launch, one after another). Each row also counts the kernels compiled
(``compiled``) and how many of them were compiled at a launch rather than ahead (``at_launch``; 0 when the
ahead pass foresaw every kernel).

Two one-time costs of a process are not the backend's, and are measured before its first call, each on
its own: ``torch_backward_s``, torch's first backward with an explicit gradient (``y.backward(grad)``,
which imports torch's symbolic-shape module and with it sympy), and ``triton_setup_s``, Triton's set-up
before its first compilation (the hash of its own sources that keys its cache, the CUDA driver, and the
small C module it builds into an empty cache). Any Triton kernel in the process pays the second, any such
backward the first; ``first_s`` is what the backend's call costs after them. ``compile_span_s`` is the wall
time from the first compilation's start to the last one's end, ``compile_sum_s`` the compilations' times
added up (larger than the span when they overlap), both taken by wrapping ``triton.compiler.compile``.
One JSON record with the machine, versions and commit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

__all__ = ["CONFIGS", "main"]

CONFIGS = [(dtype, d) for dtype in ("bfloat16", "float16", "float32") for d in (64, 128)]
MODES = ("ahead", "lazy")

_CHILD = r"""
import json, sys, time
import torch
import triton
import triton.compiler
import lightning_edu as le
import contextlib
from lightning_edu.triton_kernels import plan
dtype, d, mode = getattr(torch, sys.argv[1]), int(sys.argv[2]), sys.argv[3]
settings = contextlib.ExitStack()  # the whole child runs under the mode
settings.enter_context(plan.override(compile_ahead=mode == "ahead"))
compiled = []  # one flag per kernel compiled: whether it was compiled at a launch (not by a warm-up)
triton.knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(not kw["is_manual_warmup"])
spans = []  # (start, end) of each compilation
compile = triton.compiler.compile
def timed_compile(*args, **kwargs):
    start = time.perf_counter()
    try:
        return compile(*args, **kwargs)
    finally:
        spans.append((start, time.perf_counter()))
triton.compiler.compile = timed_compile  # the JIT looks it up here when it builds its first binder
def wall(f):
    torch.cuda.synchronize()
    start = time.perf_counter()
    f()
    torch.cuda.synchronize()
    return time.perf_counter() - start
def torch_backward():
    y = torch.ones(4, device="cuda", requires_grad=True) * 2
    y.backward(torch.ones_like(y))
def triton_setup():
    from triton.runtime.cache import triton_key
    triton_key()
    driver = triton.runtime.driver.active
    driver.get_current_target()
    driver.utils
row = {"torch_backward_s": wall(torch_backward), "triton_setup_s": wall(triton_setup)}
x = [torch.randn(1, 4, 1024, d, device="cuda").to(dtype).requires_grad_() for _ in range(3)]
do = torch.randn(1, 4, 1024, d, device="cuda").to(dtype)
call = lambda: le.lightning_attention(*x, [0.99] * 4).backward(do)
row["first_s"] = wall(call)
first_spans = list(spans)
row["second_s"] = wall(call)
row.update(compiled=len(compiled), at_launch=sum(compiled))
if first_spans:
    row.update(compile_span_s=max(e for _, e in first_spans) - min(s for s, _ in first_spans),
               compile_sum_s=sum(e - s for s, e in first_spans))
print(json.dumps(row))
"""


def main(argv=None) -> int:
    from lightning_edu.environment import environment_record, save_record

    from .common import usage_refused

    argv = sys.argv[1:] if argv is None else argv
    refused = usage_refused(argv, __doc__)
    if refused is not None:
        return refused
    record = {**environment_record("python -m benchmarks.first_call " + " ".join(argv)), "results": []}
    for (dtype, d), mode in ((config, mode) for config in CONFIGS for mode in MODES):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TRITON_CACHE_DIR": cache}
            start = time.perf_counter()
            run = subprocess.run([sys.executable, "-c", _CHILD, dtype, str(d), mode], env=env, capture_output=True,
                                 text=True, timeout=600)
            row = {"dtype": dtype, "d": d, "mode": mode, "process_s": time.perf_counter() - start}
            if run.returncode == 0:
                row.update(json.loads(run.stdout.strip().splitlines()[-1]))
            else:
                row["error"] = run.stderr[-500:]
        record["results"].append(row)
        print(json.dumps(row), flush=True)
        save_record(argv[0], record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
