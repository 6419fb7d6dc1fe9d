"""lightning_edu: the companion package of *Lightning Attention, from the Math to the Kernel*.

The ladder, one module per rung (each checked against the rung below):

* :mod:`~lightning_edu.numpy_reference` -- float64 references closest to the math (chapters 01-03)
* :mod:`~lightning_edu.numpy_blockwise` -- the paper's Algorithms 1-2 in numpy (chapters 04-05)
* :mod:`~lightning_edu.torch_chunked`   -- vectorised PyTorch with a hand-written backward (chapter 06)
* :mod:`~lightning_edu.triton_kernels`  -- IO-aware Triton GPU kernels (chapters 07-08)

Side tools: :mod:`~lightning_edu.validation` (every argument check), :mod:`~lightning_edu.checks`
(comparisons), :mod:`~lightning_edu.errata` (the seeds' equations as printed, run against autograd),
:mod:`~lightning_edu.costs` (analytic cost model), :mod:`~lightning_edu.decay_view` and
:mod:`~lightning_edu.explorer` (widgets with static twins), :mod:`~lightning_edu.plots`,
:mod:`~lightning_edu.measure` (CPU timing and memory), :mod:`~lightning_edu.torch_sweep` and
:mod:`~lightning_edu.bench` (CPU/GPU sweeps), :mod:`~lightning_edu.book` (table of contents, notebook
helpers), and :mod:`~lightning_edu.exercises` (one checker module per chapter).
"""

from __future__ import annotations

import os as _os


def _configure_triton_interpreter() -> None:
    # Triton reads TRITON_INTERPRET when a kernel is decorated, so it must be set before any kernel module
    # is imported. Without CUDA we run kernels in Triton's CPU interpreter (fp32/fp16 only: its bf16 is wrong).
    if "TRITON_INTERPRET" in _os.environ:
        return
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover - torch is a dependency
        has_cuda = False
    if not has_cuda:
        _os.environ["TRITON_INTERPRET"] = "1"


_configure_triton_interpreter()

from .api import lightning_attention, lightning_attention_backward  # noqa: E402
from .validation import validate_attention_args  # noqa: E402

__version__ = "0.1.0"
__all__ = ["lightning_attention", "lightning_attention_backward", "validate_attention_args", "__version__"]
