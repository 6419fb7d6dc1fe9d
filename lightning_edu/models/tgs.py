"""Training speed against context length: the Lightning Attention-2 paper's Table 1, measured on one GPU.

    python -m benchmarks.tgs --out tgs.json                          # 0.4B and 0.1B, contexts 1K-92K
    python -m benchmarks.tgs --sizes 0.1B --models llama tnl --contexts 1024 8192 --out small.json

TGS (tokens per GPU per second) of a whole training step: forward, backward and AdamW update of a decoder
(:mod:`lightning_edu.models`), bf16 autocast, activation checkpointing on every block, random tokens from a
32000-token vocabulary. Each step carries ``--tokens`` tokens (batch = tokens / context), or one sequence
when the context is longer. Four models per size, the paper's three and fla's kernel:

* ``llama``   -- LLaMA-style, causal softmax attention through PyTorch's SDPA (FlashAttention kernels)
* ``tnl``     -- TransNormerLLM-style with this book's lightning attention (Triton, ``backend="triton"``)
* ``tnl_la1`` -- the same model with this book's Lightning Attention-1 kernel (quadratic)
* ``tnl_fla`` -- the same model with flash-linear-attention's ``chunk_simple_gla`` (when fla imports)

For each (size, model, context): ``--warmup`` steps (compilation, autotuning), then the median over
``--steps`` timed steps (``torch.cuda.Event`` around each), and the peak memory of the timed steps. A step
that runs out of memory is recorded as "OOM". Results are written after every point; past ``--budget``
seconds the remaining points are listed as skipped. Refuses to run without CUDA: CPU numbers would say
nothing about the GPU.
"""

from __future__ import annotations

import numpy as np

__all__ = ["MODELS", "PAPER_TABLE1", "build", "fit_tgs"]

MODELS = ("tnl", "tnl_fla", "llama", "tnl_la1")


PAPER_CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 81920, 94208)

PAPER_TABLE1 = {
    "contexts": PAPER_CONTEXTS,
    "hardware": "2 x A100 80GB",
    "tgs": {
        "0.4B": {"LLaMA-FA2": (35931, 32453, 28184, 21996, 15479, 9715, 5643, 4604, 4078),
                 "TNL-LA1": (41789, 39043, 34894, 28627, 21112, 13852, 8247, 6824, 6012),
                 "TNL-LA2": (38615, 38680, 38714, 38172, 37755, 37364, 38278, 38457, 38596)},
        "1B": {"LLaMA-FA2": (14897, 13990, 12644, 10887, 8468, 5836, 3820, 3167, None),
               "TNL-LA1": (21195, 20128, 18553, 16012, 12594, 8848, 5611, 4625, None),
               "TNL-LA2": (20052, 19967, 20009, 19841, 19805, 19691, 20077, 20186, None)},
        "3B": {"LLaMA-FA2": (7117, 6708, 6008, 4968, 3755, 2558, None, None, None),
               "TNL-LA1": (8001, 7649, 7117, 6152, 4859, 3512, None, None, None),
               "TNL-LA2": (7524, 7593, 7599, 7559, 7545, 7545, None, None, None)},
    },
}
"""The Lightning Attention-2 paper's Table 1: TGS on 2 x A100 80GB at the contexts above (None: out of memory)."""


def fit_tgs(contexts, tgs) -> tuple[float, float]:
    """(a, b) of the straight line ``1 / TGS = a + b T`` fitted by least squares: seconds per token. (Chapter 13.)

    a is what a token costs whatever the context (projections, MLP, output layer, optimiser); b what each token
    of context adds to it (softmax attention and LA-1 compute about T / 2 scores per token). For lightning
    attention b should be about 0. Points whose TGS is None (out of memory) are left out; at least two must remain.
    """
    contexts, tgs = list(contexts), list(tgs)
    if len(contexts) != len(tgs):
        raise ValueError(f"contexts and tgs must have the same length, got {len(contexts)} and {len(tgs)}")
    pairs = [(float(T), float(x)) for T, x in zip(contexts, tgs) if x is not None]
    if len(pairs) < 2:
        raise ValueError(f"fit_tgs needs at least two measured points, got {len(pairs)}")
    T, x = np.array(pairs).T
    if not np.all(x > 0):
        raise ValueError("every TGS must be > 0")
    b, a = np.polyfit(T, 1.0 / x, 1)
    return float(a), float(b)


def build(model: str, size: str, vocab: int, max_len: int):
    """The decoder named ``model`` (one of :data:`MODELS`) at ``size``, with activation checkpointing."""
    from . import llama, tnl

    if model not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {model!r}")
    if model == "llama":
        return llama(vocab, size, max_len=max_len, checkpoint=True)
    attention = {"tnl": "lightning", "tnl_la1": "la1", "tnl_fla": "fla"}[model]
    return tnl(vocab, size, attention, max_len=max_len, checkpoint=True, backend="triton")
