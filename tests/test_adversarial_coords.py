"""Adversarial coordinates on every execution path of every encoding: NaN and infinity (also written in place after
a clean call, where no version counter sees the write), a single token and zero tokens.

Paths: the module (``pe(q, k, coords)``), ``prepare`` + ``apply``, the per-token ``rotate``, ``nn.Attention`` folded
(where it folds) and unfolded, the ViT's ``coord_offset``, ``apply_frequency_rope`` and the fused kernels (Triton's
interpreter on the CPU). Non-finite coordinates must raise a ``ValueError`` naming their count; a few tokens must
equal the float64 dense reference ``expm(sum_k r_k L_k)`` of the generators (with the post-rotation ``P``). The
deferred check that an accelerator uses is exercised on CPU tensors through ``set_coord_validation("deferred")``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ropekit
from ropekit.encodings.ops.rotation import apply_frequency_rope
from ropekit.fold import foldable_kind
from ropekit.nn import Attention, VisionTransformer, vit_config

H, D, C = 2, 8, 2
NAN, INF = float("nan"), float("inf")


def _options(name: str) -> dict:
    return {"block_size": 4} if name in ("liere", "comrope-ap", "comrope-ld") else {}


ENCODINGS = [(n, _options(n)) for n in ropekit.list_pes()] + [("relaxed", {"exact": True})]


def _pe(name: str, opts: dict) -> ropekit.PositionEncoding:
    torch.manual_seed(0)
    pe = ropekit.create_pe(name, head_dim=D, coord_dim=C, num_heads=H, **opts).double()
    with torch.no_grad():  # away from the (often trivial) initialisation
        for p in pe.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return pe


def _paths(name: str, opts: dict) -> list:
    paths = ["module", "prepare", "rotate", "unfold"]
    return paths + (["fold"] if foldable_kind(_pe(name, opts)) is not None else [])


CASES = [pytest.param(n, o, p, id=f"{n}{'-exact' if o.get('exact') else ''}-{p}")
         for n, o in ENCODINGS for p in _paths(n, o)]


def _inputs(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, H, n, D, generator=g, dtype=torch.float64)
    k = torch.randn(2, H, n, D, generator=g, dtype=torch.float64)
    x = torch.randn(2, n, H * D, generator=g, dtype=torch.float64)
    return q, k, x


def _attention(pe, path: str) -> Attention:
    torch.manual_seed(2)
    return Attention(H * D, H, pe, fold=path == "fold").double()


def _call(pe, path: str, coords, p0: int):
    """The path's output: encoded queries ``(B, H, N, d')``, or the attention output ``(B, N, D)``."""
    q, k, x = _inputs(coords.shape[-2] + p0)
    if path == "module":
        return pe(q, k, coords, p0)[0]
    if path == "prepare":
        return pe.apply(q, k, pe.prepare(coords, p0))[0]
    if path == "rotate":
        return pe.rotate(q, coords, p0)
    return _attention(pe, path)(x, coords, p0)


def _bad(value: float) -> torch.Tensor:
    coords = torch.randn(3, C, dtype=torch.float64)
    coords[0, 0] = coords[1, 1] = coords[2, 0] = value
    return coords


@pytest.fixture
def deferred():
    """The accelerator's deferred check, forced on CPU tensors; afterwards the mode and an empty count again."""
    previous = ropekit.encodings.set_coord_validation("deferred")
    yield
    ropekit.encodings.set_coord_validation(previous)
    try:
        ropekit.encodings.check_deferred_coords()
    except ValueError:
        pass


# ----------------------------------------------------------------------------- non-finite coordinates
@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("name,opts,path", CASES)
def test_non_finite_coords_raise_naming_the_count(name, opts, path, value):
    with pytest.raises(ValueError, match=r"3 non-finite values \(NaN or infinite\) in coords"):
        _call(_pe(name, opts), path, _bad(value), 1)


def _write_nan(coords: torch.Tensor, how: str) -> None:
    if how == "data":
        coords.data[1, 0] = NAN
    elif how == "numpy":
        coords.numpy()[1, 0] = NAN  # shares memory; no version counter sees it
    else:
        with torch.no_grad():
            coords[1, 0] = NAN


@pytest.mark.parametrize("how", ["data", "numpy", "no_grad"])
@pytest.mark.parametrize("name,opts,path", CASES)
def test_nan_written_in_place_after_a_clean_call_raises(name, opts, path, how):
    pe = _pe(name, opts)
    coords = torch.randn(3, C, dtype=torch.float64)
    assert torch.isfinite(_call(pe, path, coords, 1)).all()
    _write_nan(coords, how)
    with pytest.raises(ValueError, match=r"1 non-finite value \(NaN or infinite\) in coords"):
        _call(pe, path, coords, 1)


@pytest.mark.parametrize("fold", [True, False], ids=["fold", "unfold"])
@pytest.mark.parametrize("value", [NAN, INF], ids=["nan", "inf"])
@pytest.mark.parametrize("name", [n for n in ropekit.list_pes() if n != "none"])  # "none": no coordinates at all
def test_vit_coord_offset_non_finite_raises(name, value, fold):
    cfg = vit_config("tiny", num_classes=3, in_chans=1, image_size=(8, 8), patch_size=4, depth=1, embed_dim=H * D,
                     num_heads=H, pe=name, pe_options=_options(name), pe_fold_train=fold)
    torch.manual_seed(0)
    model = VisionTransformer(cfg)
    images = torch.rand(2, 1, 8, 8)
    assert torch.isfinite(model(images, coord_offset=torch.zeros(2, C))).all()
    offset = torch.tensor([[0.5, value], [1.0, 2.0]])
    with pytest.raises(ValueError, match=r"1 non-finite value \(NaN or infinite\) in coord_offset"):
        model(images, coord_offset=offset)


def test_apply_frequency_rope_non_finite_coords_and_key_coords():
    q, k, _ = _inputs(4)
    freqs = torch.randn(C, D // 2, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"3 non-finite values \(NaN or infinite\) in coords"):
        apply_frequency_rope(q, k, _bad(NAN), freqs, num_prefix_tokens=1)
    with pytest.raises(ValueError, match=r"3 non-finite values \(NaN or infinite\) in k_coords"):
        apply_frequency_rope(q, k, torch.randn(3, C, dtype=torch.float64), freqs, k_coords=_bad(-INF),
                             num_prefix_tokens=1)
    coords = torch.randn(2, 3, C, dtype=torch.float64)  # per example, written through NumPy after a clean call
    apply_frequency_rope(q, k, coords, freqs, num_prefix_tokens=1)
    coords.numpy()[1, 2, 1] = INF
    with pytest.raises(ValueError, match=r"1 non-finite value \(NaN or infinite\) in coords"):
        apply_frequency_rope(q, k, coords, freqs, num_prefix_tokens=1)


# ----------------------------------------------------------------------------- a single token, zero tokens
def _dense(pe, coords: torch.Tensor) -> torch.Tensor:
    """``R(r)`` ``(H, M, d, d)`` in float64: ``expm(sum_k r_k L_k)``, times ``P`` on the encoding's side."""
    gen = pe.generators().detach().double()  # (H, c, d, d)
    rot = torch.linalg.matrix_exp(torch.einsum("mc,hcij->hmij", coords, gen).contiguous())
    p = pe.post_rotation_matrix()
    if p is None:
        return rot
    p = p.detach().double()[:, None]  # (H, 1, d, d)
    return p @ rot if pe.name == "cayley" else rot @ p  # Cayley: P R_STR(r); relaxed STRING: R_STR(r) P


def _encode_ref(pe, x: torch.Tensor, coords: torch.Tensor, p0: int) -> torch.Tensor:
    """The reference encoding of ``x`` ``(B, H, N, d)``: the dense rotation, prefix tokens unchanged. The
    tensor-product encoding (no rotation) is checked against the same tokens encoded among two more."""
    if not pe.is_rotation:
        extra = torch.randn(x.shape[0], H, 2, D, dtype=x.dtype)
        out = pe.rotate(torch.cat([x, extra], 2), torch.cat([coords, torch.randn(2, C, dtype=x.dtype)]), p0)
        return out[:, :, : x.shape[2]]
    body = torch.einsum("hmij,bhmj->bhmi", _dense(pe, coords), x[:, :, p0:])
    return torch.cat([x[:, :, :p0], body], 2)


def _reference(pe, path: str, coords: torch.Tensor, p0: int) -> torch.Tensor:
    q, k, x = _inputs(coords.shape[-2] + p0)
    if path in ("module", "prepare", "rotate"):
        return _encode_ref(pe, q, coords, p0)
    att = _attention(pe, path)
    b, n, _ = x.shape
    qkv = F.linear(x, att.qkv.weight, att.qkv.bias).view(b, n, 3, H, D).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)  # (B, H, N, d)
    q, k = _encode_ref(pe, q, coords, p0), _encode_ref(pe, k, coords, p0)
    weights = torch.softmax(q @ k.transpose(-1, -2) * D ** -0.5, dim=-1)  # (B, H, N, N)
    return att.proj((weights @ v).transpose(1, 2).reshape(b, n, H * D))


@pytest.mark.parametrize("m,p0", [(1, 0), (1, 2), (0, 0), (0, 2)], ids=["1tok", "1tok-prefix", "0tok", "0tok-prefix"])
@pytest.mark.parametrize("name,opts,path", CASES)
def test_one_and_zero_tokens_match_the_dense_reference(name, opts, path, m, p0):
    pe = _pe(name, opts)
    coords = torch.randn(m, C, dtype=torch.float64) * 3
    got = _call(pe, path, coords, p0)
    want = _reference(pe, path, coords, p0)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("m,p0", [(1, 0), (1, 2), (0, 0), (0, 2)], ids=["1tok", "1tok-prefix", "0tok", "0tok-prefix"])
def test_apply_frequency_rope_one_and_zero_tokens(m, p0):
    q, k, _ = _inputs(m + p0)
    coords, freqs = torch.randn(m, C, dtype=torch.float64) * 3, torch.randn(C, D // 2, dtype=torch.float64)
    got, _ = apply_frequency_rope(q, k, coords, freqs, num_prefix_tokens=p0)
    theta = coords @ freqs  # (M, d/2), closed form of interleaved RoPE
    x0, x1 = q[:, :, p0:, 0::2], q[:, :, p0:, 1::2]
    body = torch.stack([x0 * theta.cos() - x1 * theta.sin(), x0 * theta.sin() + x1 * theta.cos()], -1).flatten(-2)
    torch.testing.assert_close(got, torch.cat([q[:, :, :p0], body], 2), rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------- the deferred check (accelerators)
def test_auto_mode_defers_on_accelerators_and_inside_compile():
    from ropekit.encodings.ops.validation import _resolve

    assert _resolve("auto", "cpu", False) == "eager"
    assert _resolve("auto", "cuda", False) == "deferred"
    assert _resolve("auto", "cpu", True) == "deferred"
    assert _resolve("eager", "cuda", False) == "eager"
    assert _resolve("off", "cuda", True) == "off"
    with pytest.raises(ValueError, match="one of auto, eager, deferred, off"):
        ropekit.encodings.set_coord_validation("lazy")


def test_deferred_check_reads_nothing_on_the_host(deferred, monkeypatch):
    from ropekit.encodings.ops.validation import check_finite

    def refuse(*_):
        raise AssertionError("host read of a device value")

    coords = _bad(NAN)
    check_finite(coords)  # the counter exists: no allocation below either
    for attr in ("__bool__", "__int__", "__float__", "item", "tolist"):
        monkeypatch.setattr(torch.Tensor, attr, refuse)
    check_finite(coords)
    check_finite(coords, "k_coords")
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"^9 non-finite values \(NaN or infinite\) in coords since the last check"):
        ropekit.encodings.check_deferred_coords()
    ropekit.encodings.check_deferred_coords()  # reset: nothing left


@pytest.mark.parametrize("name,opts,path", CASES)
def test_deferred_check_reports_every_path_once(deferred, name, opts, path):
    """The count is raised by ``check_deferred_coords`` (or by the path itself, where a CPU eigendecomposition
    fails on the NaN first) -- exactly 3: each path checks its coordinates once."""
    pe = _pe(name, opts)
    with pytest.raises(ValueError, match=r"^3 non-finite values \(NaN or infinite\) in coords since the last check"):
        _call(pe, path, _bad(NAN), 1)
        ropekit.encodings.check_deferred_coords()


def test_off_mode_skips_the_check():
    previous = ropekit.encodings.set_coord_validation("off")
    try:
        out = _call(_pe("mixed", {}), "fold", _bad(NAN), 1)
    finally:
        ropekit.encodings.set_coord_validation(previous)
    assert out.isnan().any()


def test_compiled_module_counts_without_a_graph_break(deferred):
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    pe = _pe("cayley", {}).float()
    counter = CompileCounter()
    compiled = torch.compile(pe, backend=counter, fullgraph=True)
    q = torch.randn(1, H, 4, D)
    for value in (0.0, NAN):
        coords = torch.randn(3, C)
        coords[0, 1] = value
        compiled(q, q, coords, 1)
    assert counter.frame_count == 1
    with pytest.raises(ValueError, match=r"^1 non-finite value \(NaN or infinite\) in coords since the last check"):
        ropekit.encodings.check_deferred_coords()
    torch._dynamo.reset()


def test_engine_raises_the_deferred_count_at_the_step_before_the_update(deferred):
    from ropekit.train.engine import EngineOptions, FitOptions, Schedule, fit

    class Task:
        name = "coords"

        def __init__(self):
            torch.manual_seed(0)
            self.model = Attention(H * D, H, ropekit.create_pe("mixed", head_dim=D, coord_dim=C, num_heads=H))

        def epoch_batches(self, epoch, ctx):
            return [0, 1, 2]

        def loss(self, model, batch, device):
            coords = torch.randn(3, C)
            if batch == 1:
                coords[0] = NAN
            return model(torch.randn(2, 3, H * D), coords).square().mean(), {}

        def epoch_row(self, epoch, sums, info, ctx):
            return {"epoch": epoch + 1}

    task = Task()
    with pytest.raises(ValueError, match=r"^2 non-finite values .* in coords .*\(at step 2 \(epoch 1, batch 2\): "
                                         r"stopped before the update\)"):
        fit(task, FitOptions(Schedule(lr=1e-2, total_steps=3), 1,
                             execution=EngineOptions(device="cpu", progress=False, tensorboard=False, plots=False),
                             quiet=True, log_every=1))
    assert all(torch.isfinite(p).all() for p in task.model.parameters())
    # read once per log interval (here: at the end of the epoch), naming the steps it covers
    with pytest.raises(ValueError, match=r"^2 non-finite values .* in coords .*\(in steps 1-3, found after step 3 "
                                         r"\(epoch 1\): stopped at the end of the epoch\)"):
        fit(Task(), FitOptions(Schedule(lr=1e-2, total_steps=3), 1,
                               execution=EngineOptions(device="cpu", progress=False, tensorboard=False, plots=False),
                               quiet=True))


# ----------------------------------------------------------------------------- the fused kernels (interpreter on CPU)
@pytest.fixture
def kernels(triton_mode):
    pytest.importorskip("triton")
    from ropekit import kernels

    return kernels


def test_kernel_non_finite_and_in_place_coords_raise(kernels, triton_mode):
    q = torch.randn(1, H, 4, D, device=triton_mode)
    freqs = torch.randn(C, D // 2, device=triton_mode)
    with pytest.raises(ValueError, match=r"3 non-finite values \(NaN or infinite\) in coords"):
        kernels.fused_rotary(q, q, _bad(INF).float().to(triton_mode), freqs, num_prefix_tokens=1)
    with pytest.raises(ValueError, match=r"3 non-finite values \(NaN or infinite\) in k_coords"):
        kernels.fused_rotary(q, q, torch.randn(3, C, device=triton_mode), freqs,
                             k_coords=_bad(NAN).float().to(triton_mode), num_prefix_tokens=1)
    coords = torch.randn(3, C, device=triton_mode)
    kernels.fused_rotary(q, q, coords, freqs, num_prefix_tokens=1)
    coords.data[2, 1] = NAN
    with pytest.raises(ValueError, match=r"1 non-finite value \(NaN or infinite\) in coords"):
        kernels.fused_rotary(q, q, coords, freqs, num_prefix_tokens=1)
    x = torch.randn(1, 1, 4, 32, device=triton_mode)
    basis = torch.linalg.qr(torch.randn(32, 32))[0][None].to(triton_mode)
    with pytest.raises(ValueError, match=r"1 non-finite value \(NaN or infinite\) in coords"):
        kernels.fused_basis_rotary(x, basis, coords, torch.randn(C, 16, device=triton_mode), num_prefix_tokens=1)


def test_kernel_module_path_counts_once(kernels, triton_mode, deferred):
    """The module path checks the coordinates and hands them to the kernel unchecked: one count, not two."""
    pe = ropekit.create_pe("mixed", head_dim=D, coord_dim=C, num_heads=H).to(triton_mode)
    q = torch.randn(1, H, 4, D, device=triton_mode)
    pe(q, q, _bad(NAN).float().to(triton_mode), 1)
    with pytest.raises(ValueError, match=r"^3 non-finite values \(NaN or infinite\) in coords since the last check"):
        ropekit.encodings.check_deferred_coords()


@pytest.mark.parametrize("m,p0", [(1, 1), (0, 0), (0, 2)], ids=["1tok-prefix", "0tok", "0tok-prefix"])
def test_kernel_one_and_zero_tokens(kernels, triton_mode, m, p0):
    q = torch.randn(2, H, m + p0, D, device=triton_mode)
    coords, freqs = torch.randn(m, C, device=triton_mode), torch.randn(H, C, D // 2, device=triton_mode)
    got, _ = kernels.fused_rotary(q, q, coords, freqs, num_prefix_tokens=p0)
    theta = torch.einsum("mc,hcp->hmp", coords.double(), freqs.double())  # (H, M, d/2)
    x0, x1 = q.double()[:, :, p0:, 0::2], q.double()[:, :, p0:, 1::2]
    body = torch.stack([x0 * theta.cos() - x1 * theta.sin(), x0 * theta.sin() + x1 * theta.cos()], -1).flatten(-2)
    torch.testing.assert_close(got.double(), torch.cat([q.double()[:, :, :p0], body], 2), rtol=0, atol=1e-5)
