"""Loaded by pytest for the tests and the notebooks alike (``pytest --nbval tests notebooks``)."""

import atexit
import os
import shutil
import tempfile

# matplotlib keeps its font list in ~/.cache/matplotlib, shared by every environment on the machine: a list built
# by another environment (or one cut short) can name fonts this one lacks, and every plot then writes "findfont"
# warnings to stderr, which nbval compares with the committed outputs. The test session builds its own list here,
# before any notebook kernel (which inherits this environment) starts.
if "MPLCONFIGDIR" not in os.environ:
    os.environ["MPLCONFIGDIR"] = tempfile.mkdtemp(prefix="lightning_edu_mpl_")
    atexit.register(shutil.rmtree, os.environ["MPLCONFIGDIR"], True)
import matplotlib.font_manager  # noqa: E402,F401  (builds the font list in MPLCONFIGDIR)


def pytest_configure(config):
    """nbval's notebook kernels talk over Unix sockets in a folder of this run's own, not over TCP ports:
    jupyter_client picks a port, frees it and hands it to the kernel to bind, so another process on the machine can
    take it in between (the course pipeline's autograde kernels once waited ten minutes on one;
    tests/exercises/test_assignments.py does the same for them)."""
    if os.name != "posix":
        return
    try:
        import nbval.kernel
    except ImportError:
        return
    sockets = tempfile.mkdtemp(prefix="nbval-kernels-")
    config.add_cleanup(lambda: shutil.rmtree(sockets, ignore_errors=True))
    base = nbval.kernel.KernelManager

    class UnixSocketKernelManager(base):
        def __init__(self, **kwargs):
            kwargs.setdefault("transport", "ipc")
            kwargs.setdefault("ip", os.path.join(sockets, "k"))
            super().__init__(**kwargs)

    nbval.kernel.KernelManager = UnixSocketKernelManager
