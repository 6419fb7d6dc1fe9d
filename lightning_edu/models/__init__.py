"""Small, readable models for measuring lightning attention in use: speed against context length and quality.

* :mod:`.decay`  -- the per-head decay schedules lambda_h, each a named, documented formula
* :mod:`.blocks` -- a decoder (pre-RMSNorm blocks, SwiGLU MLP, tied embeddings) whose attention is swappable:
  softmax, lightning (this book's kernel, LA-1 or fla's), elu+1, learned ReLU^2 or the hybrid;
  :func:`.llama` and :func:`.tnl` build the two families of the Lightning Attention-2 paper's Table 1
* :mod:`.mqar`   -- multi-query associative recall (MQAR) batches, a recall test for small models
* :mod:`.train`  -- a plain AdamW training loop with a progress bar, and MQAR accuracy
"""

from __future__ import annotations

from .blocks import ATTENTIONS, MLPS, SIZES, Attention, Block, Decoder, RMSNorm, SwiGLU, llama, tnl
from .decay import SCHEDULES, decay_schedule
from .mqar import mqar_batch, mqar_batches
from .train import evaluate_mqar, train

__all__ = ["ATTENTIONS", "MLPS", "SIZES", "Attention", "Block", "Decoder", "RMSNorm", "SwiGLU", "llama", "tnl", "SCHEDULES", "decay_schedule",
           "mqar_batch", "mqar_batches", "evaluate_mqar", "train"]
