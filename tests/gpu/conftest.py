"""GPU tests: every test module in this folder needs CUDA, and is skipped as a whole without it.

Run them on a GPU machine with TRITON_INTERPRET unset: `python -m pytest tests/gpu`.
"""

from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (tests/gpu runs on the GPU machine)")
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)
