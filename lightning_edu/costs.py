"""An analytic cost model: FLOPs, memory traffic and sequential steps of three ways to compute
causal linear attention with decay. (Chapter 04; chapters 07-08 compare it with measured kernels.)

Counts are exact for the computation each algorithm performs as written in this package, per
(batch, head), times ``batch * heads``. One multiply-add is 2 FLOPs; an elementwise multiply or add
is 1 FLOP. Decay factors (M, lambda^(r+1), lambda^(b-1-r), lambda^b) depend only on lambda and the
block length, so a kernel builds them once: they are not counted.

============  ==========================================================  ====================
algorithm     what is counted                                             sequential steps
============  ==========================================================  ====================
masked        [(Q K^T) * M] V over the full n x n matrix (what numpy      1
              computes: the upper triangle is computed, then zeroed)
recurrent     KV_t = lambda KV_{t-1} + k_t^T v_t;  o_t = q_t KV_t         n
blockwise     Algorithm 1 (or 2 with ``direction="backward"``), blocks    ceil(n / B) (2x that
              of B rows, the last one possibly shorter                    backward: two sweeps)
============  ==========================================================  ====================

FLOPs are split three ways: ``intra`` (the masked products inside a block: all of the masked
algorithm), ``inter`` (products of a block with the carried state, and adding them to the intra
part) and ``state`` (updating the carried d_k x d_v state).

Memory, in bytes of ``dtype_bytes`` per element:

* ``hbm_bytes``: traffic to and from off-chip memory for an IO-aware kernel. The recurrent and
  blockwise kernels read Q, K, V (and dO) once and write O (or dQ, dK, dV) once; the state never leaves
  the chip. The masked product is three library calls, so its n x n matrix (Q K^T) * M is written to
  HBM once and read back once.
* ``sram_bytes_per_block``: the working set one step keeps on chip. Blockwise: the Q_i, K_i, V_i, O_i
  tiles, the B x B score tile and mask M, and the state. Recurrent: one row of each and the state.
  Masked: the whole n x n matrix (the "block" is the whole sequence), which is why it cannot stay on chip.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .validation import check_finite_scalar, validate_choice, validate_positive_int

__all__ = [
    "Cost", "Hardware", "attention_cost", "block_size_sweep", "modelled_time", "la1_cost", "la3_cost",
    "one_pass_balance", "optimal_block_size", "hbm_floor_bytes", "MODEL", "CONTEXTS", "MEMORY_CONTEXTS",
    "kv_cache_bytes", "state_bytes", "step_floor_bytes", "memory_table",
]

ALGORITHMS = ("masked", "recurrent", "blockwise")
DIRECTIONS = ("forward", "backward")


@dataclass(frozen=True)
class Cost:
    """The modelled cost of one call over ``batch * heads`` (batch, head) pairs. (Chapter 04.)"""

    algorithm: str
    direction: str
    n: int
    d_k: int
    d_v: int
    block_size: int  # rows per block (n for masked, 1 for recurrent)
    batch: int
    heads: int
    dtype_bytes: int
    num_blocks: int
    sequential_steps: int
    intra_flops: int
    inter_flops: int
    state_flops: int
    hbm_bytes: int
    sram_bytes_per_block: int

    @property
    def flops(self) -> int:
        """All FLOPs: intra + inter + state."""
        return self.intra_flops + self.inter_flops + self.state_flops

    @property
    def arithmetic_intensity(self) -> float:
        """FLOPs per byte of HBM traffic."""
        return self.flops / self.hbm_bytes


def _block_lengths(n: int, block: int) -> list[tuple[int, int]]:
    """(rows b, how many blocks have b rows): full blocks, then the partial last one if any."""
    full, rest = divmod(n, block)
    out = [(block, full)] if full else []
    if rest:
        out.append((rest, 1))
    return out


def _blockwise_forward_flops(b: int, d_k: int, d_v: int) -> tuple[int, int, int]:
    """FLOPs of one forward block of b rows: (intra, inter, state), as blockwise_forward computes it."""
    intra = 2 * b * b * d_k + b * b + 2 * b * b * d_v  # Q_i K_i^T, * M, (.) V_i
    inter = b * d_k + 2 * b * d_k * d_v + b * d_v  # lambda^(r+1) Q_i, (.) KV, intra + inter
    state = d_k * d_v + b * d_k + 2 * b * d_k * d_v + d_k * d_v  # lambda^b KV, lambda^(b-1-r) K_i, (.)^T V_i, +
    return intra, inter, state


def _blockwise_backward_flops(b: int, d_k: int, d_v: int) -> tuple[int, int, int]:
    """FLOPs of one block in both sweeps of blockwise_backward: (intra, inter, state)."""
    # intra: dQ: (dO V^T) * M then K; dK: (dO V^T) * M again then Q; dV: (Q K^T) * M then dO.
    intra = (2 * b * b * d_v + b * b + 2 * b * b * d_k) * 2 + (2 * b * b * d_k + b * b + 2 * b * b * d_v)
    # inter: dQ: dO KV^T, lambda^(r+1) (.), add; dK: V dKV^T, lambda^(b-1-r) (.), add; dV: K dKV, scale, add.
    inter = (2 * b * d_v * d_k + 2 * b * d_k) + (2 * b * d_v * d_k + 2 * b * d_k) + (2 * b * d_k * d_v + 2 * b * d_v)
    # state: the forward sweep rebuilds KV (as in the forward pass); the reverse sweep updates dKV.
    kv = 2 * d_k * d_v + b * d_k + 2 * b * d_k * d_v
    dkv = 2 * d_k * d_v + b * d_k + 2 * b * d_k * d_v
    return intra, inter, kv + dkv


def attention_cost(
    algorithm: str,
    n: int,
    d_k: int,
    d_v: int | None = None,
    block_size: int | None = None,
    *,
    batch: int = 1,
    heads: int = 1,
    dtype_bytes: int = 4,
    direction: str = "forward",
) -> Cost:
    """The modelled cost of ``algorithm`` ("masked", "recurrent" or "blockwise") on q, k of shape
    (batch, heads, n, d_k) and v of shape (batch, heads, n, d_v). ``block_size`` B is required for
    "blockwise" (and ignored otherwise); ``d_v`` defaults to ``d_k``. ``direction="backward"`` (blockwise
    only) counts Algorithm 2: dQ, dK, dV from dO. Returns a :class:`Cost`. (Chapter 04.)
    """
    algorithm = validate_choice("algorithm", algorithm, ALGORITHMS)
    direction = validate_choice("direction", direction, DIRECTIONS)
    n = validate_positive_int("n", n)
    d_k = validate_positive_int("d_k", d_k)
    d_v = d_k if d_v is None else validate_positive_int("d_v", d_v)
    batch = validate_positive_int("batch", batch)
    heads = validate_positive_int("heads", heads)
    dtype_bytes = validate_positive_int("dtype_bytes", dtype_bytes)
    if direction == "backward" and algorithm != "blockwise":
        raise ValueError(f"direction='backward' is modelled for algorithm='blockwise' only, got algorithm={algorithm!r}")
    if algorithm == "blockwise":
        if block_size is None:
            raise ValueError("block_size must be a positive integer for algorithm='blockwise', got None")
        block = validate_positive_int("block_size", block_size)
    else:
        block = n if algorithm == "masked" else 1
    pairs = batch * heads
    io_elements = n * (2 * d_k + 2 * d_v)  # read Q, K, V; write O
    if direction == "backward":
        # forward sweep reads K, V, dO and writes dQ; reverse sweep reads Q, K, V, dO and writes dK, dV
        io_elements = n * (3 * d_k + 4 * d_v) + n * (2 * d_k + d_v)

    if algorithm == "masked":
        intra, inter, state = 2 * n * n * d_k + n * n + 2 * n * n * d_v, 0, 0
        hbm = io_elements + 2 * n * n  # (Q K^T) * M written once and read once
        sram = n * n
        num_blocks, steps = 1, 1
    elif algorithm == "recurrent":
        # per token: lambda KV (d_k d_v), k_t^T v_t (d_k d_v), the add (d_k d_v); q_t KV_t (2 d_k d_v)
        intra, inter, state = 0, 2 * n * d_k * d_v, 3 * n * d_k * d_v
        hbm = io_elements
        sram = 2 * d_k + 2 * d_v + d_k * d_v
        num_blocks, steps = n, n
    else:
        per_block = _blockwise_backward_flops if direction == "backward" else _blockwise_forward_flops
        intra = inter = state = 0
        num_blocks = 0
        for b, count in _block_lengths(n, block):
            fi, fo, fs = per_block(b, d_k, d_v)
            intra, inter, state = intra + count * fi, inter + count * fo, state + count * fs
            num_blocks += count
        hbm = io_elements
        rows = min(block, n)
        if direction == "forward":
            # Q_i, K_i, V_i, O_i tiles; the score tile and M; the state KV
            sram = rows * (2 * d_k + 2 * d_v) + 2 * rows * rows + d_k * d_v
        else:
            # reverse sweep: Q_i, K_i, V_i, dO_i in, dK_i, dV_i out; two score tiles and M; dKV
            sram = rows * (3 * d_k + 3 * d_v) + 3 * rows * rows + d_k * d_v
        steps = num_blocks * (2 if direction == "backward" else 1)
    return Cost(
        algorithm=algorithm,
        direction=direction,
        n=n,
        d_k=d_k,
        d_v=d_v,
        block_size=block,
        batch=batch,
        heads=heads,
        dtype_bytes=dtype_bytes,
        num_blocks=num_blocks,
        sequential_steps=steps,
        intra_flops=pairs * intra,
        inter_flops=pairs * inter,
        state_flops=pairs * state,
        hbm_bytes=pairs * hbm * dtype_bytes,
        sram_bytes_per_block=sram * dtype_bytes,
    )


@dataclass(frozen=True)
class Hardware:
    """A toy accelerator for :func:`modelled_time`. Defaults are A100-like (bf16 tensor cores).

    ``step_latency`` is the fixed time of one sequential step of one (batch, head) chain: loading the
    next tiles, synchronising, issuing the products. Chains of different (batch, head) pairs run at
    the same time, so only one chain's steps add up.
    """

    peak_flops: float = 312e12  # FLOP/s
    hbm_bandwidth: float = 2.0e12  # bytes/s
    sram_bytes: int = 192 * 1024  # on-chip memory of one streaming multiprocessor
    step_latency: float = 1e-6  # seconds per sequential step

    def __post_init__(self):
        for name in ("peak_flops", "hbm_bandwidth", "step_latency"):
            value = check_finite_scalar(name, getattr(self, name))
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        validate_positive_int("sram_bytes", self.sram_bytes)


def modelled_time(cost: Cost, hardware: Hardware | None = None, *, check_sram: bool = True) -> float:
    """Seconds by a deliberately simple model: FLOPs at peak + bytes at full bandwidth + the latency of
    every sequential step. Inf when one block's working set does not fit on chip (unless
    ``check_sram=False``). (Chapter 04.)

    Large B: more intra FLOPs (they grow like n B); small B: more sequential steps (n / B). The best B
    balances the two; see :func:`optimal_block_size`.
    """
    if not isinstance(cost, Cost):
        raise TypeError(f"cost must be a lightning_edu.costs.Cost, got {type(cost).__name__}")
    hw = Hardware() if hardware is None else hardware
    if not isinstance(hw, Hardware):
        raise TypeError(f"hardware must be a lightning_edu.costs.Hardware or None, got {type(hw).__name__}")
    if check_sram and cost.algorithm == "blockwise" and cost.sram_bytes_per_block > hw.sram_bytes:
        return math.inf
    return cost.flops / hw.peak_flops + cost.hbm_bytes / hw.hbm_bandwidth + cost.sequential_steps * hw.step_latency


POWERS_OF_TWO = tuple(2**p for p in range(4, 11))  # 16 .. 1024, the explorer's choices


def block_size_sweep(n, d_k, d_v=None, block_sizes=POWERS_OF_TWO, **kwargs) -> list[Cost]:
    """Blockwise costs for each block size (keyword arguments as :func:`attention_cost`)."""
    if isinstance(block_sizes, (str, bytes)) or not hasattr(block_sizes, "__iter__"):
        raise TypeError(f"block_sizes must be a sequence of positive integers, got {type(block_sizes).__name__}")
    sizes = [validate_positive_int("block_sizes[i]", b) for b in block_sizes]
    if not sizes:
        raise ValueError("block_sizes must hold at least one block size, got an empty sequence")
    return [attention_cost("blockwise", n, d_k, d_v, b, **kwargs) for b in sizes]


def optimal_block_size(
    n, d_k, d_v=None, block_sizes=POWERS_OF_TWO, hardware: Hardware | None = None, *, check_sram: bool = True, **kwargs
) -> int:
    """The block size with the least :func:`modelled_time` among ``block_sizes`` (ties: the smaller B).

    Raises ValueError when no block fits on chip. (Chapter 04.)
    """
    costs = block_size_sweep(n, d_k, d_v, block_sizes, **kwargs)
    times = [modelled_time(c, hardware, check_sram=check_sram) for c in costs]
    best = min(range(len(costs)), key=lambda i: (times[i], costs[i].block_size))
    if math.isinf(times[best]):
        raise ValueError(f"no block size in {[c.block_size for c in costs]} fits in sram_bytes of the hardware")
    return costs[best].block_size


def la1_cost(n: int, d_k: int, d_v: int | None = None, block_size: int = 64, *, batch: int = 1, heads: int = 1,
             dtype_bytes: int = 2, direction: str = "forward") -> dict:
    """FLOPs and HBM bytes of the LA-1 kernels (:mod:`lightning_edu.triton_kernels.la1`), per call, counting padded tiles. (Chapters 07-08.)

    Bytes assume no cache reuse: each program re-reads the key/value (or query/dO) tiles of every block
    pair it visits, as the loops are written. With t = ceil(n / B) blocks there are t (t + 1) / 2 block pairs
    on or below the diagonal; each costs 2 dots of B x B x d in the forward, 6 in the backward (dQ: 2;
    dK and dV: 4). Returns a dict with ``flops``, ``hbm_bytes`` and ``pairs`` (block pairs per head).
    """
    direction = validate_choice("direction", direction, ("forward", "backward"))
    n, d_k = validate_positive_int("n", n), validate_positive_int("d_k", d_k)
    d_v = d_k if d_v is None else validate_positive_int("d_v", d_v)
    block = validate_positive_int("block_size", block_size)
    heads_total = validate_positive_int("batch", batch) * validate_positive_int("heads", heads)
    dtype_bytes = validate_positive_int("dtype_bytes", dtype_bytes)
    t = -(-n // block)
    pairs = t * (t + 1) // 2
    dot_kv = 2 * block * block * (d_k + d_v)  # Q K^T and P V (or their backward twins): one pair, both dots
    if direction == "forward":
        flops = pairs * dot_kv
        # per query block: Q_i in, O_i out; per pair: K_j, V_j in
        elements = t * block * (d_k + d_v) + pairs * block * (d_k + d_v)
    else:
        flops = 3 * pairs * dot_kv
        # dQ kernel: dO_i in, dQ_i out, K_j and V_j per pair; dK/dV kernel: K_j, V_j in, dK_j, dV_j out, Q_i and dO_i per pair
        elements = t * block * (d_v + d_k) + pairs * block * (d_k + d_v)
        elements += t * block * 2 * (d_k + d_v) + pairs * block * (d_k + d_v)
    return {"flops": heads_total * flops, "hbm_bytes": heads_total * elements * dtype_bytes, "pairs": pairs}


def la3_cost(n: int, d_k: int, d_v: int | None = None, chunk: int = 64, micro: int = 16, *, batch: int = 1,
             heads: int = 1, dtype_bytes: int = 2, segments: int = 1, dq_block: int = 64) -> dict:
    """FLOPs, HBM bytes and on-chip bytes of the recompute-heavy backward (:mod:`lightning_edu.triton_kernels.la3`),
    per call, counting padded tiles. (Chapter 09.)

    Two kernels do the work. The dQ pass is Algorithm 1 with (dO, V, K) in blocks of ``dq_block`` rows: it
    reads dO, V, K and writes dQ. The dK/dV sweep cuts each chunk of C = ``chunk`` rows into micro-chunks of
    c = ``micro`` rows; output micro-chunk i meets micro-chunks j <= i (NM (NM + 1) / 2 tile pairs per chunk,
    NM = C / c), and each pair costs four c x c x d dots (scores K_i Q_j^T and V_i dO_j^T, and their products
    with dO_j and Q_j); each micro-chunk also meets the state twice (K_i X, V_i X^T) and the chunk updates it
    once (Q^T dO). It reads Q, K, V, dO and writes dK, dV; with ``segments`` > 1 a pre-pass reads Q and dO
    once more, and each segment's d_k x d_v fp32 state is written and read back.

    ``on_chip`` is the dK/dV kernel's working set per program (registers and shared memory together), by
    buffer: what must be live at once for one tile pair. Triton keeps most of it in registers; the compiled
    kernel's shared memory (chapter 09's table) holds only the dot operands it stages.
    Returns a dict with ``flops``, ``hbm_bytes``, ``floor_bytes`` (q, k, v, do in; dq, dk, dv out) and
    ``on_chip`` (a dict of bytes, with ``total``).
    """
    n, d_k = validate_positive_int("n", n), validate_positive_int("d_k", d_k)
    d_v = d_k if d_v is None else validate_positive_int("d_v", d_v)
    chunk, micro = validate_positive_int("chunk", chunk), validate_positive_int("micro", micro)
    if chunk % micro:
        raise ValueError(f"chunk must be a multiple of micro, got chunk = {chunk}, micro = {micro}")
    heads_total = validate_positive_int("batch", batch) * validate_positive_int("heads", heads)
    dtype_bytes = validate_positive_int("dtype_bytes", dtype_bytes)
    segments = validate_positive_int("segments", segments)
    dq_block = validate_positive_int("dq_block", dq_block)
    nm, chunks = chunk // micro, -(-n // chunk)
    pair = 2 * micro * micro * (2 * d_k + 2 * d_v)       # four c x c x d dots
    inter = 2 * 2 * micro * d_k * d_v                     # K_i X and V_i X^T
    update = 2 * chunk * d_k * d_v                        # X += Q^T dO over the chunk
    dkdv = chunks * (nm * (nm + 1) // 2 * pair + nm * inter + update)
    dq = sum(count * sum(_blockwise_forward_flops(rows, d_v, d_k)) for rows, count in _block_lengths(n, dq_block))
    state = d_k * d_v * 4
    elements = n * 2 * (d_k + d_v) + n * 2 * (d_k + d_v) + n * (d_k + d_v)  # dQ pass; dK/dV sweep in, out
    extra = (segments > 1) * (n * (d_k + d_v) * dtype_bytes + 2 * segments * state)
    on_chip = {
        "K_i, V_i tiles": micro * (d_k + d_v) * dtype_bytes,
        "Q_j, dO_j tiles": micro * (d_k + d_v) * dtype_bytes,
        "dK_i, dV_i accumulators (fp32)": micro * (d_k + d_v) * 4,
        "score tiles and their decay (fp32)": 4 * micro * micro * 4,
        "state X (fp32)": state,
        "state X as a dot operand": d_k * d_v * dtype_bytes,
    }
    on_chip["total"] = sum(on_chip.values())
    floor = n * (4 * d_k + 3 * d_v)  # q, k in and dq, dk out (d_k wide); v, do in and dv out (d_v wide)
    return {"flops": heads_total * (dkdv + dq), "hbm_bytes": heads_total * (elements * dtype_bytes + extra),
            "floor_bytes": heads_total * floor * dtype_bytes, "on_chip": on_chip}


def one_pass_balance(d: int, seg_len: int, handoffs: int, *, elem_bytes: int = 2, state_bytes: int = 4) -> int:
    """Bytes of DRAM traffic a one-pass forward (:mod:`lightning_edu.triton_kernels.lookback`) saves per segment and
    (batch, head), against the two-pass forward, when L2 serves every second read of the segment's K and V.
    (Chapter 14.)

    Saved: the second read of the segment's K and V from DRAM, ``seg_len`` rows of ``d`` elements each, of
    ``elem_bytes``. Paid: per state handed on (``handoffs``: 1 for the chained scan; 2 for the decoupled
    look-back, which also publishes the segment's local state), one d x d state of ``state_bytes`` per element
    written and read back. The two-pass forward's own states (a few per sequence) are left out. Negative: one pass
    moves more bytes. Zero exactly at ``seg_len = handoffs * d * state_bytes / elem_bytes``."""
    d, seg_len = validate_positive_int("d", d), validate_positive_int("seg_len", seg_len)
    handoffs = validate_positive_int("handoffs", handoffs)
    elem_bytes = validate_positive_int("elem_bytes", elem_bytes)
    state_bytes = validate_positive_int("state_bytes", state_bytes)
    return 2 * seg_len * d * elem_bytes - handoffs * 2 * d * d * state_bytes


def hbm_floor_bytes(batch: int, T: int, heads: int, d: int, elem_bytes: int = 2, backward: bool = False) -> int:
    """Fewest bytes a pass must move: 4 tensors of (batch, T, heads, d) forward, 7 backward."""
    return (7 if backward else 4) * batch * T * heads * d * elem_bytes


# ----------------------------------------------------------------------------------------------------
# Decoding: the memory a KV cache takes against a linear-attention state, and the bytes one step must move.


#: The model the memory figures are stated for: the shape of a 7B-parameter decoder (hidden size 4096).
MODEL = {"name": "7B-parameter decoder", "layers": 32, "heads": 32, "head_dim": 128}


#: Context lengths of the computed memory table.
CONTEXTS = (4096, 32768, 131072, 1 << 20, 4 << 20)


#: Context lengths at which the memory of one layer's decode loop is measured (4M would need 64 GiB for one layer).
MEMORY_CONTEXTS = (4096, 32768, 131072, 1 << 20)


def kv_cache_bytes(tokens: int, *, layers: int, heads: int, head_dim: int, batch: int = 1, elem_bytes: int = 2) -> int:
    """Bytes of a softmax KV cache: a key and a value of ``head_dim`` per token, head, layer and sequence."""
    return 2 * batch * layers * heads * tokens * head_dim * elem_bytes


def state_bytes(*, layers: int, heads: int, d_k: int, d_v: int | None = None, batch: int = 1, elem_bytes: int = 4) -> int:
    """Bytes of the linear-attention states: one d_k x d_v matrix per head, layer and sequence (float32 by
    default, as the kernels keep it). It does not grow with the context."""
    return batch * layers * heads * d_k * (d_k if d_v is None else d_v) * elem_bytes


def step_floor_bytes(batch: int, heads: int, d_k: int, d_v: int, elem_bytes: int = 2) -> int:
    """HBM bytes one decode step cannot avoid: the float32 state read and written, q, k, v read and o written."""
    return batch * heads * (2 * d_k * d_v * 4 + (2 * d_k + 2 * d_v) * elem_bytes)


def memory_table(model: dict = MODEL, contexts=CONTEXTS, batch: int = 1) -> list[dict]:
    """Per context length: the whole model's bf16 KV cache, its float32 states, and their ratio."""
    shape = dict(layers=model["layers"], heads=model["heads"])
    state = state_bytes(**shape, d_k=model["head_dim"], batch=batch)
    rows = []
    for n in contexts:
        cache = kv_cache_bytes(n, **shape, head_dim=model["head_dim"], batch=batch)
        rows.append({"tokens": n, "kv_cache_bytes": cache, "state_bytes": state, "ratio": cache / state})
    return rows
