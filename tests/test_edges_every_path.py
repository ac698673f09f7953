"""Every edge on every execution path, forward and backward: no token, one token, prefix tokens only; boolean and
complex coordinates refused in one line; NaN in ``k_coords`` named as such.

Paths: the module (``pe(q, k, coords)``), the per-token ``rotate``, ``nn.Attention`` unfolded (the encoding applied
per token) and folded (the basis merged into the projection), and the fused kernels (Triton's interpreter on the
CPU). References: the dense float64 ``pe.matrix`` (``R(r)`` from the encoding applied to basis vectors in float64,
checked against ``matrix_exp`` elsewhere), prefix tokens unchanged by every rotation, and the float64 copy of the
attention layer.

At main 32f5e1b, folded ComRoPE with no rotated token crashed in backward (``cannot reshape tensor of 0 elements
into shape [0, -1, 8]``); boolean and complex coordinates went through the folded attention silently; a NaN in
``k_coords`` was reported as "in coords".
"""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch

import ropekit.encodings.ops.rotation as rotation_mod
from ropekit import create_pe, list_pes
from ropekit.encodings import apply_frequency_rope
from ropekit.encodings.ops.rotation import rotate_qk
from ropekit.nn import Attention

D, H, C = 8, 2, 2
_SIZES = {"liere": {"block_size": 4}, "comrope-ap": {"block_size": 4}, "comrope-ld": {"block_size": 4},
          "circulant": {"block_size": 8}}
#: (tokens N, prefix tokens P0): no token, one rotated token, one prefix token only, a prefix token and one rotated
SHAPES = [(0, 0), (1, 0), (1, 1), (2, 1)]
#: float32 round-off of a rotation against float64, relative to the largest entry (test_adversarial_precision)
TOL = 1e-6


def _pe(name: str, seed: int = 0):
    torch.manual_seed(seed)
    pe = create_pe(name, head_dim=D, coord_dim=C, num_heads=H, **_SIZES.get(name, {}))
    with torch.no_grad():
        for p in pe.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return pe


def _dense(pe, x: torch.Tensor, coords: torch.Tensor, p0: int) -> torch.Tensor:
    """``R(r) x`` per token from the float64 ``pe.matrix``; prefix tokens unchanged."""
    body = x[:, :, p0:].double()
    if body.shape[2]:
        r = copy.deepcopy(pe).double().matrix(coords.double())  # (H, M, d, d)
        body = torch.einsum("hmij,bhmj->bhmi", r, body)
    return torch.cat([x[:, :, :p0].double(), body], dim=2)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    got, want = got.detach().double(), want.detach().double()
    if want.numel() == 0:
        return got.shape == want.shape
    return bool((got - want).abs().max() <= TOL * max(float(want.abs().max()), 1.0))


@pytest.mark.parametrize("n,p0", SHAPES)
@pytest.mark.parametrize("per_example", [False, True])
@pytest.mark.parametrize("name", list_pes())
def test_module_and_rotate_at_zero_one_and_prefix_only_tokens(name, per_example, n, p0):
    pe = _pe(name)
    m = n - p0
    coords = torch.randn(*((2,) if per_example else ()), m, C, requires_grad=True)
    q = torch.randn(2, H, n, D, requires_grad=True)
    k = torch.randn(2, H, n, D, requires_grad=True)
    qe, ke = pe(q, k, coords, num_prefix_tokens=p0)
    xr = pe.rotate(q, coords, num_prefix_tokens=p0)
    assert qe.shape == ke.shape == xr.shape == (2, H, n, pe.out_dim)
    if pe.is_rotation:
        per = [coords] if not per_example else list(coords)
        for b, c in enumerate(per):
            rows = slice(None) if not per_example else slice(b, b + 1)
            assert _close(qe[rows], _dense(pe, q[rows], c, p0)) and _close(ke[rows], _dense(pe, k[rows], c, p0))
            assert _close(xr[rows], _dense(pe, q[rows], c, p0))
    (qe.square().sum() + ke.square().sum() + xr.square().sum()).backward()
    for t in [q, k]:
        assert t.grad is not None and t.grad.shape == t.shape and torch.isfinite(t.grad).all()
    if m and name != "none":  # (no rotated token, or the identity: the coordinates need no gradient)
        assert coords.grad is not None and torch.isfinite(coords.grad).all()
    for p in pe.parameters():
        if m:
            assert p.grad is not None and torch.isfinite(p.grad).all()
        else:  # nothing rotated: no gradient (None) or a zero one reaches the parameters
            assert p.grad is None or float(p.grad.abs().sum()) == 0


@pytest.mark.parametrize("n,p0", SHAPES)
@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("name", list_pes())
def test_attention_at_zero_one_and_prefix_only_tokens(name, fold, n, p0):
    """The layer's output equals its float64 copy's (1e-5: float32 products of length 16 and the softmax), and the
    backward reaches every parameter with a finite gradient (at main: folded ComRoPE crashed in backward with no
    rotated token)."""
    torch.manual_seed(0)
    attn = Attention(H * D, H, _pe(name), fold=fold)
    coords = torch.randn(n - p0, C, requires_grad=True)
    x = torch.randn(2, n, H * D, requires_grad=True)
    y = attn(x, coords, num_prefix_tokens=p0)
    assert y.shape == (2, n, H * D)
    want = copy.deepcopy(attn).double()(x.detach().double(), coords.detach().double(), num_prefix_tokens=p0)
    if n:
        assert float((y.detach().double() - want).abs().max() / want.abs().max()) <= 1e-5
    y.square().sum().backward()
    encoding = {id(p) for p in attn.pe.parameters()}
    for t in [x, *attn.parameters()]:
        if n - p0 or id(t) not in encoding:
            assert t.grad is not None and torch.isfinite(t.grad).all()
        else:  # nothing rotated: no gradient (None) or zero; folded, the prefix transform P R(0)^T P^T = I is
            # formed from the parameters, so its gradient is float32 round-off of the projection's
            scale = float(attn.qkv.weight.grad.abs().max())
            assert t.grad is None or float(t.grad.abs().max()) <= 1e-6 * scale
    if n - p0 and name != "none":
        assert coords.grad is not None and torch.isfinite(coords.grad).all()


# ----------------------------------------------------------------------------- kernels (Triton's interpreter)
@pytest.fixture
def interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(rotation_mod, "_WARNED", set(), raising=False)


@pytest.mark.parametrize("n,p0", SHAPES)
def test_kernel_at_zero_one_and_prefix_only_tokens(interpreter, n, p0):
    """``apply_frequency_rope(backend="triton")`` against the PyTorch path in float64, values and every gradient."""
    torch.manual_seed(0)
    coords = torch.randn(n - p0, C, dtype=torch.float64)
    freqs = torch.randn(H, C, D // 2, dtype=torch.float64)
    q = torch.randn(2, H, n, D)
    k = torch.randn(2, H, n, D)
    leaves = [t.clone().requires_grad_() for t in (q, k, coords, freqs)]
    ref = [t.double().detach().requires_grad_() for t in (q, k, coords, freqs)]
    got = apply_frequency_rope(*leaves[:2], leaves[2], leaves[3], num_prefix_tokens=p0, backend="triton")
    want = apply_frequency_rope(*ref[:2], ref[2], ref[3], num_prefix_tokens=p0, backend="torch")
    for g, w in zip(got, want):
        assert _close(g, w)
    sum(o.square().sum() for o in got).backward()
    sum(o.square().sum() for o in want).backward()
    for a, b in zip(leaves, ref):
        assert a.grad is not None and _close(a.grad, b.grad)


@pytest.mark.parametrize("name", ["mixed", "cayley", "circulant"])
@pytest.mark.parametrize("n,p0", SHAPES)
def test_encoding_on_the_kernel_path_at_zero_one_and_prefix_only_tokens(interpreter, name, n, p0):
    pe = _pe(name).set_conventions(backend="triton")
    q = torch.randn(2, H, n, D)
    coords = torch.randn(n - p0, C)
    with torch.no_grad():
        qe, _ = pe(q, q, coords, num_prefix_tokens=p0)
    assert _close(qe, _dense(pe, q, coords, p0))


# ----------------------------------------------------------------------------- refused dtypes
_BAD = {"bool": lambda m: torch.ones(m, C, dtype=torch.bool),
        "complex": lambda m: torch.ones(m, C, dtype=torch.complex64)}


def _entry_points(name: str):
    """``(label, call(coords))`` for every entry point that takes coordinates."""
    pe = _pe(name)
    q = torch.randn(1, H, 3, D)
    freqs = torch.randn(C, D // 2)
    out = [("forward", lambda c: pe(q, q, c)), ("rotate", lambda c: pe.rotate(q, c)),
           ("prepare", lambda c: pe.prepare(c)), ("forward k_coords", lambda c: pe(q, q, c.real.float(),
                                                                                     k_coords=c)),
           ("apply_frequency_rope", lambda c: apply_frequency_rope(q, q, c, freqs)),
           ("rotate_qk", lambda c: rotate_qk(torch.stack((q, q)), c, freqs))]
    for fold in (False, True):
        attn = Attention(H * D, H, pe, fold=fold)
        out.append((f"attention fold={fold}", lambda c, a=attn: a(torch.randn(1, 3, H * D), c)))
    return out


@pytest.mark.parametrize("bad", list(_BAD))
@pytest.mark.parametrize("name", list_pes())
def test_boolean_and_complex_coordinates_refused_in_one_line_everywhere(name, bad):
    coords = _BAD[bad](3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (complex -> real casts warn before the check in the "k_coords" case)
        for label, call in _entry_points(name):
            with pytest.raises(ValueError) as info:
                call(coords)
            msg = str(info.value)
            assert "\n" not in msg and re.search(r"coords must be real numbers, got dtype torch\.(bool|complex64)",
                                                 msg), (label, msg)
            if label == "forward k_coords":
                assert msg.startswith("k_coords"), msg


@pytest.mark.parametrize("bad", list(_BAD))
def test_kernels_refuse_boolean_and_complex_coordinates_in_one_line(interpreter, bad):
    """The fused kernels called directly, with the NaN check off (``validate=False``): the dtype is still checked."""
    from ropekit.kernels import fused_basis_rotary, fused_rotary

    q = torch.randn(1, H, 3, 32)
    coords = _BAD[bad](3)
    calls = [lambda: fused_rotary(q, q, coords, torch.randn(C, 16), validate=False),
             lambda: fused_rotary(q, q, torch.zeros(3, C), torch.randn(C, 16), k_coords=coords, validate=False),
             lambda: fused_basis_rotary(q, torch.eye(32)[None], coords, torch.randn(C, 16), validate=False)]
    for call, name in zip(calls, ("coords", "k_coords", "coords")):
        with pytest.raises(ValueError, match=rf"^{name} must be real numbers, got dtype torch\.(bool|complex64)$"):
            call()


@pytest.mark.parametrize("name", ["mixed", "cayley", "comrope-ld", "liere", "tensor"])
def test_nan_in_k_coords_is_named_k_coords(name):
    pe = _pe(name)
    q, k = torch.randn(1, H, 3, D), torch.randn(1, H, 4, D)
    kc = torch.zeros(4, C)
    kc[1, 0] = float("nan")
    for call in (lambda: pe(q, k, torch.zeros(3, C), k_coords=kc), lambda: pe.prepare(torch.zeros(3, C), k_coords=kc)):
        with pytest.raises(ValueError, match=r"^1 non-finite value \(NaN or infinite\) in k_coords;"):
            call()
    with pytest.raises(ValueError, match=r"^1 non-finite value \(NaN or infinite\) in coords;"):
        pe(q, k, kc[:3], k_coords=torch.zeros(4, C))  # the query coordinates are still "coords"


# A buffer's dtype, not a summation order: kept out of the numerics rerun, whose ATEN_CPU_CAPABILITY=default
# has no bf16 matrix product on this CPU ("pack_vnni2 is only supported when avx512 is supported").
@pytest.mark.parametrize("pe", ["axial", "mixed"])
def test_text_tower_positions_stay_exact_after_a_bf16_cast(pe):
    """The text tower's fixed positions 0..L-1 survive ``.to(torch.bfloat16)`` (at main a float32 buffer, rounded to
    bf16: every position above 256 moved, 511 became 512), and the bf16 tower still runs on them."""
    from ropekit.nn.text import TextConfig, TextTransformer

    torch.manual_seed(0)
    tower = TextTransformer(TextConfig(vocab_size=50, context_length=520, embed_dim=32, depth=1, num_heads=2, pe=pe))
    tower.to(torch.bfloat16)
    assert torch.equal(tower.coords.double().squeeze(-1), torch.arange(520, dtype=torch.float64))
    out = tower(torch.randint(1, 50, (2, 520)))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
