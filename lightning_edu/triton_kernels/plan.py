"""The plan: which tiles, segments and kernels the triton backend runs, decided in one place for every caller.

Every launcher, the backend's ops (:mod:`.ops`), the registry's hooks and the benchmarks ask here: the tiles of each
kernel for a call's head dims, dtype and (batch, head) count on its device (:func:`kernel_config`, :func:`tiles_for`),
how a forward cuts the sequence into segments and the value columns into slices (:func:`choose_segments`,
:func:`sliced_forward`, :func:`whole_dv_plan`), and which kernel runs: the backward (:func:`backward_kernel`),
descriptor loads (:func:`backend_takes`), the exact pass in the fast program (:func:`redo_in_place`). Each function
states its choice and the reason; the measurements behind them are in chapters 07-09 and their records.

The backend's switches are one :class:`Settings` value, read with :func:`settings` and changed only inside
:func:`override` (a context manager): the experiments that compare two ways of one choice (``benchmarks/``) and the
tests switch them there, and nothing assigns a module's global from outside. Every setting is part of the key under
which the backend replays a call's launches (``ops``), so a call under other settings plans its launches afresh.

This module imports nothing of the triton package: the kernels import it, never the other way round.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os

import torch

from ..validation import validate_choice

__all__ = [
    "Settings", "settings", "override", "cdiv", "next_power_of_2", "pad_dim", "interpreted", "sm_count",
    "kernel_config", "tiles_for", "backend_tiles", "value_slices", "prepass_tiles", "la3_tiles", "SHORT_BLOCKS",
    "short_blocks", "choose_segments", "SLICE", "sliced_forward", "sliced_plan", "WHOLE_DV", "WHOLE_DV_PER_SM",
    "whole_dv_forward", "whole_dv_plan", "backward_kernel", "MIN_ROWS", "backend_takes", "takes_tma",
    "redo_in_place",
]


@dataclasses.dataclass(frozen=True)
class Settings:
    """The backend's switches; each default is the measured choice, each other value the way it was compared with.

    ``exact_in_place``: Whether the backend's pointer kernels (la2_fast's passes, la3's dK/dV) may redo a flagged program in the same
program, right after its fast sweep (:func:`flagged_here`), instead of in an exact pass launched after them
(:func:`redo_in_place` says where they do). False gives the two launches of the module docstring.

    ``fast_launch``: Whether :func:`launch` on a GPU launches a kernel it has launched before with the same specialisation
directly (:func:`_fast_launch`). False sends every launch through Triton's ``kernel[grid]``.

    ``compile_ahead``: Whether the first call of a configuration on a GPU compiles its kernels side by side first (:func:`_first_call`).
False lets Triton compile each kernel at its first launch, one after another.

    ``replay``: Whether a call whose inputs allow it replays the launches recorded at the first call with its key
(:func:`_replay_key`, :class:`~._tiles.LaunchPlan`) instead of running the launchers' host code again.

    ``tma``: Whether the backend's passes in time order (the forward, the backward's dQ pass) load their tiles through
descriptors where :func:`backend_takes` says so. False runs la2_fast's pointer kernel everywhere.

    ``prepass_tail_first``: Whether the segment pre-pass sums each segment from its end back to its start (``_local_state``'s TAIL_FIRST;
bfloat16 and float32 keys only). The main pass reads each segment from its start, so summed from its end the rows
the pre-pass read last are the rows the main pass reads first, and some of them are still in L2. Off: it paid too
little, and not everywhere: the forward alone gained a little or tied, and a long forward + backward at d = 128
ran slower. Chapter 14, section 14.4, shows the measurements (``python -m benchmarks.prepass``,
notebooks/data/prepass_h100.json).
    """

    exact_in_place: bool = True
    fast_launch: bool = True
    compile_ahead: bool = True
    replay: bool = True
    tma: bool = True
    prepass_tail_first: bool = False


_SETTINGS = Settings()


def settings() -> Settings:
    """The settings the backend runs under now (:class:`Settings`' defaults, outside any :func:`override`)."""
    return _SETTINGS


@contextlib.contextmanager
def override(**changes: bool):
    """Run the enclosed code under other :class:`Settings` (``override(tma=False)``, ...), restored on exit.

    Raises ValueError for a name that is not a setting and TypeError for a value that is not a bool. The settings
    are the process's (every thread sees them: :func:`~._tiles.compile_ahead` compiles in threads), so the code
    that overrides them is code that measures or tests, one thing at a time."""
    global _SETTINGS
    names = tuple(f.name for f in dataclasses.fields(Settings))
    for name, value in changes.items():
        validate_choice("setting", name, names)
        if not isinstance(value, bool):
            raise TypeError(f"setting {name} must be a bool, got {type(value).__name__}")
    previous = _SETTINGS
    _SETTINGS = dataclasses.replace(previous, **changes)
    try:
        yield _SETTINGS
    finally:
        _SETTINGS = previous


# --------------------------------------------------------------------------------------------------
# Arithmetic of tiles.


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive ints. The launchers' own: Triton's ``triton.cdiv`` and ``triton.next_power_of_2``
    are compile-time functions whose host-side call costs far more than this, and a forward+backward of the
    backend computes a few dozen of these numbers on the host."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), in plain Python for the reason given in :func:`cdiv`."""
    return 1 << max(n - 1, 0).bit_length()


def pad_dim(d: int) -> int:
    """A head dim as a tile width: the next power of two, at least 16 (tl.dot's smallest tile)."""
    return max(16, next_power_of_2(d))


# --------------------------------------------------------------------------------------------------
# The device: where a kernel runs and how many SMs it has.


_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # as Triton read it when this module's kernels were defined


def interpreted(x: torch.Tensor) -> bool:
    """Whether a kernel launched on ``x`` runs in Triton's CPU interpreter: x is not on CUDA (there is no
    other CPU path), or TRITON_INTERPRET=1 was set when the kernels were defined. Triton reads the variable
    once, as ``@triton.jit`` decorates each kernel, so this reads it once too, at import: setting it later
    changes neither. (The backend asks many times per forward + backward, and reading ``os.environ`` each time
    showed in a profile of a short call.)"""
    return not x.is_cuda or _INTERPRET


def sm_count(device) -> int:
    """Streaming multiprocessors of a CUDA device; 4 in the interpreter (a few programs, as on a small GPU)."""
    if device.type == "cuda":
        return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


# --------------------------------------------------------------------------------------------------
# Tiles: block rows, d_v slices, warps and stages of every launcher the backend runs.


def kernel_config(d_k: int, d_v: int, dtype: torch.dtype, block_size: int | None = None,
                  interpreter: bool = False, *, batch_heads: int | None = None, sms: int | None = None) -> dict:
    """Tile sizes of the backend's kernels for head dims (d_k, d_v) and the dtype the tiles are loaded in, on a GPU
    (or, with ``interpreter``, in Triton's CPU interpreter); given ``batch_heads`` (batch * heads) and ``sms`` (the
    device's :func:`sm_count`), for that many (batch, head) pairs on that device. Returns the keyword arguments of
    ``la2_fast_forward``/``la2_fast_backward``: block, block_dv, num_warps, num_stages; ``block_size`` overrides
    the rows.

    * 16-bit tiles: 64-row blocks (32 above d = 128), three pipeline stages up to d = 64 and two above, d_v in
      64-column slices above d = 64: the fastest of the tile sweep of chapter 14, section 14.6 (``bench --tune``, its records).
    * Unless the slices would not fit in one wave: with more (batch, head) pairs than SMs, 64 < d <= 128 takes d_v
      whole (8 warps for the d x d float32 state, 3 stages), one program per pair instead of two.
    * float32: 16-row blocks up to d = 128, because its exact dots run on the FMA units and a larger tile is a longer
      unrolled run of multiply-adds that spills registers; 64-column slices above d = 64 whatever the pair count.
      In the interpreter larger blocks (64 rows up to d = 64, 32 above), since there a block costs per operation.

    Descriptor loads (:func:`backend_takes`) take the same tiles; a forward with no backward to follow may take
    others (:func:`sliced_forward`, :func:`whole_dv_forward`).
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a torch floating-point dtype (e.g. torch.bfloat16), got {dtype!r}")
    d = max(d_k, d_v)
    if dtype != torch.float32:
        if 64 < d <= 128 and batch_heads is not None and sms is not None and batch_heads > sms:
            return dict(block=block_size or 64, block_dv=128, num_warps=8, num_stages=3)  # 2 slices: over a wave
        return dict(block=block_size or (32 if d > 128 else 64), block_dv=64 if d > 64 else None, num_warps=4,
                    num_stages=3 if d <= 64 else 2)
    if d > 128:
        return dict(block=block_size or 32, block_dv=64, num_warps=8, num_stages=2)
    if interpreter:
        block = 64 if d <= 64 else 32
    else:
        block = 16
    return dict(block=block_size or block, block_dv=64 if d > 64 else None, num_warps=4 if d <= 64 else 8,
                num_stages=2 if d <= 64 else 1)


def tiles_for(q: torch.Tensor, v: torch.Tensor, block_size: int | None = None, dtype: torch.dtype | None = None) -> dict:
    """:func:`kernel_config` for a call on tensors shaped like q (batch, heads, n, d_k) and v (..., d_v): the
    backend's tiles for that many (batch, head) pairs on q's device (its SM count; Triton's interpreter or not),
    loaded in ``dtype`` (q's unless given). Every launcher that runs the backend's kernels asks here."""
    return kernel_config(q.shape[-1], v.shape[-1], dtype or q.dtype, block_size, interpreted(q),
                         batch_heads=q.shape[0] * q.shape[1], sms=sm_count(q.device))


def backend_tiles(q, v, block=None, block_dv=None, num_warps=None, num_stages=None) -> tuple[int, int | None, int, int]:
    """(block, block_dv, num_warps, num_stages) for a launcher: each one given as given, each one left None as the
    backend takes it for this call (:func:`~lightning_edu.triton_kernels.tiles_for`: head dims, q's dtype, the
    (batch, head) pairs and q's device). So a launcher called without tiles runs the kernels the backend runs, and
    reuses their compilations. (When block, num_warps and num_stages are all given, as the backend gives them,
    nothing is looked up: block_dv None then means what it means to the launcher, 64-column slices,
    :func:`value_slices`.)"""
    if block is not None and num_warps is not None and num_stages is not None:
        return block, block_dv, num_warps, num_stages
    cfg = tiles_for(q, v, block)
    return (cfg["block"], cfg["block_dv"] if block_dv is None else block_dv, num_warps or cfg["num_warps"],
            num_stages or cfg["num_stages"])


def value_slices(d_v: int, block_dv: int | None) -> tuple[int, int]:
    """(block_dv, slices): the columns of d_v each program of the forward kernel takes, and how many such slices
    make d_v. ``block_dv`` None means 64-column slices, what the backend's tiles take above d = 64 in every dtype
    (:func:`~lightning_edu.triton_kernels.kernel_config`, with the reasons), except where it names d_v whole
    for more (batch, head) pairs than SMs (16-bit), with the warps and stages that go with it. A slice never
    exceeds d_v padded to a power of two."""
    block_dv = min(pad_dim(d_v), block_dv or 64)
    return block_dv, cdiv(d_v, block_dv)


def prepass_tiles(dtype, seg_len: int, block: int, num_warps: int, num_stages: int) -> tuple[int, int, int]:
    """(block, num_warps, num_stages) of the segment pre-pass (``_segment_state_kernel``) for 16-bit inputs: 32-row
    blocks, 4 warps, 4 stages. The pre-pass only streams K and V through one dot per block, so it wants more
    loads in flight than the main kernel's tiles give it; with these it ran faster than on the forward's tiles
    (64 rows, 4 warps, 2 stages) at every length measured (chapter 14, section 14.6). Other dtypes, and segments that are not
    whole 32-row blocks, keep the given tiles.

    The pre-pass keeps the forward's 64-column slices of d_v, so at d = 128 it reads K once per slice. Other
    variants (d_v whole, which reads K once, or in slices; 16, 32 or 64 rows; 4 or 8 warps; 3 or 4 stages) barely
    moved the whole forward: on long sequences the pre-pass already streams close to the copy bandwidth, and what
    it costs is the second read itself."""
    if dtype in (torch.float16, torch.bfloat16) and seg_len % 32 == 0:
        return 32, 4, 4
    return block, num_warps, num_stages


def la3_tiles(dtype, d: int = 64) -> dict:
    """Chunk C, micro-chunk c and launch shape of the dK/dV kernel for inputs of ``dtype`` and head dim ``d`` (the
    wider of d_k, d_v), chosen by the measurements of chapter 09 (notebooks/data/la3_h100.json).

    16-bit inputs: c = C = 64. Hopper's tensor-core instruction (wgmma) multiplies tiles of 64 rows per
    warp group; 16-row tiles fall back to the older instruction and made the backward much slower. The
    kernel then needs 32 KB (d = 64) or 64 KB (d = 128) of shared memory: within 99 KB either way.

    fp32 (the correctness rung): c = C = 16, 4 warps up to d = 64 and 8 above. Its exact fp32 products run on the
    FMA units, unrolled, and with c < C every chunk unrolls its c x c tile pairs as well: the smallest tiles
    (C = c = 16) both ran and compiled fastest, at d = 64 and at d = 128 (with 8 warps there), and kept the error
    against float64 that of fp32 dots. The 128 x 128 fp32 state still spills registers at d = 128.
    """
    if dtype == torch.float32:
        return dict(chunk=16, micro=16, num_warps=8 if d > 64 else 4, num_stages=1)
    return dict(chunk=64, micro=64, num_warps=4, num_stages=1)


# --------------------------------------------------------------------------------------------------
# Segments, slices and d_v whole: how a forward cuts the sequence and the value columns into programs.


SHORT_BLOCKS = 4
"""On a GPU, a sequence of at most this many blocks is one segment (:func:`choose_segments`' ``short``)."""


def short_blocks(device) -> int:
    """``short`` of :func:`choose_segments` on ``device``: :data:`SHORT_BLOCKS` on a GPU, 0 in the interpreter (where
    short sequences are cut into segments, so that CPU tests exercise the segmented path)."""
    return SHORT_BLOCKS if device.type == "cuda" else 0


def choose_segments(programs: int, n: int, block: int, sm_count: int, seg_len: int | None = None,
                    short: int = 0, per_sm: int = 2) -> tuple[int, int]:
    """(num_segments, seg_len): as many segments as keep ``programs * num_segments`` within ``per_sm`` programs
    per SM, rounded down; one segment for a sequence of at most ``short`` blocks. seg_len is a multiple of
    ``block``, so every segment but the last is made of whole blocks.

    Two programs of the backend's 16-bit kernels fit on an SM at once, so ``per_sm * sm_count`` programs are one
    wave; one program more starts a second wave in which most SMs wait, which is why the count rounds down
    (chapter 14, section 14.2, measures both). A program of :data:`WHOLE_DV`'s tiles fills an SM alone: its caller passes
    ``per_sm`` = :data:`WHOLE_DV_PER_SM`. On a short call the host's time is the call's time and every segment
    adds launches (a pre-pass before each pass), so the backend passes ``short`` = :data:`SHORT_BLOCKS` on a GPU.
    """
    if seg_len is None:
        want = max(1, per_sm * sm_count // max(programs, 1))
        blocks = cdiv(n, block)
        if blocks <= short:
            want = 1
        per_seg = cdiv(blocks, min(want, blocks))
        seg_len = per_seg * block
    if seg_len % block:
        raise ValueError(f"seg_len must be a multiple of the block size {block}, got {seg_len}")
    return cdiv(n, seg_len), seg_len


SLICE = 32
"""Columns of d_v per program in :func:`sliced_forward`'s plan."""


def sliced_forward(batch_heads: int, n: int, d_v: int, block: int, sm_count: int) -> tuple[int, int, int] | None:
    """(block_dv, num_stages, seg_len) of a 16-bit forward with no backward to follow, when d_v cut into
    :data:`SLICE`-column slices, as one segment, gives the chip enough programs; else None (the usual plan).

    Segments and slices both add programs. A segment re-reads K and V from HBM in the pre-pass; a slice re-reads
    Q and K, but at the same time as the other slices of its (batch, head) (one wave), and L2 serves the reads:
    the sliced forward reads about the three tensors' worth of bytes of q, k and v from DRAM (chapter 14's
    profile, ``python -m benchmarks.kernels``).
    Where the usual 64-column slices leave SMs idle (``batch_heads * cdiv(d_v, 64) < sm_count``) and 32-column
    slices fill them, one segment of 32-column slices skips the pre-pass. Enough means: with at most two slices
    (d_v <= 64) one program per SM, less a tenth; with more (d_v <= 128) two per SM, less an eighth, since each
    slice repeats the scores tile; below those counts the usual plan was as fast or faster (chapter 14, section 14.2).
    With a backward to follow the forward keeps its segments: their saved states spare the dQ pass its
    pre-pass. Three pipeline stages, the faster of two and three."""
    slices = cdiv(d_v, SLICE)
    if not SLICE < d_v <= 128 or batch_heads * cdiv(d_v, 64) >= sm_count:  # d_v <= 32: no more programs to gain
        return None
    need = sm_count - sm_count // 10 if slices <= 2 else 2 * sm_count - sm_count // 8
    if batch_heads * slices < need:
        return None
    return SLICE, 3, cdiv(n, block) * block


def sliced_plan(q, v, block: int) -> tuple[int, int, int] | None:
    """:func:`sliced_forward`'s plan for these (batch, heads, n, d) tensors and the backend's ``block``: for
    16-bit inputs on a GPU with d_k, d_v <= 128; else None. Callers ask only when the backend picks the tiles."""
    if q.dtype not in (torch.float16, torch.bfloat16) or interpreted(q) or max(q.shape[-1], v.shape[-1]) > 128:
        return None
    return sliced_forward(q.shape[0] * q.shape[1], q.shape[2], v.shape[-1], block, sm_count(q.device))


WHOLE_DV = dict(block_dv=128, num_warps=8, num_stages=3)
"""The tiles of :func:`whole_dv_forward`: d_v whole (up to 128 columns), 8 warps for the d x d float32 state, 3 stages."""


WHOLE_DV_PER_SM = 1
"""Programs of :data:`WHOLE_DV`'s tiles that run on one SM at once (:func:`choose_segments`' ``per_sm``): at d = 128
three stages of 64-row tiles of q, k and v and the state's 16-bit copy take more than half of an SM's shared
memory. Chapter 14, section 14.2, shows what the segment counts this gives cost (``python -m benchmarks.segments``)."""


def whole_dv_forward(q, v) -> bool:
    """Whether a forward with no backward to follow, where :func:`sliced_forward`'s plan does not apply, takes
    :data:`WHOLE_DV` (one program per (batch, head) and segment, d_v whole) instead of the backend's 64-column
    slices: where its tiles load through descriptors (:func:`backend_takes`, 64 < d <= 128).

    With pointer loads d_v whole was the slower tiles wherever the slices fit in one wave (its 128 x 128 float32
    state spilled registers); through descriptors it became the fastest segmented tiles on the longest sequences
    and costs nothing on shorter ones (chapter 14, section 14.5; ``python -m benchmarks.tma``,
    notebooks/data/tma_h100.json). A backward keeps the slices: its
    reversed passes load through pointers, where d_v whole is slower (:func:`~lightning_edu.triton_kernels.kernel_config`),
    and the forward that saves states for it shares its tiles."""
    return 64 < max(q.shape[-1], v.shape[-1]) <= 128 and backend_takes(q, v)


def whole_dv_plan(q, block: int) -> tuple[dict, int, int]:
    """(tiles, num_segments, seg_len) of a forward on :data:`WHOLE_DV`'s tiles (where :func:`whole_dv_forward`
    says so), for a (batch, heads, n, d) query and ``block``-row blocks: ``tiles`` a copy of WHOLE_DV; one program
    per (batch, head) and segment, :data:`WHOLE_DV_PER_SM` of them per SM (:func:`choose_segments`). The one place
    that plans it: the backend's plan (``ops.launch_plan``) and :func:`la2_fast_forward` both ask here."""
    num_seg, seg_len = choose_segments(q.shape[0] * q.shape[1], q.shape[2], block, sm_count(q.device), None,
                                       short_blocks(q.device), WHOLE_DV_PER_SM)
    return dict(WHOLE_DV), num_seg, seg_len


# --------------------------------------------------------------------------------------------------
# Which kernel runs: the backward, descriptor loads, the exact pass in place.


def backward_kernel(d_k: int, d_v: int, dtype: torch.dtype) -> str:
    """The backend's backward, by the name of its variant ("la3" or "la2_fast", keys of ``VARIANTS``): la3's (dK and dV in one reverse sweep) for 16-bit inputs with d_k = d_v <= 64,
    la2_fast's (three reversed forwards) otherwise: la3's was the faster at d = 64 at every length measured, and
    the slower at d = 128, where its d x d fp32 state spills registers (chapter 09, notebooks/data/la3_h100.json).
    fp32 keeps la2_fast's: la3's fp32 tiles are the small, slow ones."""
    if dtype in (torch.float16, torch.bfloat16) and d_k == d_v <= 64:  # measured at d_k = d_v only
        return "la3"
    return "la2_fast"


MIN_ROWS = 2**18
"""The fewest rows (batch * heads * n) of a call whose passes :func:`backend_takes` gives descriptor tiles."""


def backend_takes(q, v) -> bool:
    """Whether the backend's passes in time order on tensors like q (batch, heads, n, d_k) and v (..., d_v) take
    descriptor tiles (:attr:`Settings.tma` on): 16-bit tiles on a GPU of compute capability 9.0 or later, with
    64 < max(d_k, d_v) <= 128, and at least :data:`MIN_ROWS` rows, where they were measured faster (chapter 14, section 14.5).
    The launchers still ask :func:`tma_ready` of the call's tensors.

    Why a least size. A descriptor costs the host: built at every call (or rebuilt at every replay), and encoded
    again by Triton's launcher at every launch; a forward + backward takes eight. A short call is bound by the
    host, and there the descriptors made it slower (``bench --tiny``, notebooks/data/tiny_tma_h100.json). From
    about 2^18 rows on, the GPU's time for a forward + backward at d = 128 passes the host's for the call, which
    then overlaps it, and the descriptors were faster at every length measured (chapter 14, section 14.5)."""
    return (settings().tma and q.dtype in (torch.float16, torch.bfloat16) and 64 < max(q.shape[-1], v.shape[-1]) <= 128
            and q.shape[0] * q.shape[1] * q.shape[2] >= MIN_ROWS and q.is_cuda and not interpreted(q)
            and _capability(q.device.index) >= (9, 0))


def takes_tma(tma: bool | None, q, v) -> bool:
    """A launcher's ``tma`` option: as given, or None: the backend's choice (:func:`backend_takes`)."""
    if tma is not None:
        return bool(tma)
    return backend_takes(q, v)


REDO_STATE = 64 * 64
"""The largest state tile (d_k x the d_v columns of one program) of a kernel that redoes in place."""


def redo_in_place(dtype, state_rows: int, state_cols: int) -> bool:
    """Whether a kernel whose program carries a ``state_rows`` x ``state_cols`` float32 state, on tiles of
    ``dtype``, redoes its flagged programs in place (:attr:`Settings.exact_in_place`): 16-bit tiles and a state of at most
    :data:`REDO_STATE` entries (d <= 64), where a call is short and its launches cost the host more than the GPU
    its time.

    In place, a forward + backward at d = 64 launches 5 kernels instead of 8 and compiles 5 instead of 8: the
    kernels' own time barely moves, and a short call, bound by the host, gets shorter. At d = 128 a call is long,
    the launches saved are worth little, and in place a 128 x 128 state (d_v whole) ran slower. float32 tiles, the
    spilling kind, keep two launches. Chapter 14, section 14.2, shows the measurements (``python -m benchmarks.redo``,
    notebooks/data/redo_h100.json)."""
    return settings().exact_in_place and dtype in (torch.float16, torch.bfloat16) and state_rows * state_cols <= REDO_STATE
