"""lightning_edu: the companion package of *Lightning Attention, from the Math to the Kernel*.

The interface: :func:`lightning_attention`, :func:`lightning_attention_backward` and
:func:`lightning_attention_step`, one decoding step (:mod:`.api`), and beside them the normalised variants of
chapter 11, :func:`normalized_attention` (with :func:`normalized_attention_step`) and the softmax/linear
:func:`hybrid_attention`, whose feature maps live in :mod:`.feature_maps`; every argument check in one place
(:mod:`.validation`), and every implementation registered once with what it supports and what it is checked
against (:mod:`.registry`).

The ladder, one module per rung, each checked against the rung below:

* :mod:`.numpy_reference` -- float64 references closest to the math (chapters 01-03)
* :mod:`.numpy_blockwise` -- the paper's Algorithms 1-2 in numpy (chapters 04-05)
* :mod:`.torch_chunked`   -- vectorised PyTorch with a hand-written backward (chapter 06)
* :mod:`.triton_kernels`  -- IO-aware Triton GPU kernels (chapters 07-10)

Trust: :mod:`.checks` (comparisons, the ``cmp`` table), :mod:`.precision` (the error bound of every
backend and dtype), :mod:`.errata` (the printed equations of the Lightning Attention-2 paper and the LA-3
design note, run against autograd).

Side tools: :mod:`.book` (table of contents, notebook helpers, :mod:`.book.plots`, the widgets
:mod:`.book.decay_view` and :mod:`.book.explorer`); the cost model :mod:`.costs`, the timing helpers :mod:`.measure`,
what chapters 06 and 10 measure live (:mod:`.sweeps`, :mod:`.drift`) and the record of where a measurement was taken
(:mod:`.environment`); and :mod:`.exercises`, one checker module per chapter. The drivers that recorded the book's
measurements are not part of the package: they live in the repository's ``benchmarks/`` folder.

Beyond one layer: :mod:`.distributed` (one sequence across processes or GPUs, chapter 12) and :mod:`.models`
(small decoders with a swappable attention, the per-head decay schedules of the implementations, the MQAR
recall task and a training loop; imported on demand, like :mod:`.distributed`).
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

from .api import lightning_attention, lightning_attention_backward, lightning_attention_step  # noqa: E402
from .api import hybrid_attention, normalized_attention, normalized_attention_step  # noqa: E402
from .validation import validate_attention_args  # noqa: E402

__version__ = "0.1.0"
__all__ = ["lightning_attention", "lightning_attention_backward", "lightning_attention_step", "normalized_attention",
           "normalized_attention_step", "hybrid_attention", "validate_attention_args", "__version__"]
