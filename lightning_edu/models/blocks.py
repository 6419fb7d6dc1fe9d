"""A small decoder whose attention can be swapped: softmax, lightning (three kernels), or a feature-map attention.

The model is nanoGPT's shape with today's usual parts::

    tokens -> embedding -> [Block] x layers -> RMSNorm -> (tied embedding)^T -> logits
    Block:  x = x + Attention(RMSNorm(x));   x = x + SwiGLU(RMSNorm(x))

Only the token mixing inside :class:`Attention` changes between the variants (:data:`ATTENTIONS`):

* ``"softmax"``: causal softmax attention (``torch.nn.functional.scaled_dot_product_attention``) with rotary
  position embeddings (RoPE) on q and k.
* ``"lightning"``: :func:`lightning_edu.lightning_attention` on SiLU(q), SiLU(k), v with one fixed decay per
  head (a buffer, from a schedule of :mod:`.decay`), then an RMSNorm over the heads' concatenated outputs, in
  the manner of TransNormerLLM, whose lightning attention has no softmax and no normaliser and relies on a
  norm of its output instead. No position embedding: the decay already tells near from far.
  TransNormerLLM's output gate (the normed output multiplied by a projection of x) is left out.
* ``"la1"``: the same layer with the attention computed by this book's Lightning Attention-1 kernel
  (:func:`lightning_edu.triton_kernels.la1.la1_attention`, the tiled left product, O(n^2 d)): the same
  function as "lightning", at the cost of a quadratic kernel. Triton only (CUDA, or the CPU interpreter).
* ``"fla"``: the same layer with the attention computed by flash-linear-attention's ``chunk_simple_gla``
  (the per-head decay passed as its ``g_gamma = log lambda``, ``scale=1``), when the ``fla`` package imports.
* ``"elu"``: normalized linear attention with the elu+1 feature map (Katharopoulos et al., "Transformers are
  RNNs"), :func:`lightning_edu.normalized_attention`: o_t = phi(q_t) S_t / (phi(q_t) . z_t + eps). By
  default no decay (lambda = 1), as in that paper.
* ``"relu2"``: normalized linear attention with a learned feature map phi(x) = ReLU(x W)^2, one W per layer
  shared by q and k (:class:`lightning_edu.feature_maps.LearnedReLU2`, chapter 11). Decay as for "elu".
* ``"hybrid"``: chapter 11's block: causal softmax inside blocks of ``hybrid_block`` tokens, elu+1 linear
  attention to the earlier blocks, one joint normaliser (:func:`lightning_edu.hybrid_attention`, torch).
  Decay as for "elu".

The channel mixer is SwiGLU (LLaMA) by default; ``mlp="glu"`` takes TransNormerLLM's simple GLU,
down(gate(x) * up(x)) with no activation. :func:`llama` and :func:`tnl` build the two model families of the
Lightning Attention-2 paper's Table 1 at a named size (:data:`SIZES`).

Weights start as in nanoGPT: normal(0, 0.02), norms at 1, no biases anywhere.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..api import hybrid_attention, lightning_attention, normalized_attention
from ..feature_maps import LearnedReLU2
from ..validation import validate_decay, validate_int, validate_tokens
from .decay import decay_schedule

__all__ = ["ATTENTIONS", "MLPS", "SIZES", "RMSNorm", "SwiGLU", "ShortConv", "Attention", "Block", "Decoder", "llama",
           "tnl"]

ATTENTIONS = ("softmax", "lightning", "la1", "fla", "elu", "relu2", "hybrid")
"""The token mixers :class:`Attention` offers."""

_LIGHTNING = ("lightning", "la1", "fla")  # one function (SiLU features, decay, output norm), three kernels

MLPS = ("swiglu", "glu")
"""The channel mixers: LLaMA's SwiGLU, TransNormerLLM's simple GLU (no activation)."""

_BACKENDS = ("auto", "torch", "triton")


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last axis; weight (dim,) starts at 1."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class SwiGLU(nn.Module):
    """The gated MLP: down(SiLU(gate(x)) * up(x)), three bias-free (d_model x hidden) matrices.

    With ``activation=False`` it is TransNormerLLM's simple GLU, down(gate(x) * up(x)): the product of two
    projections is already nonlinear in x, and TransNormerLLM's paper reports no loss from dropping the SiLU.
    """

    def __init__(self, d_model: int, hidden: int, activation: bool = True) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, hidden, bias=False)
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate(x)
        return self.down((F.silu(gate) if self.activation else gate) * self.up(x))


def rope_tables(max_len: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of RoPE's angles t * base^(-2i / head_dim), each (max_len, head_dim / 2), float32."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(max_len, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x_{2i}, x_{2i+1}) of x (..., n, head_dim) by the angle of its position (tables (n, d/2))."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    """Multi-head causal attention, x (batch, n, d_model) -> (batch, n, d_model), with a swappable mixer.

    ``kind`` is one of :data:`ATTENTIONS`. ``decay`` (every kind but softmax) is a schedule name of
    :mod:`.decay` (evaluated for this ``layer`` of ``layers``), a float in (0, 1] or one value per head;
    None means the "alibi" schedule for the lightning kinds and 1.0 (no decay) for elu, relu2 and hybrid.
    The lambdas live in the buffer ``decay`` (float32, (heads,)): they move with the module and are not
    trained. ``backend`` is passed to :func:`lightning_edu.lightning_attention` ("auto": triton on CUDA,
    torch otherwise); "la1" always runs the Triton kernel, "fla" fla's, "hybrid" torch.
    ``hybrid_block`` is the hybrid's softmax block (tokens).

    Parameters: the q, k, v projection (d_model x 3 d_model) and the output projection (d_model x d_model);
    the lightning kinds add their output RMSNorm (d_model), "relu2" its feature map (head_dim x head_dim).
    """

    def __init__(self, d_model: int, heads: int, kind: str = "softmax", *, max_len: int = 2048, decay=None,
                 layer: int = 0, layers: int = 1, backend: str = "auto", hybrid_block: int = 64) -> None:
        super().__init__()
        d_model, heads, max_len, hybrid_block = (validate_int(n, v, 1) for n, v in (
            ("d_model", d_model), ("heads", heads), ("max_len", max_len), ("hybrid_block", hybrid_block)))
        if kind not in ATTENTIONS:
            raise ValueError(f"kind must be one of {ATTENTIONS}, got {kind!r}")
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
        if d_model % heads:
            raise ValueError(f"d_model must be a multiple of heads, got d_model={d_model}, heads={heads}")
        self.kind, self.heads, self.head_dim, self.backend = kind, heads, d_model // heads, backend
        self.hybrid_block = hybrid_block
        if kind == "softmax" and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head dimension, got d_model / heads = {self.head_dim}")
        if kind == "softmax" and decay is not None:
            raise ValueError("decay applies to the linear kinds only, not to 'softmax'")
        if kind == "fla":
            _import_fla()  # refused here, at construction, when fla is not installed
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.norm = RMSNorm(d_model) if kind in _LIGHTNING else None
        self.feature = LearnedReLU2(self.head_dim) if kind == "relu2" else None
        if kind == "softmax":
            cos, sin = rope_tables(max_len, self.head_dim)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        else:
            lambdas = self._lambdas(decay, layer, layers)
            self.register_buffer("decay", torch.tensor(lambdas, dtype=torch.float32))
            # la1 takes the lambdas from the host: kept as floats so that no call reads them back from a GPU.
            self._decay_floats = [float(x) for x in lambdas]

    def _lambdas(self, decay, layer: int, layers: int) -> np.ndarray:
        if decay is None:
            decay = "alibi" if self.kind in _LIGHTNING else 1.0
        if isinstance(decay, str):
            return decay_schedule(decay, self.heads, layer, layers)
        # checked as lightning_attention checks it: a float or one value per head in (0, 1]; not a bool, and not
        # a tensor that requires grad (the buffer is not trained: that gradient would be dropped)
        return validate_decay(decay, self.heads)

    def split_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v, each (batch, heads, n, head_dim), from x (batch, n, d_model)."""
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return q, k, v

    def mix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The token mixing alone: (batch, heads, n, head_dim) in, the same shape out (before any norm)."""
        if self.kind == "softmax":
            n = q.shape[-2]
            cos, sin = self.rope_cos[:n], self.rope_sin[:n]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if self.kind == "lightning":
            return lightning_attention(F.silu(q), F.silu(k), v, self.decay, backend=self.backend)
        if self.kind == "la1":
            from ..triton_kernels.la1 import la1_attention
            return la1_attention(F.silu(q), F.silu(k), v, self._decay_floats)
        if self.kind == "fla":
            return _fla_attention(F.silu(q), F.silu(k), v, self.decay)
        backend = "torch" if self.backend == "triton" and self.kind == "hybrid" else self.backend
        if self.kind == "hybrid":
            return hybrid_attention(q, k, v, self.decay, block_size=self.hybrid_block, backend=backend)
        feature_map = "elu+1" if self.kind == "elu" else self.feature
        return normalized_attention(q, k, v, self.decay, feature_map=feature_map, backend=backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        o = self.mix(*self.split_heads(x)).transpose(1, 2).reshape(b, n, d)
        if self.norm is not None:
            o = self.norm(o)
        return self.out(o)


def _import_fla():
    try:
        from fla.ops.simple_gla import chunk_simple_gla
    except ImportError as exc:
        raise ValueError("attention 'fla' needs the flash-linear-attention package (pip install fla-core), "
                         f"which did not import: {exc}") from exc
    return chunk_simple_gla


def _fla_attention(q, k, v, decay: torch.Tensor) -> torch.Tensor:
    """fla's chunk_simple_gla on (batch, heads, n, d) tensors: it wants (batch, n, heads, d) and g_gamma = log lambda."""
    to_bthd = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731
    o = _import_fla()(to_bthd(q), to_bthd(k), to_bthd(v), g_gamma=decay.log(), scale=1.0)[0]
    return o.transpose(1, 2)


class ShortConv(nn.Module):
    """A causal depthwise convolution over the sequence, x (batch, n, d) -> (batch, n, d): each channel's output at
    token t is a learned mix of that channel at tokens t - width + 1 .. t (zeros before the first token).

    Why. The Zoology study of recall ("Zoology: Measuring and Improving Recall in Efficient Language Models") puts one
    before every token mixer, and Based pairs linear attention with it: it lets a layer move a token's features to
    the next position (the key beside its value) without asking the attention to tell near from far. Weights:
    d x width, PyTorch's default initialisation of a convolution."""

    def __init__(self, d_model: int, width: int) -> None:
        super().__init__()
        self.width = validate_int("width", width, 2)
        self.conv = nn.Conv1d(d_model, d_model, self.width, groups=d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.pad(x.transpose(1, 2), (self.width - 1, 0))  # (batch, d, width - 1 + n): zeros before token 0
        return self.conv(x).transpose(1, 2)


class Block(nn.Module):
    """One pre-norm decoder block: x + Attention(RMSNorm(x)), then + MLP(RMSNorm(x)) (SwiGLU or simple GLU).
    With ``short_conv`` >= 2 a :class:`ShortConv` of that width stands between the norm and the attention:
    x + Attention(ShortConv(RMSNorm(x)))."""

    def __init__(self, d_model: int, heads: int, mlp_hidden: int, attention: str = "softmax", mlp: str = "swiglu",
                 short_conv: int = 0, **attention_kw) -> None:
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(d_model), RMSNorm(d_model)
        self.conv = ShortConv(d_model, short_conv) if short_conv else None
        self.attn = Attention(d_model, heads, attention, **attention_kw)
        self.mlp = SwiGLU(d_model, mlp_hidden, activation=mlp == "swiglu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h if self.conv is None else self.conv(h))
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    """A decoder-only language model: ``forward(tokens (batch, n) int64) -> logits (batch, n, vocab)``.

    ``attention`` is one of :data:`ATTENTIONS`; ``decay``, ``backend`` and ``hybrid_block`` go to every
    :class:`Attention` (a schedule name is evaluated per layer, so "fla_lightning" and "minimax01" change with
    depth). ``mlp`` is one of :data:`MLPS`. ``mlp_hidden`` defaults to 8 d_model / 3 rounded up to a multiple
    of 8 (the three matrices then hold about as many weights as a 4 d_model GELU MLP's two). The output layer
    reuses the embedding matrix (tied embeddings). Sequences longer than ``max_len`` are refused (RoPE's
    tables stop there). ``checkpoint=True`` recomputes each block's activations in the backward pass instead
    of keeping them (activation checkpointing: memory for one block's activations, about a third more compute).
    ``short_conv``: 0 (none) or the width (>= 2) of a :class:`ShortConv` before every block's attention, the
    published recall setup (Zoology, Based).

    Parameter count: vocab d + layers (4 d^2 + 3 d h + 2 d + extra) + d, with d = d_model, h = mlp_hidden and
    extra = d for the lightning kinds' output norm, (d / heads)^2 for relu2's feature map, 0 otherwise, plus
    d short_conv per layer with a short convolution; :meth:`n_params` counts it from the module.
    """

    def __init__(self, vocab: int, d_model: int, heads: int, layers: int, attention: str = "softmax", *,
                 max_len: int = 2048, mlp_hidden: int | None = None, mlp: str = "swiglu", decay=None,
                 backend: str = "auto", hybrid_block: int = 64, checkpoint: bool = False, short_conv: int = 0) -> None:
        super().__init__()
        vocab, layers, max_len = (validate_int(n, v, 1) for n, v in
                                  (("vocab", vocab), ("layers", layers), ("max_len", max_len)))
        short_conv = validate_int("short_conv", short_conv, 0)
        if short_conv == 1:
            raise ValueError("short_conv must be 0 (no convolution) or a width of at least 2, got 1")
        d_model = validate_int("d_model", d_model, 1)
        mlp_hidden = 8 * math.ceil(8 * d_model / 3 / 8) if mlp_hidden is None else validate_int("mlp_hidden", mlp_hidden, 1)
        if mlp not in MLPS:
            raise ValueError(f"mlp must be one of {MLPS}, got {mlp!r}")
        if not isinstance(checkpoint, bool):
            raise TypeError(f"checkpoint must be True or False, got {checkpoint!r}")
        self.vocab, self.max_len, self.checkpoint = vocab, max_len, checkpoint
        self.embed = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(
            Block(d_model, heads, mlp_hidden, attention, mlp, short_conv, max_len=max_len, decay=decay, layer=i,
                  layers=layers, backend=backend, hybrid_block=hybrid_block)
            for i in range(layers))
        self.norm = RMSNorm(d_model)
        for name, p in self.named_parameters():
            if p.ndim == 2 and not name.endswith("feature.W"):  # relu2's map keeps its own d^-1/2 start
                nn.init.normal_(p, mean=0.0, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (batch, n, vocab) of tokens (batch, n), ids in [0, vocab). Ids on the CPU are checked on the host
        (ValueError); on a GPU reading them would make the host wait on every step, so there an id out of range
        gives NaN logits (its row of the embedding is NaN) instead of a device-side assert."""
        if not validate_tokens(tokens, self.vocab, self.max_len):  # not read on the host: checked on the device
            bad = (tokens < 0) | (tokens >= self.vocab)
            x = self.embed(tokens.clamp(0, self.vocab - 1)).masked_fill(bad[..., None], float("nan"))
        else:
            x = self.embed(tokens)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpoint and torch.is_grad_enabled() else block(x)
        return F.linear(self.norm(x), self.embed.weight)

    def n_params(self) -> int:
        """The number of trainable weights (the tied embedding counted once)."""
        return sum(p.numel() for p in self.parameters())


SIZES = {
    "tiny": dict(d_model=64, heads=2, layers=2),
    "0.1B": dict(d_model=768, heads=6, layers=12),
    "0.4B": dict(d_model=1024, heads=8, layers=24),
}
"""Named model sizes (width, heads, depth), after the paper's Table 1 rows. With a 32000-token vocabulary (LLaMA's)
"0.1B" holds 0.11 billion weights and "0.4B" 0.34 billion, both with heads of 128 dimensions. "tiny" (heads of 32)
is for a CPU."""


def _size(size: str) -> dict:
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    return SIZES[size]


def llama(vocab: int, size: str = "0.4B", **kw) -> Decoder:
    """The softmax baseline of the paper's Table 1, LLaMA-style: RoPE, causal SDPA (FlashAttention on a GPU),
    SwiGLU, RMSNorm. ``kw`` goes to :class:`Decoder` (max_len, checkpoint, ...)."""
    return Decoder(vocab, **_size(size), attention="softmax", mlp="swiglu", **kw)


def tnl(vocab: int, size: str = "0.4B", attention: str = "lightning", **kw) -> Decoder:
    """TransNormerLLM-style: lightning attention with TransNormerLLM's per-head decay (the "fla_lightning"
    schedule, which follows TransNormerLLM's formula), an RMSNorm on the attention output and the simple GLU.
    ``attention`` picks the kernel: "lightning" (this book's), "la1" or "fla". ``kw`` goes to :class:`Decoder`.
    """
    if attention not in _LIGHTNING:
        raise ValueError(f"attention must be one of {_LIGHTNING} for a TransNormerLLM model, got {attention!r}")
    kw.setdefault("decay", "fla_lightning")
    return Decoder(vocab, **_size(size), attention=attention, mlp="glu", **kw)
