import contextlib
import json
import os
import sys

# Under pytest-xdist (the GPU suite runs one worker per core) each worker computes on one thread: BLAS and torch
# would otherwise start a thread per core in every worker, competing with the workers that compile kernels (on an
# H100 host with 16 cores the GPU suite took 2 min 43-48 s this way, 2 min 52 s with 16 threads per worker;
# notebooks/data/gpu_tests_h100.json). Set before numpy or torch is imported; a value already set is kept.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

# Triton decides at decoration time whether a kernel runs in its CPU interpreter: set this before any
# lightning_edu.triton_kernels import. (lightning_edu/__init__ does the same when CUDA is absent.)
try:
    import torch

    _has_cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _has_cuda = False
if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER") and os.environ["OMP_NUM_THREADS"].isdigit():
    torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))

import pytest
from hypothesis import settings

# CI has 2 cores; keep property tests quick and free of flaky deadlines.
settings.register_profile("ci", max_examples=40, deadline=None)
settings.load_profile("ci")


@contextlib.contextmanager
def _torch_threads(n: int):
    """torch's intra-op threads set to ``n`` inside the block, the previous count restored after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def torch_threads():
    """``with torch_threads(n):`` pins torch's threads to n for the block (a test file's autouse fixture uses it)."""
    return _torch_threads


GPU_RECORD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks", "data",
                          "gpu_check_h200.json")


def _case_key(node_id: str) -> str:
    """A case's node id without the folders of its file (test_x.py::test_y[p]): the key survives a file's move
    into another folder of tests/, and test file names are unique across the folders."""
    path, sep, rest = node_id.partition("::")
    return path.rpartition("/")[2] + sep + rest


def _recorded_gpu_seconds() -> dict:
    """Each GPU case's seconds in the last GPU check (.ci/gpu-check's record), by :func:`_case_key`; empty without
    one."""
    try:
        with open(GPU_RECORD) as f:
            return {_case_key(k): v for k, v in json.load(f)["results"]["tests"]["durations_s"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def pytest_collection_modifyitems(config, items):
    """On a machine with CUDA, the longest work first: under ``pytest -n N --dist loadgroup`` workers take tests in
    this order, and a long case taken last keeps the whole run waiting for it. The order is by the seconds each case
    took in the last GPU check (a group of cases that share a worker, ``xdist_group`` in tests/kernel_cases.py, by
    their sum; a case not in the record as a middling one). Without CUDA, the groups first and every other test in
    its order. The sorts are stable."""
    seconds = _recorded_gpu_seconds() if _has_cuda else {}

    def group(item):
        marker = item.get_closest_marker("xdist_group")
        return marker.args[0] if marker is not None else None

    if seconds:
        own = {item.nodeid: seconds.get(_case_key(item.nodeid.split("@")[0]), 5.0) for item in items}
        totals = {}
        for item in items:
            totals[group(item)] = totals.get(group(item), 0.0) + own[item.nodeid]
        items.sort(key=lambda item: -(totals[group(item)] if group(item) is not None else own[item.nodeid]))
    else:
        items.sort(key=lambda item: group(item) is None)
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # the course pipeline's readers last: see pytest_collection_finish
        items.sort(key=lambda item: "pipeline" in getattr(item, "fixturenames", ()))


@pytest.fixture(autouse=True)
def _release_cached_gpu_memory():
    """Under pytest-xdist several workers share one GPU, and each one's caching allocator keeps what its tests
    freed: hand it back after every test, so that a worker's big case finds the memory the others let go."""
    yield
    if os.environ.get("PYTEST_XDIST_WORKER") and _has_cuda and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _fresh_launch_plans():
    """Each test starts with no recorded launch plans (``triton_kernels.ops``): a call that repeats another
    test's shapes would otherwise replay that test's launches and skip the host code a test may be watching
    (a patched ``kernel_config`` or ``launch``). Within a test, a repeated call still replays."""
    import sys

    ops = sys.modules.get("lightning_edu.triton_kernels.ops")
    if ops is not None:
        ops.forget_plans()
    yield


def pytest_collection_finish(session):
    """Start tests/test_precision.py's second process (its interpreter rows, at the lowest priority), and
    tests/exercises/test_assignments.py's course pipeline, as soon as the tests are collected, so that each runs beside the
    tests before the ones that read it: see test_precision's ELSEWHERE and start_pipeline_alongside. Not under
    pytest-xdist, where every worker collects every test and runs only some: there the file's own fixture starts
    the second process, in the workers that run its tests (and the pipeline's fixture runs the pipeline itself)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    modules = {getattr(item, "module", None) for item in session.items}
    for module in modules - {None}:
        name = module.__name__.rpartition(".")[2]
        if name == "test_precision":
            module.start_alongside(session.items)
        elif name == "test_assignments":
            # tests/exercises/test_assignments.py's course pipeline (nbgrader: about three minutes of two cores) on a thread
            # from here, its tests moved last (pytest_collection_modifyitems): it runs beside everything else
            module.start_pipeline_alongside(session.items, session.config._tmp_path_factory.mktemp("course"))


def pytest_sessionfinish(session):
    """A session that stops before tests/test_precision.py's last test does not wait for its second process."""
    module = sys.modules.get("tests.test_precision") or sys.modules.get("test_precision")
    if module is not None and hasattr(module, "stop_alongside"):
        module.stop_alongside()
