"""What a compiled Triton kernel uses on chip: shared memory, registers, spills. (Chapter 09.)

Triton compiles a kernel once per specialisation (dtypes, constexpr values, launch options) and keeps the
result in the ``@triton.jit`` function's cache. Each compiled kernel carries its metadata: ``shared`` is the
shared memory one program (thread block) allocates, in bytes; ``n_regs`` the registers per thread and
``n_spills`` the registers spilled to local memory. :func:`compiled_resources` runs a callable and returns
that metadata for every kernel it compiled, with the kernel's constexpr values, so a table can say which
tile sizes a figure belongs to. It needs a GPU: the CPU interpreter compiles nothing.

Shared memory per block: up to 227 KB on Hopper (H100, H200), but 99 KB (101,376 bytes) on the consumer and
workstation Blackwell parts of compute capability 12.x. A kernel that asks for more does not launch there.
"""

from __future__ import annotations

import sys
from typing import Callable

__all__ = ["SM120_SHARED_LIMIT", "compiled_resources"]

SM120_SHARED_LIMIT = 101_376  # bytes of shared memory per block on compute capability 12.x (99 KiB)


def jit_functions(prefixes=("lightning_edu",)) -> list:
    """Every ``@triton.jit`` function defined in an imported module whose name starts with one of ``prefixes``."""
    from triton.runtime.jit import JITFunction

    found = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(tuple(prefixes)):
            continue
        for obj in vars(module).values():
            if isinstance(obj, JITFunction):
                found[id(obj)] = obj
    return list(found.values())


def _compiled(fn) -> dict:
    """{cache key: compiled kernel} of one JIT function, over all devices."""
    out = {}
    for cache in getattr(fn, "device_caches", {}).values():
        kernels = cache[0] if isinstance(cache, tuple) else cache
        out.update(kernels)
    return out


def _constexprs(fn, kernel) -> dict:
    """The constexpr values a kernel was compiled with, by parameter name (what the metadata records)."""
    constants = getattr(getattr(kernel, "src", None), "constants", None) or {}
    named = {}
    for key, value in constants.items():
        index = key[0] if isinstance(key, tuple) and len(key) == 1 else None
        if isinstance(index, int) and index < len(fn.arg_names) and fn.arg_names[index].isupper():
            named[fn.arg_names[index]] = value if isinstance(value, (bool, int, float, str)) else str(value)
    return named


def compiled_resources(run: Callable[[], object], prefixes=("lightning_edu",), fresh: bool = False) -> list[dict]:
    """Run ``run()`` and return one record per kernel it compiled (kernels compiled before are not listed):
    ``{"kernel", "shared", "n_regs", "n_spills", "num_warps", "num_stages", "constexprs"}``. With ``fresh``
    the in-memory caches of those JIT functions are emptied first, so every kernel ``run`` launches is
    listed (loaded again from Triton's on-disk cache where it is there)."""
    if fresh:
        for fn in jit_functions(prefixes):
            for cache in getattr(fn, "device_caches", {}).values():
                (cache[0] if isinstance(cache, tuple) else cache).clear()
    before = {(id(fn), key) for fn in jit_functions(prefixes) for key in _compiled(fn)}
    run()
    records = []
    for fn in jit_functions(prefixes):
        for key, kernel in _compiled(fn).items():
            if (id(fn), key) in before:
                continue
            meta = kernel.metadata
            records.append({
                "kernel": fn.__name__, "shared": int(meta.shared), "n_regs": int(getattr(kernel, "n_regs", -1) or -1),
                "n_spills": int(getattr(kernel, "n_spills", -1) or 0), "num_warps": int(meta.num_warps),
                "num_stages": int(meta.num_stages), "constexprs": _constexprs(fn, kernel),
            })
    return records
