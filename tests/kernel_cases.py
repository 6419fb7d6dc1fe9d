"""Where a Triton kernel's tests run: one device list and one skip rule, shared by every kernel test file.

* ``"cpu"``: Triton's CPU interpreter (TRITON_INTERPRET=1, which tests/conftest.py sets when CUDA is absent). It is
  slow, so cpu cases take small shapes; and it computes bfloat16 wrongly, so they stay fp32 (fp16 where a test says).
* ``"cuda"``: the compiled kernels on a GPU, the interpreter off. These cases carry the ``gpu`` marker, so
  ``python -m pytest -m gpu tests`` selects them on a GPU machine (with TRITON_INTERPRET unset).

A test of a kernel takes a ``device`` argument, parametrised by :func:`on` (the same cases on each device) or
:func:`cases` (each device its own cases: shapes, dtypes). A case whose device cannot run here is collected and
skipped with the reason :func:`skip_reason` gives; nothing else in the test suite decides that.
"""

from __future__ import annotations

import os

import pytest
import torch

DEVICES = ("cpu", "cuda")


def interpreted() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (decided by the environment before any kernel import)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def skip_reason(device: str) -> str | None:
    """Why the cases of ``device`` cannot run here, or None when they can. The one place that decides skipping."""
    if device == "cpu":
        if interpreted():
            return None
        return "cpu cases run in Triton's CPU interpreter, which is off here (TRITON_INTERPRET is not 1)"
    if device == "cuda":
        if not torch.cuda.is_available():
            return "cuda cases need a CUDA device"
        if interpreted():
            return "cuda cases test the compiled kernels, and TRITON_INTERPRET=1 here"
        return None
    raise ValueError(f"unknown device {device!r}; expected one of {DEVICES}")


def marks(device: str) -> list:
    """The marks of a case on ``device``: ``gpu`` for cuda, and a skip where :func:`skip_reason` gives one.

    Also usable as a module's ``pytestmark`` for a file whose every test needs one device (tests/triton_kernels/test_no_sync.py)."""
    out = [pytest.mark.gpu] if device == "cuda" else []
    reason = skip_reason(device)
    if reason is not None:
        out.append(pytest.mark.skip(reason=reason))
    return out


def on(*devices: str):
    """``@on()`` / ``@on("cpu")``: parametrise the test's ``device`` argument over these devices (default: all)."""
    return pytest.mark.parametrize("device", [pytest.param(d, marks=marks(d), id=d) for d in devices or DEVICES])


def case_id(value) -> str:
    """A readable id: shapes as 2x3x77x64, decays as 1,0.05, keyword dicts as chunk=64,micro=16, dtypes as
    torch.float32, the rest as str()."""
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    if isinstance(value, (tuple, list)) and value and all(type(x) is int for x in value):
        return "x".join(map(str, value))
    if isinstance(value, (tuple, list)) and value and all(isinstance(x, (int, float)) for x in value):
        return ",".join(f"{x:g}" for x in value)
    return str(value)


def cases(argnames: str, by_device: dict[str, list], same_worker=None):
    """Parametrise ``device`` and ``argnames`` (comma-separated) with each device's own list of cases.

    ``by_device`` maps a device to its cases: one value each for a single name, else a tuple of one value per name.
    Ids read ``device-value-value``, each value through :func:`case_id`.

    ``same_worker(values)`` may name a group for a cuda case (or return None): under ``pytest -n N --dist loadgroup``
    the cases of one group, in this test or another, run one after another in one worker, so the kernels the first
    compiles the next finds in Triton's cache instead of compiling them at the same time in another worker."""
    names = [a.strip() for a in argnames.split(",")]
    params = []
    for device, rows in by_device.items():
        if device not in DEVICES:
            raise ValueError(f"unknown device {device!r}; expected one of {DEVICES}")
        for row in rows:
            values = (row,) if len(names) == 1 else tuple(row)
            if len(values) != len(names):
                raise ValueError(f"case {row!r} does not give one value for each of {names}")
            group = same_worker(values) if same_worker is not None and device == "cuda" else None
            extra = [pytest.mark.xdist_group(group)] if group else []
            params.append(pytest.param(device, *values, marks=marks(device) + extra,
                                       id="-".join([device, *map(case_id, values)])))
    return pytest.mark.parametrize(["device", *names], params)


def compiled(device: str, run, *args, **kwargs):
    """``run(*args, **kwargs)``. On a GPU, every kernel that ``run`` launches is first compiled side by side, in
    threads (``_tiles.compile_ahead``, chapter 07), rather than one after another at its launch: a case that runs
    a forward and a backward compiles eight kernels, and on an empty Triton cache that is most of its time."""
    if device == "cuda":
        from lightning_edu.triton_kernels._tiles import compile_ahead

        compile_ahead(run, *args, **kwargs)
    return run(*args, **kwargs)


def synchronize(device: str) -> None:
    """Wait for the device's kernels (a no-op in the interpreter, which runs them on the host as they are called)."""
    if device == "cuda":
        torch.cuda.synchronize()


def kernel_inputs(shape, device: str, dtype=torch.float32, seed: int = 0):
    """q, k, v, do (halved standard normals, rounded to dtype) and s0, dsn (fp32) of ``shape`` = (batch, heads, n,
    d_k, d_v), from a generator seeded on ``device``: the inputs of the kernel tests."""
    batch, heads, n, d_k, d_v = shape
    g = torch.Generator(device=device).manual_seed(seed)
    mk = lambda *s: (torch.randn(*s, device=device, generator=g) / 2).to(dtype)  # noqa: E731
    q, k, v, do = mk(batch, heads, n, d_k), mk(batch, heads, n, d_k), mk(batch, heads, n, d_v), mk(batch, heads, n, d_v)
    s0, dsn = (torch.randn(batch, heads, d_k, d_v, device=device, generator=g) for _ in range(2))
    return q, k, v, do, s0, dsn


def to_numpy64(x):
    """A tensor as a float64 numpy array, for the float64 references."""
    return x.detach().double().cpu().numpy()
