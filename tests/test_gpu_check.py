"""The GPU check's driver (.ci/gpu_check.py) on a machine without CUDA: what it can do here. Its runs on a GPU are
recorded in notebooks/data/gpu_check_*.json."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / ".ci" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


@pytest.mark.parametrize("junit, node", [
    ("tests.triton_kernels.test_triton_la2::test_variant[cuda-la3-1x2x4099x128x128]@la3 fp32 d=128",
     "tests/triton_kernels/test_triton_la2.py::test_variant[cuda-la3-1x2x4099x128x128]"),
    ("tests.triton_kernels.test_no_sync::test_x[a.b]", "tests/triton_kernels/test_no_sync.py::test_x[a.b]"),
    ("tests.test_registry::test_x[a.b]", "tests/test_registry.py::test_x[a.b]"),
    ("notebooks.08_triton_backward.ipynb::Cell 30", "notebooks/08_triton_backward.ipynb::Cell 30"),
])
def test_junit_names_become_the_node_ids_conftest_orders_by(junit, node):
    assert gpu_check.node_id(junit) == node


def test_junit_counts_and_failures(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text("""<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="3">
<testcase classname="tests.test_a" name="test_ok" time="2.5"/>
<testcase classname="tests.test_a" name="test_bad[x]" time="1.0"><failure message="AssertionError: 3 != 4">tb</failure></testcase>
<testcase classname="tests.test_a" name="test_skip" time="0.0"><skipped message="no"/></testcase>
</testsuite></testsuites>""")
    counts = gpu_check.junit_counts(xml)
    assert (counts["tests"], counts["passed"], counts["failed"], counts["skipped"]) == (3, 1, 1, 1)
    assert counts["failures"] == [{"test": "tests.test_a::test_bad[x]", "error": "AssertionError: 3 != 4"}]
    assert counts["durations_s"]["tests/test_a.py::test_ok"] == 2.5


@pytest.mark.parametrize("args, says", [([], "no CUDA device"), (["--workers", "0"], "--workers must be")])
def test_it_refuses_in_one_line_with_exit_2(args, says):
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_available() and not args:
        pytest.skip("CUDA is here: the check would run")
    done = subprocess.run([sys.executable, str(ROOT / ".ci" / "gpu_check.py"), *args], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert says in done.stderr and len(done.stderr.strip().splitlines()) == 1
