"""The triton backend reads strided inputs where they lie and lays its outputs out as its inputs.

A model's q, k and v are views of one projection, ``qkv(x).view(b, n, 3, h, d).permute(2, 0, 3, 1, 4)``:
(batch, heads, n, d) tensors whose rows are 3 h d elements apart. The kernels take each tensor's strides
(la2_fast.in_place), o comes back laid out as v and each gradient as its input (la2_fast.output_like), so
``o.transpose(1, 2).reshape(b, n, h * d)`` is free. Checked here:

* the same bits as the same values made contiguous first: o, the final state and the gradients of q, k and v
  (and the projection's, to rounding: SiLU's backward is PyTorch's), through the backend (both doors: the eager
  Function and the custom op) and through each launcher (la2_fast, la2_literal, la3), for projection views, rows padded apart, (batch, n, heads, d) order and a transposed head dim (copied);
* the layouts: o as v, dq as q, dk as k, dv as v, and the fake implementations promising the real strides;
* an expanded output gradient (``o.sum()``'s, stride 0 everywhere) is copied, not read as a contiguous tensor.

"cpu" cases run in Triton's CPU interpreter (fp32), "cuda" cases on a GPU (bf16 and fp32).
"""

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import cases, on, synchronize

from lightning_edu.triton_kernels import VARIANTS, log2_decay_tensor, triton_attention
from lightning_edu.triton_kernels._tiles import aligned, dense
from lightning_edu.triton_kernels.la2_fast import in_place, output_like
from lightning_edu.triton_kernels.ops import EagerLA2, la2_backward, la2_forward

DECAYS = [0.9, 1.0, 0.05]


def projection_views(batch, n, heads, d, device, dtype, seed=0, requires_grad=False):
    """(x, q, k, v): x (batch, n, 3 heads d) and its q, k, v views (batch, heads, n, d), as a model makes them
    (q and k through SiLU, which keeps the (batch, n, heads, d) order; v the raw, non-dense view)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = (torch.randn(batch, n, 3 * heads * d, device=device, generator=g) / 2).to(dtype).requires_grad_(requires_grad)
    q, k, v = x.view(batch, n, 3, heads, d).permute(2, 0, 3, 1, 4)
    return x, F.silu(q), F.silu(k), v


SHAPES = {  # batch, n, heads, d
    "cpu": [((2, 77, 3, 16), torch.float32), ((1, 130, 2, 32), torch.float32)],
    "cuda": [((2, 1000, 3, 64), torch.bfloat16), ((1, 4099, 2, 128), torch.bfloat16),
             ((2, 333, 3, 64), torch.float32), ((1, 2000, 2, 128), torch.float16)],
}


@cases("shape,dtype", SHAPES, same_worker=lambda case: f"projection views {case}")  # both doors: one compilation
@pytest.mark.parametrize("door", ["eager", "op"])
def test_projection_views_give_the_same_bits_and_layouts(device, shape, dtype, door):
    batch, n, heads, d = shape
    decay = DECAYS[:heads]
    g = torch.Generator(device=device).manual_seed(1)
    grad_o = (torch.randn(batch, n, heads, d, device=device, generator=g) / 2).to(dtype)
    results = []
    for strided in (True, False):
        x, q, k, v = projection_views(batch, n, heads, d, device, dtype, requires_grad=True)
        if not strided:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        for t in (q, k, v):
            t.retain_grad()
        if door == "eager":
            o, sn = triton_attention(q, k, v, decay)
        else:
            o, sn, _ = la2_forward(q, k, v, log2_decay_tensor(decay, device), None, None, True)
        if strided:
            assert o.stride() == output_like(v).stride()
            assert o.transpose(1, 2).is_contiguous(), "o is not laid out (batch, n, heads, d) as v is"
        (o * grad_o.transpose(1, 2)).sum().backward()
        synchronize(device)
        results.append((o.detach(), sn, q.grad, k.grad, v.grad, x.grad))
    strided, copied = results
    for a, b, name in zip(strided[:5], copied[:5], ("o", "final state", "dq", "dk", "dv")):
        assert torch.equal(a, b), f"{name}: strided views and contiguous copies disagree"
    # Through the projection: v's third of x.grad is dv as it is; q's and k's pass SiLU's backward, which PyTorch
    # computes with another vectorised kernel for a strided than for a contiguous tensor on some CPUs (AVX-512):
    # equal there to rounding, not to the bit.
    xs, xc = (g.view(batch, n, 3, heads, d) for g in (strided[5], copied[5]))
    assert torch.equal(xs[:, :, 2], xc[:, :, 2]), "the projection's v part: strided views and contiguous copies disagree"
    torch.testing.assert_close(xs, xc, msg="the projection's gradient: strided views and contiguous copies disagree")


@on()
def test_gradients_are_laid_out_as_their_inputs_and_fakes_agree(device):
    from torch._subclasses.fake_tensor import FakeTensorMode

    dtype = torch.float32
    _, q, k, v = projection_views(2, 70, 2, 16, device, dtype)
    q, k = q.detach(), k.detach()
    l2 = log2_decay_tensor(DECAYS[:2], device)
    do = torch.randn(2, 70, 2, 16, device=device).transpose(1, 2)  # dense, (batch, n, heads, d) order
    o, sn, inc = la2_forward(q, k, v, l2, None, 16, True)
    dq, dk, dv, ds0 = la2_backward(q, k, v, do, l2, None, None, inc, 16)
    synchronize(device)
    assert (dq.stride(), dk.stride(), dv.stride()) == (q.stride(), k.stride(), output_like(v).stride())
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fq, fk, fv, fdo, fl2 = (mode.from_tensor(t) for t in (q, k, v, do, l2))
        fo, fsn, finc = la2_forward(fq, fk, fv, fl2, None, 16, True)
        fgrads = la2_backward(fq, fk, fv, fdo, fl2, None, None, finc, 16)
    for real, fake, name in zip((o, sn, inc, dq, dk, dv, ds0), (fo, fsn, finc, *fgrads),
                                ("o", "final state", "incoming", "dq", "dk", "dv", "d_initial_state")):
        assert (tuple(fake.shape), fake.stride(), fake.dtype) == (tuple(real.shape), real.stride(), real.dtype), name


@on("cpu")
def test_opcheck_on_strided_views(device):
    _, q, k, v = projection_views(1, 40, 2, 16, device, torch.float32)
    q, k = q.detach(), k.detach()
    l2 = log2_decay_tensor(DECAYS[:2], device)
    torch.library.opcheck(la2_forward, (q, k, v, l2, None, 16, True))
    _, _, inc = la2_forward(q, k, v, l2, None, 16, True)
    do = torch.randn(1, 40, 2, 16).transpose(1, 2)
    torch.library.opcheck(la2_backward, (q, k, v, do, l2, None, None, inc, 16))


def _layouts(t):
    """The same values as t in three layouts the launchers must read: rows padded apart, a (batch, n, heads, d)
    permutation and a transposed head dim (not addressable in place: copied)."""
    padded = torch.zeros(t.shape[0], t.shape[1], t.shape[2], t.shape[3] + 5, dtype=t.dtype, device=t.device)
    padded[..., : t.shape[3]] = t
    return {
        "row_padded": padded[..., : t.shape[3]],  # rows t.shape[3] + 5 apart
        "bnhd": t.transpose(1, 2).contiguous().transpose(1, 2),
        "head_dim_transposed": t.transpose(-1, -2).contiguous().transpose(-1, -2),
    }


@on()
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("layout", ["row_padded", "bnhd", "head_dim_transposed"])
def test_launchers_read_any_layout(device, variant, layout):
    forward, backward = VARIANTS[variant]
    g = torch.Generator(device=device).manual_seed(3)
    q, k, v, do = (torch.randn(2, 2, 50, 16, device=device, generator=g) / 2 for _ in range(4))
    l2 = log2_decay_tensor(DECAYS[:2], device)
    want_o, want_sn = forward(q, k, v, l2, block=16)
    want_grads = backward(q, k, v, do, l2, block=16)
    qs, ks, vs, dos = (_layouts(t)[layout] for t in (q, k, v, do))
    assert all(torch.equal(a, b) for a, b in zip((qs, ks, vs, dos), (q, k, v, do)))
    o, sn = forward(qs, ks, vs, l2, block=16)
    grads = backward(qs, ks, vs, dos, l2, block=16)
    synchronize(device)
    assert torch.equal(o, want_o) and torch.equal(sn, want_sn), f"{variant} forward on a {layout} layout"
    for got, want, name in zip(grads, want_grads, ("dq", "dk", "dv", "ds0")):
        assert torch.equal(got, want), f"{variant} backward's {name} on a {layout} layout"
    if variant != "la2_literal":  # the backend's kernels: outputs laid out as their inputs, as the fakes promise
        for got, x, name in zip((o, *grads[:3]), (vs, qs, ks, vs), ("o", "dq", "dk", "dv")):
            assert got.stride() == output_like(x).stride(), f"{variant}: {name} not laid out as its input ({layout})"


@on()
def test_expanded_output_gradient_is_copied_not_misread(device):
    _, q, k, v = projection_views(1, 45, 2, 16, device, torch.float32, requires_grad=False)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o, _, _ = EagerLA2.apply(*leaves, log2_decay_tensor(DECAYS[:2], device), None, 16, True)
    o.sum().backward()  # the gradient reaching the backward is ones expanded: stride 0 in every dim
    got = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    o, _, _ = EagerLA2.apply(*leaves, log2_decay_tensor(DECAYS[:2], device), None, 16, True)
    o.backward(torch.ones_like(o).contiguous())
    synchronize(device)
    for a, t, name in zip(got, leaves, "qkv"):
        assert torch.equal(a, t.grad), f"d{name} from an expanded gradient differs from a materialised one"


def test_in_place_copies_only_what_the_kernels_cannot_address():
    t = torch.randn(2, 3, 10, 8)
    assert in_place(t) is t
    view = t.transpose(1, 2).contiguous().transpose(1, 2)
    assert in_place(view) is view
    transposed = t.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert in_place(transposed).is_contiguous() and in_place(transposed) is not transposed
    # rows of a head past 32-bit offsets (a meta tensor: no memory): copied to a contiguous tensor
    wide = torch.empty(1, 1, 2**20, 64, device="meta").as_strided((1, 1, 2**20, 64), (0, 0, 2**12, 1))
    assert in_place(wide).is_contiguous()
    out = output_like(torch.empty(1, 2, 3, 4, device="meta").transpose(-1, -2))
    assert out.stride(-1) == 1


def test_a_view_off_a_16_byte_boundary_is_copied_to_an_aligned_one():
    """The kernels are handed only tensors that start on a 16-byte boundary (``_tiles.dense``): a view one element
    into a buffer is copied, values unchanged, while an aligned contiguous tensor and an aligned strided view are
    read where they lie."""
    buffer = torch.randn(2 * 3 * 10 * 8 + 8)
    for offset, copied in ((0, False), (1, True), (4, False), (2, True)):
        view = buffer[offset:offset + 480].view(2, 3, 10, 8)  # 4 float32 = 16 bytes: offset 4 is aligned
        for fn in (in_place, dense):
            got = fn(view)
            assert (got is not view) == copied, (fn.__name__, offset)
            assert aligned(got) and got.is_contiguous() and torch.equal(got, view), (fn.__name__, offset)
    strided = buffer[:480].view(2, 10, 3, 8).transpose(1, 2)  # aligned, not contiguous: in_place keeps it
    assert in_place(strided) is strided and dense(strided) is not strided
    assert dense(None) is None


# (batch, heads, n, d_k, d_v), dtype. On an H100 (Triton 3.6) the kernels compiled for a key tensor off a 16-byte
# boundary computed d_k = 64, d_v = 32 wrong, in bf16 and fp16, before the launchers handed them aligned copies.
MISALIGNED = {
    "cpu": [((1, 2, 77, 32, 16), torch.float32)],
    "cuda": [((1, 2, 333, 64, 32), torch.float16), ((1, 2, 333, 64, 32), torch.bfloat16),
             ((2, 3, 1000, 128, 128), torch.bfloat16), ((1, 2, 300, 64, 64), torch.bfloat16)],
}


@cases("shape,dtype", MISALIGNED, same_worker=lambda case: f"misaligned {case}")
def test_inputs_off_a_16_byte_boundary_give_the_bits_of_aligned_ones(device, shape, dtype):
    """q, k, v, dO and the initial state each a view one element into a buffer: o, the final state and every
    gradient are the bits the same values give from aligned tensors."""
    batch, heads, n, d_k, d_v = shape
    g = torch.Generator(device=device).manual_seed(5)

    def off_boundary(*size, scale=1.0):
        count = 1
        for s in size:
            count *= s
        buffer = (torch.randn(count + 1, device=device, generator=g) * scale).to(dtype)
        return buffer[1:].view(*size)

    views = [off_boundary(batch, heads, n, d_k, scale=0.5), off_boundary(batch, heads, n, d_k, scale=0.5),
             off_boundary(batch, heads, n, d_v), off_boundary(batch, heads, n, d_v)]
    s0 = off_boundary(batch, heads, d_k, d_v).float()  # float32 views stay off the boundary; others are copied
    assert not any(aligned(x) for x in views)
    decay = [0.9, 0.99, 0.5][:heads]
    results = []
    for copy in (False, True):
        q, k, v = (x.clone() if copy else x for x in views[:3])
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        init = (s0.clone() if copy else s0).detach().requires_grad_()
        o, sn = triton_attention(q, k, v, decay, init)
        do = views[3].clone() if copy else views[3]
        torch.autograd.backward([o, sn], [do, torch.ones_like(sn)])
        synchronize(device)
        results.append((o.detach(), sn.detach(), q.grad, k.grad, v.grad, init.grad))
    for a, b, name in zip(*results, ("o", "final state", "dq", "dk", "dv", "d initial state")):
        assert torch.equal(a, b), f"{name}: inputs off a 16-byte boundary and aligned copies disagree"
