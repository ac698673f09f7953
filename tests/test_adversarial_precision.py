"""Every encoding on every execution path stays exact at large coordinates (10^3 and 10^4).

At a coordinate ``r ~ 10^4`` an angle ``r * omega`` rounded to float32 is off by ~1e-3 rad (its ulp), and so is an
angle whose frequency ``omega`` was rounded to float32 after being derived from the parameters (``r * ulp(omega)``).
The reference is the same module with its parameters cast to float64 (``copy.deepcopy(pe).double()``) on float64
copies of the inputs; the comparison is on the logits ``q_i^T k_j`` after encoding, relative to their largest
magnitude: within 1e-6 for float32 inputs (float32 round-off of the rotation itself is ~1e-7 here).

Paths: the module (``pe(q, k, coords)`` and ``prepare`` / ``apply``, with a prefix token), the per-token
``rotate``, the attention layer with training-time folding (``ropekit.nn.Attention(fold=True)``, compared on its
output with ``fold=False`` and with the float64 layer) and the fused Triton kernels (Triton's interpreter on the
CPU). Parameters are moved off their initialisation (a random perturbation), shared by the heads and per head.
"""

from __future__ import annotations

import copy

import pytest
import torch

from ropekit import create_pe, list_pes
from ropekit.encodings.rope import KernelState
from ropekit.nn import Attention

pytestmark = pytest.mark.numerics  # .ci/run repeats these under other summation orders

D, H, C = 16, 2, 2  # head dimension, heads, coordinate dimension
M = 6  # tokens with a coordinate
TOL = 1e-6
#: bf16's unit round-off: round to nearest with an 8-bit significand, ``|fl(x) - x| <= 2^-8 |x|``
BF16_U = 2.0 ** -8

_SIZES = {"liere": {"block_size": 8}, "comrope-ap": {"block_size": 4}, "comrope-ld": {"block_size": 4},
          "circulant": {"block_size": 8}}


def _configs() -> list[tuple[str, dict]]:
    out: list[tuple[str, dict]] = [("none", {}), ("axial", {}), ("axial", {"learnable_freqs": True, "per_head": True})]
    for name in list_pes():
        if name in ("none", "axial"):
            continue
        for per_head in (False, True):
            variants = [{"exact": False}, {"exact": True}] if name == "relaxed" else [{}]
            out += [(name, {**_SIZES.get(name, {}), **v, "per_head": per_head}) for v in variants]
    return out


CONFIGS = _configs()
IDS = [f"{n}-{'head' if o.get('per_head') else 'shared'}" + ("-exact" if o.get("exact") else "") for n, o in CONFIGS]
SCALES = [1e3, 1e4]
KINDS = ["random", "grid"]


def _pe(name: str, opts: dict, head_dim: int = D, num_heads: int = H):
    """The encoding with every learnable parameter moved off its initialisation by a random perturbation."""
    torch.manual_seed(1)
    pe = create_pe(name, head_dim=head_dim, coord_dim=C, num_heads=num_heads, **opts)
    with torch.no_grad():
        for p in pe.parameters():
            p.add_(0.05 * torch.randn_like(p) * (p.abs().mean() + 0.1))
    return pe


def _coords(r: float, kind: str) -> torch.Tensor:
    """``(M, 2)`` float32: uniform in ``[0, r]``, or a 2 x 3 grid offset by ``r``."""
    if kind == "random":
        return torch.rand(M, C, generator=torch.Generator().manual_seed(2)) * r
    ys, xs = torch.meshgrid(torch.arange(2.0), torch.arange(3.0), indexing="ij")
    return torch.stack((ys, xs), dim=-1).reshape(M, C) + r


def _qk(n: int = M, head_dim: int = D, num_heads: int = H, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, num_heads, n, head_dim, generator=g)
    return q.to(dtype), torch.randn(2, num_heads, n, head_dim, generator=g).to(dtype)


def _logits(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return q.double() @ k.double().transpose(-1, -2)  # (B, H, Nq, Nk)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


def _reference_logits(pe, q, k, coords, prefix: int = 0) -> torch.Tensor:
    ref = copy.deepcopy(pe).double()
    with torch.no_grad():
        return _logits(*ref(q.double(), k.double(), coords.double(), num_prefix_tokens=prefix))


def test_every_registered_encoding_is_covered():
    assert {name for name, _ in CONFIGS} == set(list_pes())


@pytest.mark.parametrize("path", ["module", "rotate"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("r", SCALES)
@pytest.mark.parametrize("name,opts", CONFIGS, ids=IDS)
def test_fp32_within_1e6_of_float64(name, opts, r, kind, path):
    """``module``: ``pe(q, k, coords)`` and ``prepare`` / ``apply`` with a prefix token (whose logits see the absolute
    angles); ``rotate``: q and k encoded one at a time."""
    pe = _pe(name, opts)
    coords = _coords(r, kind)
    prefix = 1 if path == "module" else 0
    q, k = _qk(M + prefix)
    want = _reference_logits(pe, q, k, coords, prefix)
    with torch.no_grad():
        if path == "module":
            got = [_logits(*pe(q, k, coords, num_prefix_tokens=1)), _logits(*pe.apply(q, k, pe.prepare(coords, 1)))]
        else:
            got = [_logits(pe.rotate(q, coords), pe.rotate(k, coords))]
    assert max(_rel(g, want) for g in got) <= TOL


@pytest.mark.parametrize("r", SCALES)
@pytest.mark.parametrize("name,opts", CONFIGS, ids=IDS)
def test_folded_attention_fp32_within_1e6_of_float64(name, opts, r):
    """``nn.Attention``'s default (folded) path, its unfolded path and the float64 layer give the same output.

    Two prefix tokens (``T`` of encodings with a post-rotation); inputs scaled so that the logits are O(1) and the
    softmax passes their errors on to the output.
    """
    pe = _pe(name, opts)
    coords = _coords(r, "random")
    torch.manual_seed(4)
    folded = Attention(D * H, H, pe, fold=True)
    unfolded = copy.deepcopy(folded)
    unfolded.fold = False
    reference = copy.deepcopy(unfolded).double()
    x = torch.randn(2, M + 2, D * H, generator=torch.Generator().manual_seed(5)) * 2
    with torch.no_grad():
        want = reference(x.double(), coords.double(), 2)
        got_folded = folded(x, coords, 2)
        got_unfolded = unfolded(x, coords, 2)
    assert _rel(got_unfolded, want) <= TOL
    assert _rel(got_folded, want) <= TOL


@pytest.mark.parametrize("name,opts", CONFIGS, ids=IDS)
def test_bf16_inputs_within_bf16_rounding_at_1e4(name, opts):
    """bf16 q and k at coordinates up to 10^4: every encoded entry is the float64 result rounded to bf16.

    The encoding computes in float32 (~1e-7 relative) and rounds once to bf16, so each entry is within bf16's unit
    round-off ``u = 2^-8`` of the float64 entry (relative), plus 1e-6 of the largest entry for the float32 part
    (an entry near a rounding midpoint, or near zero). An angle off by 1e-4 rad already breaks this bound for the
    entries whose magnitude is small. The logits then follow: ``|dL| <= (2u + u^2) |q| |k|``.
    """
    pe = _pe(name, opts)
    coords = _coords(1e4, "random")
    q, k = _qk(dtype=torch.bfloat16)
    ref = copy.deepcopy(pe).double()
    with torch.no_grad():
        qe, ke = pe(q, k, coords)
        qr, kr = ref(q.double(), k.double(), coords.double())
    assert qe.dtype == torch.bfloat16
    for got, want in ((qe, qr), (ke, kr)):
        err = (got.double() - want).abs()
        assert bool((err <= BF16_U * want.abs() + TOL * want.abs().max()).all()), float(err.max())
    scale = q.double().norm(dim=-1).unsqueeze(-1) * k.double().norm(dim=-1).unsqueeze(-2)  # |q_i| |k_j|
    dl = (_logits(qe, ke) - _logits(qr, kr)).abs()
    assert bool((dl <= (2 * BF16_U + BF16_U ** 2) * scale + TOL * scale.max()).all())


# ----------------------------------------------------------------------------- fused kernels
@pytest.fixture
def kernel_device(monkeypatch):
    """The fused kernels on a CUDA device when there is one, else in Triton's interpreter on the CPU (for this
    test only)."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setenv("TRITON_INTERPRET", "0" if device == "cuda" else "1")
    return device


#: (name, options, head_dim): the rotation kernel with parameter frequencies (mixed), with frequencies derived in
#: float64 (circulant b = 8: its DFT coordinates go through the rotation kernel), and the fused basis kernel
#: (d = 32) with learned (cayley) and derived (circulant b = 16) frequencies
KERNEL_CASES = [("mixed", {"per_head": True}, 16), ("circulant", {"block_size": 8, "per_head": True}, 16),
                ("cayley", {}, 32), ("circulant", {"block_size": 16}, 32)]


@pytest.mark.parametrize("name,opts,d", KERNEL_CASES, ids=[f"{n}-d{d}" for n, _, d in KERNEL_CASES])
def test_kernel_module_path_fp32_within_1e6_of_float64_at_1e4(kernel_device, name, opts, d):
    pe = _pe(name, opts, head_dim=d)
    coords = _coords(1e4, "random")
    q, k = _qk(head_dim=d)
    want = _reference_logits(pe, q, k, coords)
    pe.to(kernel_device)
    with torch.no_grad():
        state = pe.prepare(coords.to(kernel_device))
        got = _logits(*pe(q.to(kernel_device), k.to(kernel_device), coords.to(kernel_device)))
    assert isinstance(state.q if name != "cayley" else state.q[0], KernelState), "the fused kernel did not run"
    assert _rel(got.cpu(), want) <= TOL


def test_kernel_folded_attention_with_derived_frequencies_at_1e4(kernel_device):
    """Circulant's folded form rotates by float64 mode frequencies: the kernel takes them unrounded."""
    pe = _pe("circulant", {"block_size": 8}).to(kernel_device)
    coords = _coords(1e4, "random")
    torch.manual_seed(4)
    folded = Attention(D * H, H, pe, fold=True).to(kernel_device)
    reference = copy.deepcopy(folded).cpu().double()
    reference.fold = False
    x = torch.randn(2, M, D * H, generator=torch.Generator().manual_seed(5)) * 2
    with torch.no_grad():
        got = folded(x.to(kernel_device), coords.to(kernel_device))
        want = reference(x.double(), coords.double())
    assert _rel(got.cpu(), want) <= TOL


def test_kernel_bf16_inputs_within_bf16_rounding_at_1e4(kernel_device):
    """bf16 q and k through the rotation kernel with derived float64 frequencies: each entry within bf16's
    round-off of the float64 entry (see ``test_bf16_inputs_within_bf16_rounding_at_1e4``)."""
    pe = _pe("circulant", {"block_size": 8}).to(kernel_device)
    coords = _coords(1e4, "random")
    q, k = _qk(dtype=torch.bfloat16)
    ref = copy.deepcopy(pe).cpu().double()
    with torch.no_grad():
        qe, _ = pe(q.to(kernel_device), k.to(kernel_device), coords.to(kernel_device))
        qr, _ = ref(q.double(), k.double(), coords.double())
    err = (qe.cpu().double() - qr).abs()
    assert bool((err <= BF16_U * qr.abs() + TOL * qr.abs().max()).all()), float(err.max())


FOLDABLE = [(n, o) for n, o in CONFIGS if n in ("cayley", "circulant", "comrope-ap", "comrope-ld", "string")]


@pytest.mark.parametrize("r", SCALES)
@pytest.mark.parametrize("name,opts", FOLDABLE, ids=[f"{n}-{'head' if o['per_head'] else 'shared'}"
                                                      for n, o in FOLDABLE])
def test_inference_fold_keeps_its_frequencies_exact(name, opts, r):
    """``ropekit.fold.fold`` for inference: ``folded(P q, P k)`` has the float64 logits of ``pe(q, k)`` at
    coordinates of 1e3 / 1e4, also after the folded encoding is moved to float32 (at main its frequencies, derived
    from the parameters, were rounded to float32: 1e-5 to 1e-4 off at 1e4)."""
    from ropekit.encodings.ops.products import basis_change
    from ropekit.fold import fold

    pe = _pe(name, opts)
    coords = _coords(r, "random")
    q, k = _qk(M + 1)
    want = _reference_logits(pe, q, k, coords, 1)
    folded, p = fold(pe)
    folded = folded.float()
    with torch.no_grad():
        got = _logits(*folded(basis_change(q, p), basis_change(k, p), coords, num_prefix_tokens=1))
    assert _rel(got, want) <= TOL
