"""Rung 2: Lightning Attention in PyTorch, from a loop over blocks to batched tensor ops. (Chapter 06.)

The same function as every rung (per batch and head, ``KV_t = lambda KV_{t-1} + k_t^T v_t``,
``o_t = q_t KV_t``) in three forms:

* :func:`recurrent_forward` -- one token at a time: n sequential steps, the benchmark's baseline;
* :func:`loop_forward` -- the literal port of Algorithm 1: a Python loop over the n/B blocks;
* :func:`chunked_forward` -- chunk-parallel: every block's intra part, local state and inter part is one
  batched matmul over many blocks at once; only the scan over n/B block states is sequential (or
  log-depth with ``scan="log"``). On a GPU that is all blocks at once; on a CPU cache-sized groups of
  blocks, one group after the other, the state carried between them (:func:`blocks_per_group` says why).
  Its backward is Algorithm 2 in the same style, written by hand (:class:`LightningAttentionFunction`),
  not autograd through the forward.

Notation as in :mod:`lightning_edu.numpy_blockwise`: rows of a block are r = 0..B-1; M[r, s] =
lambda^(r-s) (r >= s); q_r meets the carried-in state with lambda^(r+1); k_r enters the block's state
with lambda^(b-1-r), b the block's real length. Every factor is lambda to a non-negative power: nothing
overflows for any lambda in (0, 1].

Every decay factor is formed in float64 and only then rounded to the compute dtype: rounding lambda to
float32 first and raising it to the 64th power multiplies its rounding error by 64 (chapter 06 measures
it). Masks select (``torch.where``), they never multiply, so a NaN or inf reaches exactly the outputs that
depend on it (:func:`masked_product`).

Precision: float32 and float64 inputs compute in their own dtype. float16/bfloat16 inputs are cast to
float32 for every matmul and for the states; o comes back in the input dtype, the final state in float32
(it is carried into the next call, so rounding it to bf16 would throw away the precision kept).
"""

from __future__ import annotations

import torch

from .validation import device_decay, validate_attention_args, validate_choice

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "SCANS",
    "compute_dtype",
    "decay_tensor",
    "decay_gradient",
    "decay_gradient_from_grads",
    "masked_product",
    "block_factors",
    "to_blocks",
    "chunk_factors",
    "intra_block_outputs",
    "local_block_states",
    "scan_states",
    "inter_block_outputs",
    "chunked_forward",
    "chunked_backward",
    "loop_forward",
    "recurrent_forward",
    "masked_forward",
    "LightningAttentionFunction",
    "forward_from_args",
    "backward_from_args",
    "loop_from_args",
    "recurrent_from_args",
    "masked_from_args",
    "step_from_args",
]

DEFAULT_BLOCK_SIZE = 64
SCANS = ("sequential", "log")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the arithmetic runs in: float64 and float32 as given, float16/bfloat16 in float32."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def decay_tensor(decay, device, dtype=torch.float64) -> torch.Tensor:
    """lambda as a tensor of shape (heads,) on ``device``, from the validated decay (a float64 numpy array, or a
    tensor that keeps its autograd graph: see :func:`lightning_edu.validation.device_decay`)."""
    return device_decay(decay, device, dtype)


def decay_gradient_from_grads(q, k, dq, dk, final_state=None, d_final_state=None) -> torch.Tensor:
    """dL/d(ln lambda) per head from the gradients of q and k: short, exact in exact arithmetic, and
    ill-conditioned in floating point. (Chapter 06.)

    Every term of o_t and of the final state S_n carries lambda^(t-s) for a query (or the end, t = n) at
    position t and a key (or the initial state, s = 0) at position s, and d/d(ln lambda) of lambda^(t-s) is
    (t - s) lambda^(t-s). Summing those terms by query gives q_t . dq_t, by key k_s . dk_s, so

        dL/d(ln lambda) = sum_t t (q_t . dq_t - k_t . dk_t) + n <dL/dS_n, S_n>,   t = 1..n.

    The diagonal terms (s = t, weight 0) sit in both q_t . dq_t and k_t . dk_t and cancel only in exact
    arithmetic: each is rounded where dq and dk were, then multiplied by t. For small lambda they dominate: in
    chapter 06's example (n = 130, lambda = 1e-3) the result is off by 2 % with float32 inputs and by several times
    the answer with float16 inputs. The backends use :func:`decay_gradient` instead. Returns float64 (heads,).
    """
    acc = torch.promote_types(dq.dtype, torch.float32)
    per_token = (q.to(acc) * dq.to(acc)).sum(-1) - (k.to(acc) * dk.to(acc)).sum(-1)  # (batch, heads, n)
    n = q.shape[2]
    t = torch.arange(1, n + 1, device=q.device, dtype=torch.float64)
    grad = (per_token.double() * t).sum(dim=(0, 2))
    if d_final_state is not None and final_state is not None:
        grad = grad + n * (d_final_state.double() * final_state.double()).sum(dim=(0, 2, 3))
    return grad


def decay_gradient(q, k, v, do, decay, initial_state=None, d_final_state=None, block_size: int | None = None,
                   scan: str = "sequential", wrt: str = "log") -> torch.Tensor:
    """dL/d(ln lambda) per head, by the tangent of the forward; with ``wrt="lambda"``, dL/dlambda. (Chapter 06.)

    Differentiate the recurrence with respect to g = ln lambda: W_t = dS_t/dg obeys

        W_t = lambda W_(t-1) + lambda S_(t-1),   W_0 = 0,

    and per block of length L (entering states S_i, W_i): W_(i+1) = lambda^L (W_i + L S_i) + sum_j (L-1-j)
    lambda^(L-1-j) k_j^T v_j, the same scan as S with a position-weighted local state. Then, with r = j + 1 the
    1-based row in the block,

        dL/dg = sum_blocks [ sum_(r >= r') (r - r') lambda^(r-r') (q_r . k_r')(do_r . v_r')
                             + sum_r lambda^r (r q_r S_i + q_r W_i) . do_r ] + <dL/dS_n, W_n>.

    Every weight (r - r') is exact and the diagonal's is 0, so nothing cancels (unlike
    :func:`decay_gradient_from_grads`). Cost: one more chunked pass over q, k, v, do. Inputs as validated:
    (batch, heads, n, d) tensors, decay (heads,) (numpy or tensor); computed in :func:`compute_dtype`, the
    factors in float64. Returns float64 (heads,).

    ``wrt="lambda"`` returns dL/dlambda = dL/dg / lambda, the division done on the factors, in float64, before
    they are rounded: m lambda^m becomes m lambda^(m-1) (0 for m = 0), lambda^r q_r S_i becomes
    r lambda^(r-1) q_r S_i, and W becomes V = W / lambda = dS/dlambda (the same scan). Why the backends take this
    one: dL/dg = lambda dL/dlambda is as tiny as lambda (for a float32 lambda of 1e-45 each of its terms
    lambda (q . k)(do . v) is subnormal), and a subnormal carries few digits, so dividing the rounded dL/dg by
    lambda afterwards would lose most of the digits of dL/dlambda; its own terms, weights (r - r') lambda^(r-r'-1)
    that are 1 at a gap of one, keep them.
    """
    wrt = validate_choice("wrt", wrt, ("log", "lambda"))
    n, block, dtype, (mask, q_scale, k_scale, block_decay), (qb, kb, vb), state0 = _prepare(
        q, k, v, initial_state, decay, block_size
    )
    lam = decay_tensor(decay, q.device)  # float64

    def weighted(m):  # m lambda^m (wrt "log") or m lambda^(m-1) (wrt "lambda"), shape (heads, *m.shape), in float64
        m = m.to(torch.float64)
        if wrt == "log":
            return m * _powers(lam, m, torch.float64)
        return torch.where(m > 0, m * _powers(lam, (m - 1).clamp(min=0), torch.float64), 0.0)

    dob = to_blocks(do.to(dtype), block)
    n_blocks = qb.shape[2]
    starts = torch.arange(n_blocks, device=q.device) * block
    ends = torch.clamp(starts + block, max=n)
    rows = starts[:, None] + torch.arange(block, device=q.device)[None, :]
    key_gap = (ends[:, None] - 1 - rows).clamp(min=0)  # L-1-j, (n_blocks, B)
    states = scan_states(local_block_states(kb, vb, k_scale), block_decay, state0, scan)  # S_i, and S_n last
    carry = weighted(ends - starts).to(dtype)[:, :, None, None]  # L lambda^L (or L lambda^(L-1)) per block
    w_local = local_block_states(kb, vb, weighted(key_gap).to(dtype)[..., None]) + carry * states[:, :, :-1]
    tangents = scan_states(w_local, block_decay, None, scan)  # W_i (or V_i), and W_n last
    r = torch.arange(1, block + 1, device=q.device)
    gap = (r[:, None] - r[None, :]).clamp(min=0)  # r - r' on and below the diagonal
    causal = _causal(block, q.device)
    weights = torch.where(causal, weighted(gap).to(dtype)[:, None], 0.0)  # (heads, 1, B, B)
    intra = ((qb @ kb.transpose(-1, -2)) * (dob @ vb.transpose(-1, -2)) * weights).sum(dim=(-1, -2))
    row_scale = weighted(r[:, None]).to(dtype)[:, None]  # r lambda^r (or r lambda^(r-1)), (heads, 1, B, 1)
    inter = ((row_scale * qb) @ states[:, :, :-1] + (q_scale * qb) @ tangents[:, :, :-1]) * dob
    grad = (intra.double() + inter.sum(dim=(-1, -2)).double()).sum(dim=(0, 2))
    if d_final_state is not None:
        grad = grad + (d_final_state.double() * tangents[:, :, -1].double()).sum(dim=(0, 2, 3))
    return grad


def masked_product(weights: torch.Tensor, keep: torch.Tensor, x: torch.Tensor, *,
                   look: bool | None = None) -> torch.Tensor:
    """``where(keep, weights, 0) @ x`` where the mask selects, the torch twin of
    :func:`lightning_edu.numpy_reference.masked_product`. (Chapters 03, 06.)

    A dense product meets every row of x with every output row, so a NaN in a later row of x would reach
    earlier outputs through a 0 weight (0 x NaN = NaN). Non-finite entries of x are zeroed for the product
    and exactly the outputs whose kept weights reach one of them are set to NaN. keep broadcasts against
    weights (..., m, p); x is (..., p, d).

    ``look``: whether the host first looks at x to skip that work in the common, finite case. Reading a value of
    x on the host costs nothing on the CPU, but on a GPU it makes the host wait for the GPU, and under
    :func:`torch.compile` it breaks the graph; so None (the default) looks only at a CPU tensor in eager code, and
    elsewhere the masked path always runs, branch-free, on the device. Both give the same bits.
    """
    a = torch.where(keep, weights, 0.0)
    if x.is_meta:  # shapes only (a model traced on the meta device): there are no values to look at
        return a @ x
    if look is None:
        look = x.device.type == "cpu" and not torch.compiler.is_compiling()
    if look and bool(torch.isfinite(x.sum())):  # the common case, in one cheap pass: a NaN or inf makes it non-finite
        return a @ x
    bad = ~torch.isfinite(x)
    if look and not bool(bad.any()):  # a sum can also overflow with every entry finite: then the entries decide
        return a @ x
    reach = keep.to(x.dtype) @ bad.to(x.dtype)
    return torch.where(reach > 0, torch.nan, a @ torch.where(bad, 0.0, x))


def _causal(b: int, device) -> torch.Tensor:
    """The (b, b) boolean tile r >= s: which entries of M exist."""
    return torch.ones(b, b, dtype=torch.bool, device=device).tril()


def _powers(lam: torch.Tensor, exponent: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """lam[h] ** exponent[...] for integer exponents >= 0, shape (heads, *exponent.shape), rounded to ``dtype``.

    The power is taken in float64 and rounded once at the end: a float32 lambda carries a relative error
    of up to 6e-8, and lambda^64 formed from it up to 64 times that.
    """
    lam64 = lam.to(torch.float64).reshape(-1, *([1] * exponent.dim()))
    return (lam64 ** exponent.to(torch.float64)).to(dtype)


def block_factors(b: int, lam: torch.Tensor, dtype: torch.dtype | None = None):
    """Decay factors of one block of b rows, per head (lam: (heads,)). (Chapters 04 and 06.)

    Returns (M, q_scale, k_scale, block_decay) of shapes (heads, b, b), (heads, b, 1), (heads, b, 1),
    (heads, 1, 1): the intra mask lambda^(r-s), lambda^(r+1), lambda^(b-1-r) and lambda^b, computed in
    float64 and rounded to ``dtype`` (lam's dtype if None).
    """
    dtype = lam.dtype if dtype is None else dtype
    r = torch.arange(b, device=lam.device)
    gap = r[:, None] - r[None, :]
    mask = torch.where(gap >= 0, _powers(lam, gap.clamp(min=0), dtype), 0.0)
    q_scale = _powers(lam, (r + 1)[:, None], dtype)
    k_scale = _powers(lam, (b - 1 - r)[:, None], dtype)
    block_decay = _powers(lam, torch.full((1, 1), b, device=lam.device), dtype)
    return mask, q_scale, k_scale, block_decay


def to_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """(batch, heads, n, d) -> (batch, heads, n_blocks, B, d), zero-padding n up to a multiple of B.

    Zero rows are harmless in q (their output is cut off), k and v (they add 0 to every state); the one
    thing padding must not change is the decay of the last, short block: see :func:`chunk_factors`.
    """
    batch, heads, n, d = x.shape
    n_blocks = -(-n // block_size)
    pad = n_blocks * block_size - n
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))
    return x.reshape(batch, heads, n_blocks, block_size, d)


def chunk_factors(n: int, block_size: int, lam: torch.Tensor, dtype: torch.dtype | None = None):
    """Decay factors for all n/B blocks at once, the last block possibly short (b = n - (n_blocks-1) B rows).

    Returns (M, q_scale, k_scale, block_decay) of shapes (heads, 1, B, B), (heads, 1, B, 1),
    (heads, n_blocks, B, 1), (heads, n_blocks): M and q_scale are the same in every block; k_scale and
    block_decay use each block's real length, lambda^(end-1-t) and lambda^(length), so the padded tail
    neither decays the final state nor shifts the last block's keys (padded rows get lambda^0, times k = 0).
    """
    dtype = lam.dtype if dtype is None else dtype
    n_blocks = -(-n // block_size)
    device = lam.device
    mask, q_scale, _, _ = block_factors(block_size, lam, dtype)
    starts = torch.arange(n_blocks, device=device) * block_size
    ends = torch.clamp(starts + block_size, max=n)  # one past each block's last real row
    t = starts[:, None] + torch.arange(block_size, device=device)[None, :]  # global row index (n_blocks, B)
    k_scale = _powers(lam, (ends[:, None] - 1 - t).clamp(min=0), dtype)[..., None]
    block_decay = _powers(lam, ends - starts, dtype)
    return mask[:, None], q_scale[:, None], k_scale, block_decay


def intra_block_outputs(qb, kb, vb, mask):
    """O_intra for every block in one batched matmul: [(Q_i K_i^T) * M] V_i, the mask selecting.

    qb, kb: (batch, heads, n_blocks, B, d_k); vb: (..., B, d_v); mask: (heads, 1, B, B).
    Returns (batch, heads, n_blocks, B, d_v).
    """
    return masked_product((qb @ kb.transpose(-1, -2)) * mask, _causal(qb.shape[-2], qb.device), vb)


def local_block_states(kb, vb, k_scale):
    """Each block's own contribution to the state, (diag(lambda^(b-1-r)) K_i)^T V_i, in one batched matmul.

    kb: (batch, heads, n_blocks, B, d_k); vb: (..., B, d_v); k_scale: (heads, n_blocks, B, 1).
    Returns (batch, heads, n_blocks, d_k, d_v).
    """
    return (k_scale * kb).transpose(-1, -2) @ vb


def scan_states(local, block_decay, initial=None, scan: str = "sequential"):
    """The states between blocks: S_0 = initial, S_(i+1) = lambda^(b_i) S_i + L_i. (Chapter 06.)

    local: (batch, heads, n_blocks, d_k, d_v) the L_i; block_decay: (heads, n_blocks) the lambda^(b_i);
    initial: (batch, heads, d_k, d_v) or None (zeros). Returns (batch, heads, n_blocks + 1, d_k, d_v):
    entry i is the state entering block i, the last entry the final state.

    ``scan="sequential"`` takes n_blocks dependent steps. ``scan="log"`` is the Hillis-Steele doubling scan
    over pairs (A, X) with (A2, X2) after (A1, X1) = (A1 A2, A2 X1 + X2): ceil(log2 n_blocks) steps of
    whole-tensor work, each A a product of decays <= 1 (never a division, so nothing overflows).
    """
    scan = validate_choice("scan", scan, SCANS)
    batch, heads, n_blocks, d_k, d_v = local.shape
    if initial is None:
        initial = local.new_zeros(batch, heads, d_k, d_v)
    a = block_decay[:, :, None, None]  # (heads, n_blocks, 1, 1), broadcasts against (batch, heads, n_blocks, d_k, d_v)
    if scan == "sequential":
        states = local.new_empty(batch, heads, n_blocks + 1, d_k, d_v)
        states[:, :, 0] = initial
        if torch.compiler.is_compiling():  # Dynamo refuses a strided out=: the same op, then a copy
            for i in range(n_blocks):
                states[:, :, i + 1] = torch.addcmul(local[:, :, i], a[:, i], states[:, :, i])
            return states
        for i in range(n_blocks):  # one fused op per step, written in place: the steps are the cost here
            torch.addcmul(local[:, :, i], a[:, i], states[:, :, i], out=states[:, :, i + 1])
        return states
    x, prod = local, a.expand(heads, n_blocks, 1, 1)
    step = 1
    while step < n_blocks:  # after this step, x[i] sums L_j over i - 2 step < j <= i, prod[i] the matching decay
        x = torch.cat([x[:, :, :step], x[:, :, step:] + prod[:, step:] * x[:, :, :-step]], dim=2)
        prod = torch.cat([prod[:, :step], prod[:, step:] * prod[:, :-step]], dim=1)
        step *= 2
    return torch.cat([initial[:, :, None], x + prod * initial[:, :, None]], dim=2)


def inter_block_outputs(qb, states, q_scale):
    """O_inter for every block in one batched matmul: diag(lambda^(r+1)) Q_i S_i.

    qb: (batch, heads, n_blocks, B, d_k); states: (batch, heads, n_blocks, d_k, d_v) the states entering
    each block; q_scale: (heads, 1, B, 1). Returns (batch, heads, n_blocks, B, d_v).
    """
    return (q_scale * qb) @ states


GROUP_BYTES_PER_THREAD = 512 * 1024  # about one core's L2 cache


def blocks_per_group(batch: int, heads: int, block: int, n_blocks: int, device, itemsize: int = 4) -> int:
    """How many blocks the forward and backward take at a time: all n/B blocks on a GPU; on a CPU as many
    as keep one group's B x B scores, batch x heads x G x B x B numbers, within ``GROUP_BYTES_PER_THREAD``
    per torch thread (each thread works on its own share of a batched operation).

    Why groups: cache. The all-at-once form makes every block's scores (nB numbers per head: 16 MiB at
    n = 16K and 4 heads in float32), its local states and the scanned states (n/B of d_k x d_v: as big as
    Q itself when B = d) and passes over each of them several times; on a CPU those passes stream the
    tensors through main memory, and that, not the arithmetic, sets the time. A group's tensors stay in
    the cores' caches between the operations that make and use them, as the loop's single block does,
    while each operation still covers many blocks (few operations launched). A GPU launches a kernel per
    operation and tiles each matmul in its own on-chip memory: there, one group is fastest.
    """
    if torch.device(device).type != "cpu":
        return n_blocks
    budget = GROUP_BYTES_PER_THREAD * _num_threads()
    return max(1, min(n_blocks, budget // (batch * heads * block * block * itemsize)))


@torch.compiler.assume_constant_result
def _num_threads() -> int:
    """``torch.get_num_threads()``, read on every eager call; while :func:`torch.compile` traces, read once and kept
    in the graph as a constant (Dynamo cannot put a call returning an int in a graph): a compiled call groups its
    blocks as an eager call did when it was traced, and the groups set the speed, not the result."""
    return torch.get_num_threads()


def block_groups(xb: torch.Tensor):
    """Slices of the block axis of xb (batch, heads, n_blocks, B, d), consecutive groups of
    :func:`blocks_per_group` blocks: ``for g in block_groups(qb): ... qb[:, :, g] ...``."""
    batch, heads, n_blocks, block, _ = xb.shape
    size = blocks_per_group(batch, heads, block, n_blocks, xb.device, xb.element_size())
    return [slice(start, start + size) for start in range(0, n_blocks, size)]


def _prepare(q, k, v, initial_state, decay, block_size):
    """Cast to the compute dtype, cut into blocks, build the factors. Shared by forward and backward."""
    n = q.shape[2]
    dtype = compute_dtype(q.dtype)
    block = min(block_size or DEFAULT_BLOCK_SIZE, n)  # a block longer than the sequence only adds zeros
    lam = decay_tensor(decay, q.device)  # float64: the factors are rounded to ``dtype`` once, at the end
    factors = chunk_factors(n, block, lam, dtype)
    blocks = [to_blocks(x.to(dtype), block) for x in (q, k, v)]
    init = None if initial_state is None else initial_state.to(dtype)
    return n, block, dtype, factors, blocks, init


def _forward(q, k, v, initial_state, decay, block_size, scan):
    """Algorithm 1, chunk-parallel within each group of blocks, sequential across groups (one group on a GPU).

    Per group (:func:`block_groups`): its local states in one batched matmul, scanned from the state
    carried in, then its intra and inter parts in one batched matmul each. With one block per group this
    is :func:`loop_forward`; with all n/B blocks in one group it is the all-at-once form of transformations
    3 to 5, which is what runs on a GPU. On a CPU groups of a cache's size are faster than either.
    """
    n, block, dtype, (mask, q_scale, k_scale, block_decay), (qb, kb, vb), state = _prepare(
        q, k, v, initial_state, decay, block_size
    )
    ob = vb.new_empty(vb.shape)  # (batch, heads, n_blocks, B, d_v), filled one group of blocks at a time
    for g in block_groups(qb):
        local = local_block_states(kb[:, :, g], vb[:, :, g], k_scale[:, g])
        states = scan_states(local, block_decay[:, g], state, scan)  # entering each block of g, and leaving g
        ob[:, :, g] = intra_block_outputs(qb[:, :, g], kb[:, :, g], vb[:, :, g], mask) + inter_block_outputs(
            qb[:, :, g], states[:, :, :-1], q_scale
        )
        state = states[:, :, -1]
    o = ob.reshape(q.shape[0], q.shape[1], -1, v.shape[3])[:, :, :n]
    return o.to(q.dtype), state.clone()  # a view would keep the last group's states alive


def _backward(q, k, v, do, initial_state, d_final_state, decay, block_size, scan):
    """Algorithm 2, chunk-parallel within each group of blocks (:func:`block_groups`). Returns
    (dq, dk, dv, d_initial_state) in the compute dtype.

    Forward sweep, first group to last: the states S_i entering each block are rebuilt by the same scan as
    the forward (recomputed, not stored by the forward: the memory stays that of the forward). Reverse sweep,
    last group to first: G_i = dL/dS_i obeys G_n_blocks = d_final_state,
    G_i = lambda^(b_i) G_(i+1) + (diag(lambda^(r+1)) Q_i)^T dO_i, the same scan run over the reversed blocks;
    each group's gradients follow from its S_i and G_(i+1).
    """
    n, block, dtype, (mask, q_scale, k_scale, block_decay), (qb, kb, vb), state = _prepare(
        q, k, v, initial_state, decay, block_size
    )
    dob = to_blocks(do.to(dtype), block)
    groups = block_groups(qb)
    states = vb.new_empty(*kb.shape[:3], kb.shape[4], vb.shape[4])  # S_i, entering each block
    for g in groups:  # forward sweep, as in _forward
        scanned = scan_states(local_block_states(kb[:, :, g], vb[:, :, g], k_scale[:, g]), block_decay[:, g], state, scan)
        states[:, :, g] = scanned[:, :, :-1]
        state = scanned[:, :, -1]
    grad = None if d_final_state is None else d_final_state.to(dtype)  # G after the last block (None: zeros)
    dqb, dkb, dvb = qb.new_empty(qb.shape), kb.new_empty(kb.shape), vb.new_empty(vb.shape)
    causal = _causal(block, q.device)
    for g in reversed(groups):  # reverse sweep; qi etc. hold the blocks of group g
        qi, ki, vi, doi, si, ks = qb[:, :, g], kb[:, :, g], vb[:, :, g], dob[:, :, g], states[:, :, g], k_scale[:, g]
        d_local = (q_scale * qi).transpose(-1, -2) @ doi  # (batch, heads, blocks of g, d_k, d_v)
        d_states = scan_states(d_local.flip(2), block_decay[:, g].flip(1), grad, scan).flip(2)
        d_after, grad = d_states[:, :, 1:], d_states[:, :, 0]  # G_(i+1) for each block of g; G entering g
        scores = (qi @ ki.transpose(-1, -2)) * mask  # [(Q_i K_i^T) * M]; the zeros of M are selected below
        d_scores = (doi @ vi.transpose(-1, -2)) * mask  # [(dO_i V_i^T) * M]
        dqb[:, :, g] = masked_product(d_scores, causal, ki) + q_scale * (doi @ si.transpose(-1, -2))
        # Transposed tiles: row s meets rows r >= s of the other operand.
        dkb[:, :, g] = masked_product(d_scores.transpose(-1, -2), causal.T, qi) + ks * (vi @ d_after.transpose(-1, -2))
        dvb[:, :, g] = masked_product(scores.transpose(-1, -2), causal.T, doi) + ks * (ki @ d_after)

    def unblock(x, d):
        return x.reshape(q.shape[0], q.shape[1], -1, d)[:, :, :n]

    return unblock(dqb, q.shape[3]), unblock(dkb, k.shape[3]), unblock(dvb, v.shape[3]), grad


class LightningAttentionFunction(torch.autograd.Function):
    """Chunk-parallel forward (Algorithm 1) with a hand-written chunk-parallel backward (Algorithm 2).

    ``apply(q, k, v, initial_state, decay, block_size, scan)`` with decay as validated (a float64 numpy array
    (heads,), or a tensor: one that requires grad gets dL/dlambda by :func:`decay_gradient`) and initial_state
    a tensor or None; returns (o, final_state). Inputs are assumed validated.
    """

    @staticmethod
    def forward(ctx, q, k, v, initial_state, decay, block_size, scan):
        ctx.set_materialize_grads(False)
        o, final = _forward(q, k, v, initial_state, decay, block_size, scan)
        ctx.decay_grad = torch.is_tensor(decay) and decay.requires_grad
        ctx.save_for_backward(q, k, v, initial_state)
        ctx.decay, ctx.block_size, ctx.scan = decay, block_size, scan
        return o, final

    @staticmethod
    def backward(ctx, do, d_final):
        q, k, v, initial_state = ctx.saved_tensors
        do = torch.zeros_like(v) if do is None else do
        decay = ctx.decay.detach() if torch.is_tensor(ctx.decay) else ctx.decay
        grads = first_derivative_only("the torch backend", _gradients, q, k, v, do, initial_state, d_final, decay,
                                      ctx.block_size, ctx.scan, ctx.decay_grad)
        return (*grads, None, None)


def _gradients(q, k, v, do, initial_state, d_final, decay, block_size, scan, decay_grad):
    """(dq, dk, dv, d_initial_state, d_decay) of :class:`LightningAttentionFunction` (d_decay None unless asked)."""
    dq, dk, dv, d_init = _backward(q, k, v, do, initial_state, d_final, decay, block_size, scan)
    d_init = None if initial_state is None else d_init.to(initial_state.dtype)
    d_decay = None
    if decay_grad:  # dL/dlambda itself, not dL/d(ln lambda) / lambda: see decay_gradient
        d_decay = decay_gradient(q, k, v, do, decay, initial_state, d_final, block_size, scan, wrt="lambda")
        d_decay = d_decay.to(decay.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), d_init, d_decay


class _FirstDerivativeOnly(torch.autograd.Function):
    """``fn(*args)`` as one node of a graph that ``create_graph=True`` is building, whose own backward raises.

    For a hand-written backward that has no backward of its own. Its tensor arguments connect the node to the
    graph, so a second derivative, by ``.backward()`` or by ``torch.autograd.grad(..., inputs=...)``, reaches it
    and raises. (``@once_differentiable`` puts its error node on outputs that no input leads to, so
    ``autograd.grad`` with ``inputs`` never runs it, and the second derivative would come back without this
    function's term, silently wrong.)
    """

    @staticmethod
    def forward(ctx, who, fn, *args):
        ctx.who = who
        return fn(*args)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(f"{ctx.who} has no second derivative: its hand-written backward has no backward of its "
                           f"own (differentiate once, or compute higher derivatives another way)")


def first_derivative_only(who: str, fn, *args):
    """``fn(*args)``; while a graph is being built (``create_graph=True``), through :class:`_FirstDerivativeOnly`,
    so that differentiating the result again raises instead of silently leaving this term out."""
    if not torch.is_grad_enabled():
        return fn(*args)
    return _FirstDerivativeOnly.apply(who, fn, *args)


def chunked_forward(q, k, v, decay=1.0, block_size: int | None = None, initial_state=None, scan: str = "sequential"):
    """Chunk-parallel Algorithm 1, differentiable through the hand-written Algorithm 2. (Chapter 06.)

    q, k: (batch, heads, n, d_k); v: (batch, heads, n, d_v); decay: lambda in (0, 1], one float or one
    per head; initial_state: (batch, heads, d_k, d_v) or None; any n, any block size (default 64).
    Returns (o, final_state): o (batch, heads, n, d_v) in q's dtype, final_state (batch, heads, d_k, d_v)
    in the compute dtype. Memory, per group of G blocks (:func:`blocks_per_group`; G = n/B on a GPU): G + 1
    block states, each d_k x d_v, plus the (G, B, B) scores; the backward keeps all n/B states.
    """
    args = validate_attention_args(q, k, v, decay, backend="torch", block_size=block_size, initial_state=initial_state,
                                   decay_grad=True)
    validate_choice("scan", scan, SCANS)
    return LightningAttentionFunction.apply(args.q, args.k, args.v, args.initial_state, args.decay, args.block_size, scan)


def chunked_backward(
    q, k, v, do, decay=1.0, block_size: int | None = None, initial_state=None, d_final_state=None, scan: str = "sequential"
):
    """Algorithm 2, chunk-parallel: (dq, dk, dv, d_initial_state) given do = dL/do. (Chapter 06.)

    ``d_final_state`` (batch, heads, d_k, d_v) is dL/d(final state) when the final state was used (zeros if
    None). The gradients come back in the dtypes of q, k, v; d_initial_state in the compute dtype (it is
    returned even without an initial state: it is then dL/dKV_0 for KV_0 = 0).
    """
    args = validate_attention_args(
        q, k, v, decay, backend="torch", block_size=block_size, initial_state=initial_state, do=do,
        d_final_state=d_final_state, need_do=True,
    )
    return backward_from_args(args, d_final_state, validate_choice("scan", scan, SCANS))


def loop_forward(q, k, v, decay=1.0, block_size: int | None = None, initial_state=None):
    """Algorithm 1 ported line by line: a Python loop over the blocks, torch ops inside. (Chapter 06.)

    Same arguments and results as :func:`chunked_forward`; differentiable by plain autograd (it keeps
    every block's intermediate tensors, which is what the hand-written backward avoids). Autograd's own
    backward of a dense product multiplies masked zeros too, so with NaN or inf inputs only the forward here
    is exactly causal; the hand-written backward of :func:`chunked_forward` is exact for those as well.
    """
    args = validate_attention_args(q, k, v, decay, backend="torch", block_size=block_size, initial_state=initial_state)
    dtype = compute_dtype(q.dtype)
    block = args.block_size or DEFAULT_BLOCK_SIZE
    lam = decay_tensor(args.decay, q.device)
    q, k, v = (x.to(dtype) for x in (args.q, args.k, args.v))
    kv = q.new_zeros(args.batch, args.heads, args.d_k, args.d_v)
    if initial_state is not None:
        kv = initial_state.to(dtype)
    outputs, factors = [], {}
    for start in range(0, args.seq_len, block):
        qi, ki, vi = (x[:, :, start : start + block] for x in (q, k, v))
        b = qi.shape[2]
        if b not in factors:  # every block has the same factors except a shorter last one
            factors[b] = block_factors(b, lam, dtype)
        mask, q_scale, k_scale, block_decay = factors[b]
        o_intra = masked_product((qi @ ki.transpose(-1, -2)) * mask, _causal(b, q.device), vi)
        o_inter = (q_scale * qi) @ kv
        kv = block_decay * kv + (k_scale * ki).transpose(-1, -2) @ vi
        outputs.append(o_intra + o_inter)
    return torch.cat(outputs, dim=2).to(args.q.dtype), kv


def recurrent_forward(q, k, v, decay=1.0, initial_state=None):
    """The per-token recurrence KV_t = lambda KV_(t-1) + k_t^T v_t, o_t = q_t KV_t in torch. (Chapters 02, 06.)

    n dependent steps of O(d_k d_v) work each: the baseline the chunk-parallel form is benchmarked against.
    Returns (o, final_state) like :func:`chunked_forward`.
    """
    args = validate_attention_args(q, k, v, decay, backend="torch", initial_state=initial_state)
    dtype = compute_dtype(q.dtype)
    lam = decay_tensor(args.decay, q.device, dtype)[None, :, None, None]
    q, k, v = (x.to(dtype) for x in (args.q, args.k, args.v))
    kv = q.new_zeros(args.batch, args.heads, args.d_k, args.d_v)
    if initial_state is not None:
        kv = initial_state.to(dtype)
    outputs = []
    for t in range(args.seq_len):
        kv = lam * kv + k[:, :, t, :, None] * v[:, :, t, None, :]
        outputs.append((q[:, :, t, None, :] @ kv)[:, :, 0])
    return torch.stack(outputs, dim=2).to(args.q.dtype), kv


def masked_forward(q, k, v, decay=1.0):
    """The quadratic form [(Q K^T) * M] V with the full n x n decay mask, in torch. (Chapters 03, 06.)

    O(n^2 d) time and O(n^2) memory per head: the benchmark's quadratic baseline. Returns o only.
    """
    args = validate_attention_args(q, k, v, decay, backend="torch")
    dtype = compute_dtype(q.dtype)
    mask, _, _, _ = block_factors(args.seq_len, decay_tensor(args.decay, q.device), dtype)
    q, k, v = (x.to(dtype) for x in (args.q, args.k, args.v))
    return masked_product((q @ k.transpose(-1, -2)) * mask, _causal(args.seq_len, q.device), v).to(args.q.dtype)


# Registry hooks (lightning_edu.registry): validated arguments in, (o, final_state or None) out.

def forward_from_args(args, scan: str = "sequential", **options):
    """The chunk-parallel differentiable form: the torch backend of :func:`lightning_edu.lightning_attention`."""
    return LightningAttentionFunction.apply(args.q, args.k, args.v, args.initial_state, args.decay, args.block_size, scan)


def backward_from_args(args, d_final_state=None, scan: str = "sequential", **options):
    """The hand-written Algorithm 2: (dq, dk, dv, d_initial_state) in the dtypes of q, k, v and the compute dtype."""
    with torch.no_grad():
        dq, dk, dv, d_init = _backward(args.q, args.k, args.v, args.do, args.initial_state, d_final_state, args.decay,
                                       args.block_size, scan)
    return dq.to(args.q.dtype), dk.to(args.k.dtype), dv.to(args.v.dtype), d_init


def loop_from_args(args, **options):
    return loop_forward(args.q, args.k, args.v, args.decay, args.block_size, args.initial_state)


def recurrent_from_args(args, **options):
    return recurrent_forward(args.q, args.k, args.v, args.decay, args.initial_state)


def masked_from_args(args, **options):
    return masked_forward(args.q, args.k, args.v, args.decay), None


def step_from_args(args, **options):
    """One decoding step in torch: (o, new_state), differentiable by autograd. (Chapters 02, 06.)

    ``args`` is a checked :class:`~lightning_edu.validation.StepArgs`. Per batch and head,
    ``new_state = lambda state + k^T v`` and ``o = q new_state``, in plain tensor ops, so autograd gives the
    gradients of q, k, v and state. It computes in :func:`compute_dtype`: o comes back in v's dtype, new_state
    in float32 for float16/bfloat16 inputs (the state is carried from step to step, so it keeps float32).
    """
    dtype = compute_dtype(args.q.dtype)
    q, k, v = (x.to(dtype) for x in (args.q, args.k, args.v))
    new_state = k[..., :, None] * v[..., None, :]  # outer product k^T v
    if args.state is not None:
        lam = decay_tensor(args.decay, q.device, dtype)[None, :, None, None]
        new_state = lam * args.state.to(dtype) + new_state
    o = (q[..., None, :] @ new_state)[..., 0, :]
    return o.to(args.v.dtype), new_state
