"""No precision lost to a cast: fixed tables, coordinates and the parameter dtype policy, on every encoding.

Three kinds of cast used to round what they should not:

* a model cast (``.to(torch.bfloat16)``, ``.half()``) rewrote axial RoPE's fixed frequency table and Circulant's DFT
  bases in the low precision (0.93 relative error at coordinate 1e4 for axial at main 32f5e1b). Fixed tables are now
  exact whatever the module's dtype;
* coordinates were rounded to the compute dtype (float32) before the float64 angles were formed, on ``pe(...)``,
  ``rotate``, ``prepare(dtype=float32)`` and the unfolded ``nn.Attention``: int64 coordinates at ``2^24 + 1`` gave
  0.5-1.5 relative error, float64 ones near ``1e5`` up to 2e-2 (LieRE). They now keep their own precision;
* learnable parameters follow a model cast unless the encoding keeps them in float32 (``keep_fp32``).

The dtype matrix states what each cast does, against a float64 reference, per encoding: every encoding computes in
float32 (float64 angles) whatever the dtype of its parameters and tokens, so (a) with parameters cast to bf16 / fp16
the result is that of the *rounded* parameters, exact up to the output's rounding; (b) with ``keep_fp32`` it is that
of the original parameters, up to the output's rounding; (c) under bf16 autocast the encoding runs in float32 as
without it; (d) bf16 tokens with float32 parameters are rounded once, at the end. The bound on every entry is the
output's rounding ``u |ref|`` (``u = 2^-8`` for bf16, ``2^-11`` for float16, round to nearest) plus float32
round-off of the rotation itself, ``1e-6`` of the largest entry (see ``test_adversarial_precision``). What rounding
the parameters themselves costs is the table in docs/execution-paths.md (``tools/precision_table.py``).
"""

from __future__ import annotations

import copy

import pytest
import torch

from ropekit import create_pe, list_pes
from ropekit.encodings import keep_encodings_fp32
from ropekit.encodings.rope import KernelState
from ropekit.nn import Attention

pytestmark = pytest.mark.numerics

D, H, C = 16, 2, 2  # head dimension, heads, coordinate dimension
M = 5  # tokens with a coordinate
#: float32 round-off of the rotation, relative to the largest entry (float64 angles, float32 cos/sin and products)
TOL = 1e-6
#: unit round-off of the low-precision dtypes (round to nearest: 8 and 11 significand bits)
U = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 0.0}
_SIZES = {"liere": {"block_size": 8}, "comrope-ap": {"block_size": 4}, "comrope-ld": {"block_size": 4},
          "circulant": {"block_size": 8}}


def _configs() -> list[tuple[str, dict]]:
    out: list[tuple[str, dict]] = [("axial", {"learnable_freqs": True})]
    for name in list_pes():
        out.append((name, dict(_SIZES.get(name, {}))))
    return out


CONFIGS = _configs()
IDS = [name + ("-learnable" if opts.get("learnable_freqs") else "") for name, opts in CONFIGS]


def _pe(name: str, opts: dict, seed: int = 0):
    """The encoding with its parameters moved off their initialisation (a random perturbation)."""
    torch.manual_seed(seed)
    pe = create_pe(name, head_dim=D, coord_dim=C, num_heads=H, **opts)
    with torch.no_grad():
        for p in pe.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return pe


def _qk(dtype=torch.float32, seed: int = 1, prefix: int = 1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, H, M + prefix, D, generator=g, dtype=torch.float64)
    k = torch.randn(2, H, M + prefix, D, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype)


def _coords(scale: float, seed: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(M, C, generator=g, dtype=torch.float64) * 2 - 1) * scale


def _reference(pe, q, k, coords, prefix: int = 1):
    """The encoded q and k of the module's float64 copy on float64 copies of the inputs."""
    ref = copy.deepcopy(pe).double()
    return ref(q.double(), k.double(), coords.double(), num_prefix_tokens=prefix)


def _within(got: torch.Tensor, want: torch.Tensor, u: float) -> float:
    """The largest ratio of an entry's error to its bound ``u |want| + TOL max|want|`` (<= 1: within)."""
    got, want = got.detach().double(), want.detach().double()
    bound = u * want.abs() + TOL * want.abs().max()
    return float(((got - want).abs() / bound).max())


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


def test_every_registered_encoding_is_covered():
    assert {name for name, _ in CONFIGS} == set(list_pes())


# ----------------------------------------------------------------------------- fixed tables
@pytest.mark.parametrize("cast", ["bfloat16", "half", "float16"])
def test_axial_fixed_table_is_exact_after_a_low_precision_cast(cast):
    """The fixed table equals the closed form ``base ** (-2n / d_k)`` in float64 after the cast, and the rotation at
    coordinate 1e4 is the float64 rotation (at main: the table rounded to bf16, 0.93 relative error)."""
    pe = create_pe("axial", head_dim=D, coord_dim=C, num_heads=H)
    low = pe.to(torch.bfloat16) if cast == "bfloat16" else pe.half() if cast == "half" else pe.to(torch.float16)
    per_axis = D // 2 // C
    omega = 10000.0 ** (-2.0 * torch.arange(per_axis, dtype=torch.float64) / (2 * per_axis))
    want = torch.zeros(C, D // 2, dtype=torch.float64)
    for axis in range(C):
        want[axis, axis * per_axis:(axis + 1) * per_axis] = omega
    torch.testing.assert_close(low.freqs[0], want, rtol=1e-15, atol=0)
    assert low.param_dtype() == (torch.bfloat16 if cast == "bfloat16" else torch.float16)  # the module's dtype
    q, k = _qk()
    coords = _coords(1e4)
    # closed-form reference: pair n of the interleaved q turns by r . freqs[:, n], in float64
    theta = coords @ want  # (M, d/2)
    x = q[:, :, 1:].double().unflatten(-1, (-1, 2))
    rot = torch.stack((x[..., 0] * theta.cos() - x[..., 1] * theta.sin(),
                       x[..., 0] * theta.sin() + x[..., 1] * theta.cos()), -1).flatten(-2)
    got = low(q, k, coords, num_prefix_tokens=1)[0][:, :, 1:]
    assert _within(got, rot, 0.0) <= 1.0


def test_axial_table_cast_behind_the_module_is_recomputed():
    """A cast that bypasses ``_apply`` (FSDP writes its buffers directly) is not used: ``freqs`` recomputes the
    float64 table."""
    pe = create_pe("axial", head_dim=D, coord_dim=C)
    exact = pe.freqs.clone()
    pe.freq_table = pe.freq_table.to(torch.bfloat16)
    assert pe.freqs.dtype == torch.float64 and torch.equal(pe.freqs, exact)


@pytest.mark.parametrize("cast", [torch.bfloat16, torch.float16])
def test_circulant_bases_never_rounded_below_float32(cast):
    """After ``.to(bf16 | fp16)`` the DFT bases stay float32 (float64 for a float64 module): the rotation equals the
    float64 one of the same (rounded) parameters at coordinate 1e2 (at main: the basis in bf16, 1.5e-4)."""
    pe = _pe("circulant", {"block_size": 8}).to(cast)
    assert pe.dft_basis.dtype == torch.float32 and pe.dft_blockdiag.dtype == torch.float32
    assert pe.mode_table.dtype == torch.float64
    q, k = _qk()
    coords = _coords(1e2)
    got = pe(q, k, coords, num_prefix_tokens=1)
    want = _reference(pe, q, k, coords)
    assert max(_within(g, w, 0.0) for g, w in zip(got, want)) <= 1.0
    assert pe.double().dft_basis.dtype == torch.float64


# ----------------------------------------------------------------------------- coordinates
_COORD_CASES = {
    # int64 at 2^24 + j: float32 holds every integer only up to 2^24
    "int64-2^24": lambda: (2 ** 24 + torch.arange(M * C).view(M, C) * 3 + 1).to(torch.int64),
    # int64 near 2^40: exact in float64 (up to 2^53), 2^16 ulps of float32
    "int64-2^40": lambda: (2 ** 40 + torch.arange(M * C).view(M, C) * 7 + 1).to(torch.int64),
    # float64 near 1e5 with a fractional part float32 cannot hold (its ulp there is 2^-7)
    "float64-1e5": lambda: 1e5 + _coords(1.0, seed=5),
}


def _entry(pe, entry: str, q, k, coords):
    """The encoded q (and k) through one entry point; float32 tokens."""
    if entry == "forward":
        return pe(q, k, coords, num_prefix_tokens=1)
    if entry == "rotate":
        return (pe.rotate(q, coords, num_prefix_tokens=1),)
    if entry == "prepare-float32":
        return pe.apply(q, k, pe.prepare(coords, 1, dtype=torch.float32))
    raise AssertionError(entry)


@pytest.mark.parametrize("case", list(_COORD_CASES))
@pytest.mark.parametrize("entry", ["forward", "rotate", "prepare-float32"])
@pytest.mark.parametrize("name,opts", CONFIGS, ids=IDS)
def test_coordinates_keep_their_precision_on_every_entry_point(name, opts, entry, case):
    """Integer coordinates (exact in float64 up to 2^53) and float64 ones reach the float64 angle unrounded: the
    float32 result equals the float64 module's on the same coordinates to float32 round-off (at main: 0.17-1.5 at
    2^24 + 1, 6e-4 to 2.4e-2 near 1e5)."""
    pe = _pe(name, opts)
    coords = _COORD_CASES[case]()
    q, k = _qk()
    got = _entry(pe, entry, q, k, coords)
    want = _reference(pe, q, k, coords)
    assert max(_within(g, w, 0.0) for g, w in zip(got, want)) <= 1.0


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("case", ["int64-2^24", "float64-1e5"])
@pytest.mark.parametrize("name,opts", CONFIGS, ids=IDS)
def test_attention_keeps_coordinates_exact_folded_or_not(name, opts, case, fold):
    """``nn.Attention`` on float32 tokens with int64 / float64 coordinates equals its float64 copy. Bound: the
    layer's float32 products (length 32) and softmax, ``~ 32 u`` per product chained three times; 1e-5 relative
    (at main the unfolded layer rounded the coordinates: O(1) at 2^24 + 1)."""
    torch.manual_seed(0)
    attn = Attention(H * D, H, _pe(name, opts), fold=fold)
    coords = _COORD_CASES[case]()
    x = torch.randn(2, M + 1, H * D)
    got = attn(x, coords, num_prefix_tokens=1)
    want = copy.deepcopy(attn).double()(x.double(), coords.double() if coords.is_floating_point() else coords,
                                        num_prefix_tokens=1)
    assert _rel(got, want) <= 1e-5


@pytest.fixture
def kernel_device(monkeypatch):
    """The fused kernels on a CUDA device when there is one, else in Triton's interpreter on the CPU."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setenv("TRITON_INTERPRET", "0" if device == "cuda" else "1")
    return device


@pytest.mark.parametrize("name,opts", [("mixed", {}), ("cayley", {}), ("circulant", {"block_size": 8})])
def test_kernel_path_keeps_integer_coordinates_exact(kernel_device, name, opts):
    """The module path handing coordinates to the fused kernel (which forms fp64 angles) no longer rounds them to
    float32 first (at main: O(1) at 2^24 + 1)."""
    pe = _pe(name, opts)
    coords = _COORD_CASES["int64-2^24"]()
    q, k = _qk()
    want = _reference(pe, q, k, coords)
    pe.to(kernel_device)
    with torch.no_grad():
        state = pe.prepare(coords.to(kernel_device))
        got = pe(q.to(kernel_device), k.to(kernel_device), coords.to(kernel_device), num_prefix_tokens=1)
    assert isinstance(state.q if name != "cayley" else state.q[0], KernelState), "the fused kernel did not run"
    assert max(_within(g.cpu(), w, 0.0) for g, w in zip(got, want)) <= 1.0


# ----------------------------------------------------------------------------- parameter dtype policy
@pytest.mark.parametrize("name,opts", CONFIGS, ids=IDS)
def test_keep_fp32_leaves_encoding_tensors_in_float32_through_model_casts(name, opts):
    pe = _pe(name, opts)
    before = {n: p.detach().clone() for n, p in pe.named_parameters()}
    model = torch.nn.ModuleDict({"proj": torch.nn.Linear(4, 4), "pe": pe})
    assert keep_encodings_fp32(model) is model and pe.keeps_fp32
    model.to(torch.bfloat16)
    assert model["proj"].weight.dtype == torch.bfloat16
    for n, p in pe.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, before[n]), n  # not rounded on the way
    assert all(b.dtype != torch.bfloat16 for b in pe.buffers() if b.is_floating_point())
    model.half()
    assert all(p.dtype == torch.float32 for p in pe.parameters())
    model.double()  # a widening cast acts as usual
    assert all(p.dtype == torch.float64 for p in pe.parameters())
    model.to(torch.bfloat16)  # float64 asked to become bf16: float32
    assert all(p.dtype == torch.float32 for p in pe.parameters())
    pe.keep_fp32(False)
    model.to(torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in pe.parameters())
    pe.keep_fp32()  # enabling it widens what is low now
    assert all(p.dtype == torch.float32 for p in pe.parameters())


def test_keep_fp32_model_trains_in_bf16_with_float32_encoding_gradients():
    """A bf16 attention layer whose encoding is kept in float32: forward and backward run, the encoding's
    gradients are float32, the folded and unfolded layers agree to bf16 rounding."""
    torch.manual_seed(0)
    pe = _pe("cayley", {})
    a = keep_encodings_fp32(Attention(H * D, H, pe, fold=True)).to(torch.bfloat16)
    b = copy.deepcopy(a)
    b.fold = False
    x = torch.randn(2, M + 1, H * D, dtype=torch.bfloat16)
    coords = _coords(1e2).float()
    ya, yb = a(x, coords, num_prefix_tokens=1), b(x, coords, num_prefix_tokens=1)
    assert ya.dtype == torch.bfloat16
    assert _rel(ya, yb) <= 8 * 2.0 ** -8
    ya.float().square().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all()
               for p in pe.parameters())


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("name,opts", CONFIGS, ids=IDS)
def test_attention_runs_after_a_bf16_model_cast(name, opts, fold, keep):
    """``model.to(torch.bfloat16)`` with or without ``keep_fp32``: forward and backward run on every encoding,
    folded or not, and the encoding's bases are never formed in bf16 (at main the folded Cayley layer failed: no
    bf16 LU solve on the CPU). The folded and unfolded layers agree to bf16 rounding of the activations."""
    torch.manual_seed(0)
    attn = Attention(H * D, H, _pe(name, opts), fold=fold)
    if keep:
        keep_encodings_fp32(attn)
    attn.to(torch.bfloat16)
    x = torch.randn(2, M + 1, H * D, dtype=torch.bfloat16, requires_grad=True)
    y = attn(x, _coords(1e2).float(), num_prefix_tokens=1)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    y.float().square().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in attn.parameters())


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("name", list_pes())
def test_vision_transformer_in_bf16_with_or_without_fp32_encodings(name, keep):
    """A whole ViT cast to bf16 (its layers' encoding states prepared once per forward, folded by default) trains:
    finite bf16 output, finite gradients, and with ``keep_encodings_fp32`` float32 encoding parameters (at main the
    folded Cayley layers failed in bf16: no bf16 LU solve on the CPU)."""
    from ropekit.nn import VisionTransformer, vit_config

    torch.manual_seed(0)
    model = VisionTransformer(vit_config(pe=name, image_size=(16, 16), patch_size=4, in_chans=1, embed_dim=32,
                                         depth=2, num_heads=2, num_classes=3))
    encodings = [m for m in model.modules() if hasattr(m, "keeps_fp32")]
    if keep:
        keep_encodings_fp32(model)
    model.to(torch.bfloat16)
    y = model(torch.randn(2, 1, 16, 16, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    y.float().square().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
    want = torch.float32 if keep else torch.bfloat16
    assert all(p.dtype == want for pe in encodings for p in pe.parameters())


# ----------------------------------------------------------------------------- the dtype matrix
MODES = ["to-bf16", "half", "to-bf16-keep-fp32", "half-keep-fp32", "autocast-bf16", "bf16-tokens"]


@pytest.mark.parametrize("r", [1e2, 1e4])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name,opts", CONFIGS, ids=IDS)
def test_dtype_matrix_within_documented_bounds(name, opts, mode, r):
    """Every encoding x every cast, at coordinates up to ``r``, against a float64 reference (module docstring):
    cast parameters -- exact for the parameters held, to the output's rounding; ``keep_fp32`` and bf16 tokens --
    exact for the original parameters, to the output's rounding; autocast -- float32 round-off."""
    pe = _pe(name, opts)
    coords = _coords(r).float()
    low = torch.float16 if mode.startswith("half") else torch.bfloat16
    if mode.endswith("keep-fp32"):
        pe.keep_fp32()
    if mode.startswith("to-bf16"):
        pe.to(torch.bfloat16)
    elif mode.startswith("half"):
        pe.half()
    token_dtype = torch.float32 if mode == "autocast-bf16" else low
    q, k = _qk(token_dtype)
    if mode == "autocast-bf16":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = pe(q, k, coords, num_prefix_tokens=1)
    else:
        got = pe(q, k, coords, num_prefix_tokens=1)
    assert all(g.dtype == token_dtype for g in got)
    want = _reference(pe, q, k, coords)  # the parameters the module holds now (cast or kept), in float64
    assert max(_within(g, w, U[token_dtype]) for g, w in zip(got, want)) <= 1.0
    if mode.endswith("keep-fp32") or mode in ("autocast-bf16", "bf16-tokens"):  # ... which are the original ones
        assert all(p.dtype == torch.float32 for p in pe.parameters())
