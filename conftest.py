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
