"""The fused Triton rotation (ropekit.kernels.fused_rotary) against a float64 PyTorch reference written here.

With a CUDA device the compiled kernels are tested on it. Without one they run in Triton's interpreter: this
module then sets ``TRITON_INTERPRET=1`` for its own tests only (restored afterwards; ropekit.kernels re-imports its
kernels in the mode the variable asks for), so the rest of the suite is unaffected. Sizes are tiny: the
interpreter runs every program in Python.
"""

from __future__ import annotations

import os
from typing import Optional

import pytest
import torch
from torch import Tensor

pytest.importorskip("triton")

from ropekit.kernels import available, fused_rotary  # noqa: E402


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MODE = "0" if DEVICE == "cuda" else "1"  # TRITON_INTERPRET for this module


@pytest.fixture(scope="module", autouse=True)
def _interpreter(triton_mode):  # compiled on CUDA, else Triton's interpreter (tests/conftest.py)
    yield


# ----------------------------------------------------------------------------- independent float64 reference
def _angles(coords: Tensor, freqs: Tensor) -> Tensor:
    """``(Bc, Hf, M, P)`` angles ``sum_j r_j * w_jp`` by broadcasting (coords ``(M, c)`` / ``(B, M, c)``, freqs
    ``(c, P)`` / ``(H, c, P)``)."""
    r = coords if coords.dim() == 3 else coords.unsqueeze(0)  # (Bc, M, c)
    w = freqs if freqs.dim() == 3 else freqs.unsqueeze(0)  # (Hf, c, P)
    return (r[:, None, :, :, None] * w[None, :, None, :, :]).sum(-2)


def _rotate_ref(x: Tensor, theta: Tensor, prefix: int, pairs: str) -> Tensor:
    d = x.shape[-1]
    body = x[:, :, prefix:]
    if pairs == "interleaved":
        x0, x1 = body[..., 0::2], body[..., 1::2]
    else:
        x0, x1 = body[..., : d // 2], body[..., d // 2:]
    c, s = theta.cos(), theta.sin()
    y0, y1 = x0 * c - x1 * s, x0 * s + x1 * c
    y = torch.stack((y0, y1), -1).flatten(-2) if pairs == "interleaved" else torch.cat((y0, y1), -1)
    return torch.cat((x[:, :, :prefix], y), dim=2)


def reference(q: Tensor, k: Optional[Tensor], coords: Tensor, freqs: Tensor, k_coords: Optional[Tensor],
              prefix: int, pairs: str):
    """Rotation in float64 of the (float64 copies of the) inputs; GQA keys broadcast their shared frequencies."""
    qo = _rotate_ref(q, _angles(coords, freqs), prefix, pairs)
    ko = None if k is None else _rotate_ref(k, _angles(coords if k_coords is None else k_coords, freqs), prefix,
                                            pairs)
    return qo, ko


# ----------------------------------------------------------------------------- cases
def _make(b=2, hq=2, hk=2, nq=5, nk=None, d=8, c=2, prefix=1, dtype=torch.float32, per_example=False,
          per_head=False, k_len=None, layout="contiguous", with_k=True, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    nk = nq if k_len is None else k_len

    def head_tensor(h, n):
        if layout == "contiguous":
            x = torch.randn(b, h, n, d, generator=g)
        elif layout == "transposed":  # a (B, N, H, d) tensor seen as (B, H, N, d)
            x = torch.randn(b, n, h, d, generator=g).transpose(1, 2)
        elif layout == "qkv":  # one slice of a fused (B, N, 3, H, d) projection: not dense
            x = torch.randn(b, n, 3, h, d, generator=g).permute(2, 0, 3, 1, 4)[1]
        else:
            raise AssertionError(layout)
        return x.to(DEVICE, dtype).requires_grad_()

    q = head_tensor(hq, nq)
    k = head_tensor(hk, nk) if with_k else None
    mq = nq - prefix
    coords = (torch.randn(b, mq, c, generator=g) if per_example else torch.randn(mq, c, generator=g)) * scale
    coords = coords.to(DEVICE).requires_grad_()
    freqs = torch.randn(hq, c, d // 2, generator=g) if per_head else torch.randn(c, d // 2, generator=g)
    freqs = freqs.to(DEVICE).requires_grad_()
    k_coords = None
    if k_len is not None:
        k_coords = (torch.randn(b, nk - prefix, c, generator=g) if per_example
                    else torch.randn(nk - prefix, c, generator=g)) * scale
        k_coords = k_coords.to(DEVICE).requires_grad_()
    return q, k, coords, freqs, k_coords


TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _rel(a: Tensor, b: Tensor) -> float:
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-30))


def _check(prefix=1, pairs="interleaved", dtype=torch.float32, **kw):
    q, k, coords, freqs, k_coords = _make(prefix=prefix, dtype=dtype, **kw)
    out = fused_rotary(q, k, coords, freqs, k_coords=k_coords, num_prefix_tokens=prefix, pairs=pairs)
    qo, ko = out
    assert qo.dtype == dtype and qo.shape == q.shape
    leaves = [t for t in (q, k, coords, freqs, k_coords) if t is not None]
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    it = iter(ref_leaves)
    rq = next(it)
    rk = next(it) if k is not None else None
    rc, rf = next(it), next(it)
    rkc = next(it) if k_coords is not None else None
    eq, ek = reference(rq, rk, rc, rf, rkc, prefix, pairs)

    tol = TOL[dtype]
    assert _rel(qo.detach(), eq.detach()) < tol
    if k is not None:
        assert ko.dtype == dtype and ko.shape == k.shape
        assert _rel(ko.detach(), ek.detach()) < tol
    # prefix tokens pass through bit for bit
    assert torch.equal(qo[:, :, :prefix], q[:, :, :prefix])

    g = torch.Generator().manual_seed(123)
    gq = torch.randn(qo.shape, generator=g).to(DEVICE, dtype)
    outs, ref_outs, grads = [qo], [eq], [gq]
    if k is not None:
        gk = torch.randn(ko.shape, generator=g).to(DEVICE, dtype)
        outs.append(ko), ref_outs.append(ek), grads.append(gk)
    got = torch.autograd.grad(outs, leaves, grads)
    want = torch.autograd.grad(ref_outs, ref_leaves, [x.double() for x in grads])
    names = ["q", "k", "coords", "freqs", "k_coords"] if k is not None else ["q", "coords", "freqs"]
    if k is not None and k_coords is None:
        names = names[:4]
    # angle gradients are sums over many products of rounded values: a looser bound in half precision
    for name, leaf, a, b in zip(names, leaves, got, want):
        assert a.shape == b.shape and a.dtype == leaf.dtype
        # (in the float64 case coords and freqs are float32 leaves: their gradients are rounded to float32)
        bound = tol if name in ("q", "k") else (1e-5 if dtype in (torch.float32, torch.float64) else 3 * tol)
        assert _rel(a, b) < bound, (name, _rel(a, b))
    return qo, ko, q, k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pairs", ["interleaved", "half"])
def test_dtypes_and_pairs(dtype, pairs):
    _check(dtype=dtype, pairs=pairs)


def test_float64_is_computed_in_float64():
    _check(dtype=torch.float64, per_head=True, c=3)


def test_mixed_query_and_key_dtypes():
    """q and k of different dtypes (e.g. keys kept in fp32) in one launch; each output keeps its input's dtype."""
    q, k, coords, freqs, _ = _make(dtype=torch.bfloat16)
    k = k.detach().float().requires_grad_()
    qo, ko = fused_rotary(q, k, coords, freqs, num_prefix_tokens=1)
    assert qo.dtype == torch.bfloat16 and ko.dtype == torch.float32
    eq, ek = reference(q.double(), k.double(), coords.double(), freqs.double(), None, 1, "interleaved")
    assert _rel(qo.detach(), eq.detach()) < TOL[torch.bfloat16] and _rel(ko.detach(), ek.detach()) < 1e-6
    (qo.float().sum() + ko.sum()).backward()
    assert q.grad.dtype == torch.bfloat16 and k.grad.dtype == torch.float32 and freqs.grad is not None


@pytest.mark.parametrize("per_example,per_head", [(True, False), (False, True), (True, True)])
def test_coordinate_and_frequency_sharing(per_example, per_head):
    _check(per_example=per_example, per_head=per_head, c=3)


@pytest.mark.parametrize("prefix", [0, 2])
def test_prefix_tokens(prefix):
    _check(prefix=prefix, pairs="half", per_example=True)


@pytest.mark.parametrize("layout", ["transposed", "qkv"])
def test_strided_inputs(layout):
    qo, ko, q, k = _check(layout=layout, dtype=torch.bfloat16, per_head=True)
    if layout == "transposed":  # a dense permuted view: the output keeps its layout (no copy to contiguous)
        assert qo.stride() == q.stride() and ko.stride() == k.stride()


def test_grouped_keys():
    _check(hq=4, hk=2, per_example=True)
    _check(hq=2, hk=1, pairs="half", dtype=torch.bfloat16)


def test_copies_sharing_angles_in_several_chunks():
    """More (example, head) copies share one angle table than one program rotates (8): several chunks per table,
    the last one partly empty; the angle gradients are summed over all of them."""
    _check(b=3, hq=4, hk=2, nq=5)  # shared coords and freqs: 12 query copies per table, 6 key copies
    _check(b=9, hq=2, hk=2, nq=4, per_head=True, pairs="half", dtype=torch.bfloat16)  # 9 examples per head's table
    _check(b=2, hq=6, hk=3, nq=4, per_example=True, prefix=0)  # 6 heads share each example's table


def test_keys_of_another_length():
    _check(nq=4, k_len=7, per_example=True, c=3)
    _check(nq=5, k_len=3, prefix=0, hq=2, hk=1)


def test_query_only_and_odd_sizes():
    _check(with_k=False, nq=7, d=12, c=1)  # P = 6: a plane block wider than P, masked
    _check(b=1, hq=1, hk=1, nq=70, d=6, prefix=3)  # more tokens than one tile


def test_large_coordinates_fp32_angles():
    """Coordinates in the thousands: angles and their gradients in fp32 stay close to float64."""
    q, k, coords, freqs, _ = _make(scale=1000.0, nq=6, prefix=0)
    qo, ko = fused_rotary(q, k, coords, freqs)
    eq, ek = reference(q.double(), k.double(), coords.double(), freqs.double(), None, 0, "interleaved")
    # the fp32 angle itself is rounded to ~1e-4 rad at |theta| ~ 3000: compare at that resolution
    assert _rel(qo.detach(), eq.detach()) < 1e-3


def test_gradients_only_where_asked():
    q, k, coords, freqs, _ = _make()
    coords.requires_grad_(False)
    freqs.requires_grad_(False)
    qo, ko = fused_rotary(q, k, coords, freqs, num_prefix_tokens=1)
    (qo.square().sum() + ko.sum()).backward()
    assert q.grad is not None and k.grad is not None
    eq, ek = reference(q.detach().double().requires_grad_(), k.detach().double().requires_grad_(), coords.double(),
                       freqs.double(), None, 1, "interleaved")
    assert _rel(qo.detach(), eq.detach()) < 1e-6
    # only q's output used: k's gradient is the rotation of zeros
    q2, k2, coords2, freqs2, _ = _make(seed=3)
    qo2, ko2 = fused_rotary(q2, k2, coords2, freqs2, num_prefix_tokens=1)
    qo2.sum().backward()
    assert torch.count_nonzero(k2.grad) == 0 and freqs2.grad is not None and coords2.grad is not None


def test_available():
    assert available(DEVICE)  # CUDA, or TRITON_INTERPRET=1 on the CPU in this module
    assert not available("meta")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        assert not available("cpu")
        q, k, coords, freqs, _ = _make()
        q, k, coords, freqs = (t.detach().cpu() for t in (q, k, coords, freqs))
        with pytest.raises(ValueError, match="cannot run"):
            fused_rotary(q, k, coords, freqs, num_prefix_tokens=1)
    finally:
        os.environ["TRITON_INTERPRET"] = MODE


@pytest.mark.parametrize("change,match", [
    (dict(pairs="split"), "pairs"),
    (dict(prefix=9), "num_prefix_tokens"),
    (dict(freqs=torch.zeros(2, 3)), "freqs"),
    (dict(freqs=torch.zeros(3, 2, 4)), "heads"),
    (dict(coords=torch.zeros(3, 2)), "tokens"),
    (dict(coords=torch.zeros(4, 3)), "dimensions"),
    (dict(coords=torch.zeros(3, 4, 2)), "batch"),
    (dict(k=torch.zeros(2, 3, 5, 8)), "divide"),
    (dict(k=torch.zeros(2, 2, 6, 8)), "k_coords"),
    (dict(k=torch.zeros(2, 2, 5, 8, dtype=torch.int32)), "k must be float32"),
    (dict(q=torch.zeros(2, 2, 5, 7)), "even"),
    (dict(q=torch.zeros(2, 2, 5, 8, dtype=torch.int64)), "q must be float32"),
])
def test_bad_input(change, match):
    q, k, coords, freqs, _ = _make()
    args = dict(q=q, k=k, coords=coords, freqs=freqs, prefix=1, pairs="interleaved")
    args.update({key: v.to(DEVICE) if isinstance(v, Tensor) else v for key, v in change.items()})
    with pytest.raises(ValueError, match=match):
        fused_rotary(args["q"], args["k"], args["coords"], args["freqs"], num_prefix_tokens=args["prefix"],
                     pairs=args["pairs"])


def test_per_head_freqs_with_grouped_keys_rejected():
    q, k, coords, freqs, _ = _make(hq=4, hk=2, per_head=True)
    with pytest.raises(ValueError, match="shared freqs"):
        fused_rotary(q, k, coords, freqs, num_prefix_tokens=1)


# ----------------------------------------------------------------------------- inside torch.compile
def _recording_backend():
    """A torch.compile backend that records each graph's called ops and runs the graph as it is (no C++ build on
    the CPU); returns ``(backend, graphs)``."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    return backend, graphs


@pytest.mark.parametrize("dtype,per_head,per_example,pairs,layout", [
    (torch.float32, True, False, "interleaved", "qkv"),
    (torch.float32, False, True, "half", "contiguous"),
    (torch.bfloat16, True, True, "interleaved", "transposed"),
])
def test_compiled_keeps_the_kernel_and_matches_the_reference(dtype, per_head, per_example, pairs, layout):
    """Under torch.compile the rotation is one custom operator in one graph (no graph break, no PyTorch fallback),
    and its outputs and the gradients of q, k and freqs match the float64 reference."""
    from ropekit.kernels import compile_supported

    q, k, coords, freqs, _ = _make(dtype=dtype, per_head=per_head, per_example=per_example, layout=layout)
    coords = coords.detach()  # attention's coordinates carry no gradient: the case compile supports
    assert compile_supported(q, k, coords, freqs, None)
    backend, graphs = _recording_backend()

    fn = torch.compile(lambda a, b, w: fused_rotary(a, b, coords, w, num_prefix_tokens=1, pairs=pairs),
                       backend=backend, fullgraph=True)
    qo, ko = fn(q, k, freqs)
    assert len(graphs) == 1 and any("rotary_qk" in op for op in graphs[0])
    assert not any("cos" in op or "sin" in op for op in graphs[0])  # not the PyTorch path
    rq, rk, rf = (t.detach().double().requires_grad_() for t in (q, k, freqs))
    eq, ek = reference(rq, rk, coords.double(), rf, None, 1, pairs)
    tol = TOL[dtype]
    assert qo.dtype == dtype and ko.dtype == dtype
    assert _rel(qo.detach(), eq.detach()) < tol and _rel(ko.detach(), ek.detach()) < tol
    g = torch.Generator().manual_seed(7)
    gq, gk = (torch.randn(t.shape, generator=g).to(DEVICE, dtype) for t in (qo, ko))
    got = torch.autograd.grad([qo, ko], [q, k, freqs], [gq, gk])
    want = torch.autograd.grad([eq, ek], [rq, rk, rf], [gq.double(), gk.double()])
    for a, b, name in zip(got, want, ("q", "k", "freqs")):
        assert _rel(a, b) < (tol if name != "freqs" else max(tol, 1e-5)), name


def test_compiled_attention_path_uses_the_kernel():
    """``apply_frequency_rope`` (what every folded encoding in ``ropekit.nn`` calls) takes the kernel inside
    torch.compile for q and k together, and the PyTorch path for a call the kernel cannot trace (coordinates that
    need a gradient)."""
    from ropekit.encodings.ops.rotation import apply_frequency_rope

    q, k, coords, freqs, _ = _make(per_head=True)
    for c, expect in ((coords.detach(), True), (coords, False)):
        backend, graphs = _recording_backend()

        torch._dynamo.reset()
        fn = torch.compile(lambda a, b, w: apply_frequency_rope(a, b, c, w, num_prefix_tokens=1), backend=backend,
                           fullgraph=True)
        qo, ko = fn(q, k, freqs)
        assert any("rotary_qk" in op for op in graphs[0]) == expect
        want = reference(q.detach().double(), k.detach().double(), c.detach().double(), freqs.detach().double(),
                         None, 1, "interleaved")
        assert _rel(qo.detach(), want[0]) < 2e-6 and _rel(ko.detach(), want[1]) < 2e-6


@pytest.mark.parametrize("name,per_example", [("axial", False), ("mixed", True)])
def test_compiled_rope_module_keeps_the_kernel(name, per_example):
    """``pe(q, k, coords)`` of a RoPE module inside torch.compile (a user's own attention): q and k go through the
    kernel's custom operator, and values and gradients (q, k, frequencies) equal the eager module's."""
    from ropekit import create_pe

    torch.manual_seed(0)
    c = 3 if per_example else 2
    pe = create_pe(name, head_dim=8, coord_dim=c, num_heads=2).to(DEVICE)
    q, k, _, _, _ = _make(d=8)
    coords = torch.randn((2, 4, c) if per_example else (4, c)).to(DEVICE) * 3
    backend, graphs = _recording_backend()

    torch._dynamo.reset()
    fn = torch.compile(lambda a, b: pe(a, b, coords, num_prefix_tokens=1), backend=backend, fullgraph=True)
    qo, ko = fn(q, k)
    assert len(graphs) == 1 and any("rotary_qk" in op for op in graphs[0])
    params = [p for p in pe.parameters() if p.requires_grad]
    got = torch.autograd.grad((qo * qo.detach()).sum() + ko.sum(), [q, k, *params])
    qe, ke = pe(q, k, coords, num_prefix_tokens=1)  # eager: the kernel called directly
    want = torch.autograd.grad((qe * qe.detach()).sum() + ke.sum(), [q, k, *params])
    torch.testing.assert_close(qo, qe, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ko, ke, rtol=1e-6, atol=1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
