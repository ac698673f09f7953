"""Every execution path chosen explicitly and exact: backends, no silent fallbacks, saved configuration keys, and
second derivatives through the fused kernels.

The kernels run in Triton's interpreter on the CPU (``TRITON_INTERPRET=1`` set per test), on tiny sizes. References
are independent of the path under test: the dense float64 ``matrix_exp`` of an encoding's generators
(``pe.matrix``), closed forms, ``torch.autograd.gradgradcheck`` in float64, or the PyTorch path in float64.
"""

from __future__ import annotations

import copy
import sys
import warnings

import pytest
import torch

import ropekit
import ropekit.encodings.ops.rotation as fn
from ropekit.encodings import apply_frequency_rope, create_pe
from ropekit.nn import Attention, VisionTransformer, ViTConfig, vit_config

pytest.importorskip("triton")

from ropekit.kernels import basis as basis_mod  # noqa: E402
from ropekit.kernels import fused_rotary  # noqa: E402
from ropekit.kernels import rotary as rotary_mod  # noqa: E402

pytestmark = pytest.mark.numerics  # .ci/run repeats these under other summation orders


@pytest.fixture
def interpreter(monkeypatch):
    """Triton's interpreter on for this test (the kernels run on CPU tensors), and a fresh warning registry."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(fn, "_WARNED", set(), raising=False)


@pytest.fixture
def no_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(fn, "_WARNED", set(), raising=False)


def _count(monkeypatch, owner, name):
    """Count the calls of ``owner.name`` (still calling it)."""
    calls = []
    real = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


def _kernel_calls(monkeypatch):
    """Launches of the fused rotation (the autograd function behind ``fused_rotary``) and of the basis kernel."""
    return _count(monkeypatch, rotary_mod._FusedRotary, "apply"), _count(monkeypatch, basis_mod._FusedBasisRotary,
                                                                          "apply")


def _perturbed(name, head_dim=8, coord_dim=2, **opts):
    torch.manual_seed(0)
    pe = create_pe(name, head_dim=head_dim, coord_dim=coord_dim, num_heads=2, **opts)
    with torch.no_grad():
        for p in pe.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return pe


def _dense(pe, x, coords, prefix):
    """``R(r) x`` per token from the float64 dense reference ``pe.matrix`` (prefix tokens unchanged)."""
    r = copy.deepcopy(pe).set_conventions(backend="torch").double().matrix(coords.double())  # (H, M, d, d)
    body = torch.einsum("hmij,bhmj->bhmi", r, x[:, :, prefix:].double())
    return torch.cat([x[:, :, :prefix].double(), body], dim=2)


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


# ----------------------------------------------------------------------------- backends
def test_backend_is_an_option_of_every_encoding_and_of_apply_frequency_rope():
    pe = create_pe("mixed", head_dim=8, coord_dim=2, num_heads=2, backend="torch")
    assert pe.backend == "torch" and create_pe("liere", head_dim=8, coord_dim=2).backend == "auto"
    assert "backend" in ropekit.pe_options("cayley")
    assert pe.set_conventions(backend="triton").backend == "triton"
    with pytest.raises(ValueError, match="backend must be one of auto, torch, triton"):
        pe.set_conventions(backend="cuda")
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="backend must be one of"):
        apply_frequency_rope(q, q, torch.randn(3, 2), torch.randn(2, 4), backend="fast")


@pytest.mark.parametrize("name,head_dim", [("mixed", 8), ("cayley", 32)])
def test_triton_backend_where_triton_cannot_run_raises_saying_why(no_interpreter, name, head_dim, monkeypatch):
    pe = _perturbed(name, head_dim, backend="triton")
    q, coords = torch.randn(1, 2, 3, head_dim), torch.randn(3, 2)
    with pytest.raises(ValueError, match=r"backend='triton' cannot run on cpu: .*TRITON_INTERPRET=1"):
        pe(q, q, coords)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        apply_frequency_rope(q, q, coords, torch.randn(2, head_dim // 2), backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(sys.modules, "triton", None)  # an install whose import fails
    with pytest.raises(ValueError, match="backend='triton' cannot run on cpu: importing Triton failed"):
        pe(q, q, coords)


def test_auto_on_the_cpu_without_the_interpreter_is_torch_without_a_warning(no_interpreter, monkeypatch):
    pe = _perturbed("mixed")
    q, coords = torch.randn(2, 2, 4, 8), torch.randn(3, 2)
    launches, _ = _kernel_calls(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qo, _ = pe(q, q, coords, num_prefix_tokens=1)
    assert not launches and _rel(qo, _dense(pe, q, coords, 1)) < 1e-6


@pytest.mark.parametrize("name,head_dim,opts,basis_kernel", [("mixed", 8, {}, False), ("axial", 8, {}, False),
                                                             ("cayley", 32, {}, True),
                                                             ("circulant", 32, {"block_size": 8}, True),
                                                             ("circulant", 12, {"block_size": 4}, False)])
def test_forced_torch_equals_triton_on_the_interpreter(interpreter, monkeypatch, name, head_dim, opts, basis_kernel):
    """The same encoding with backend "torch" and "triton": the kernel runs only for "triton", values and every
    gradient agree, and both equal the float64 dense reference."""
    pe_t = _perturbed(name, head_dim, **opts).set_conventions(backend="triton")
    pe_p = copy.deepcopy(pe_t).set_conventions(backend="torch")
    q = torch.randn(2, 2, 5, head_dim, requires_grad=True)
    k = torch.randn(2, 2, 5, head_dim, requires_grad=True)
    coords = torch.randn(4, 2) * 3
    rot, bas = _kernel_calls(monkeypatch)

    def run(pe):
        qo, ko = pe(q, k, coords, num_prefix_tokens=1)
        loss = ((qo @ ko.transpose(-1, -2)) ** 2).sum()
        return [qo, ko, *torch.autograd.grad(loss, [q, k, *pe.parameters()])]

    want = run(pe_p)
    assert not rot and not bas
    got = run(pe_t)
    assert (len(bas) > 0) == basis_kernel and (rot or bas)
    for a, b in zip(got, want):
        assert _rel(a, b) < 2e-6
    assert _rel(got[0], _dense(pe_t, q, coords, 1)) < 2e-6


def test_apply_frequency_rope_backends(interpreter, monkeypatch):
    q, k = torch.randn(2, 2, 5, 8, dtype=torch.float64), torch.randn(2, 2, 5, 8, dtype=torch.float64)
    coords, freqs = torch.randn(5, 2, dtype=torch.float64) * 100, torch.randn(2, 4, dtype=torch.float64)
    rot, _ = _kernel_calls(monkeypatch)
    qt, kt = apply_frequency_rope(q, k, coords, freqs, backend="torch")
    assert not rot
    qk, kk = apply_frequency_rope(q, k, coords, freqs, backend="triton")
    assert len(rot) == 1
    theta = coords @ freqs  # (M, P): the closed form, float64
    c, s = theta.cos(), theta.sin()
    want = torch.stack((q[..., 0::2] * c - q[..., 1::2] * s, q[..., 0::2] * s + q[..., 1::2] * c), -1).flatten(-2)
    assert _rel(qt, want) < 1e-12 and _rel(qk, want) < 1e-12 and _rel(kk, kt) < 1e-12


@pytest.mark.parametrize("name,head_dim", [("mixed", 8), ("cayley", 8), ("comrope-ld", 8)])
def test_folded_attention_honours_the_backend(interpreter, monkeypatch, name, head_dim):
    opts = {"block_size": 4} if name == "comrope-ld" else {}
    pe = _perturbed(name, head_dim, **opts)
    torch.manual_seed(1)
    att = Attention(2 * head_dim, 2, pe, fold=True)
    x, coords = torch.randn(2, 5, 2 * head_dim), torch.randn(4, 2) * 2
    rot, _ = _kernel_calls(monkeypatch)
    pe.set_conventions(backend="torch")
    want = att(x, coords, 1)
    assert not rot
    pe.set_conventions(backend="triton")
    got = att(x, coords, 1)
    assert len(rot) == 1 and _rel(got, want) < 2e-6
    unfolded = Attention(2 * head_dim, 2, pe.set_conventions(backend="torch"), fold=False)
    unfolded.load_state_dict(att.state_dict())
    assert _rel(got, unfolded.double()(x.double(), coords.double(), 1)) < 1e-5


def test_vit_pins_the_backend_through_pe_options(interpreter, monkeypatch):
    cfg = vit_config("tiny", embed_dim=16, depth=2, num_heads=2, image_size=(8, 8), num_classes=3,
                     pe="mixed", pe_options={"backend": "torch"})
    model = VisionTransformer(ViTConfig.from_dict(cfg.to_dict()))
    assert {b.attn.pe.backend for b in model.blocks} == {"torch"}
    rot, _ = _kernel_calls(monkeypatch)
    model(torch.randn(2, 1, 8, 8))
    assert not rot


def _broken_available(device):
    raise RuntimeError("CUDA driver 12.2 is older than the runtime")


@pytest.mark.parametrize("break_it,reason", [("import", "importing Triton failed"),
                                             ("available", "checking the kernels raised RuntimeError: CUDA driver")])
def test_auto_with_a_broken_triton_warns_once_and_computes_the_right_values(interpreter, monkeypatch, break_it,
                                                                             reason):
    if break_it == "import":
        monkeypatch.setitem(sys.modules, "triton", None)
    else:
        monkeypatch.setattr("ropekit.kernels.available", _broken_available)
    rot, _ = _kernel_calls(monkeypatch)
    pe = _perturbed("mixed")
    q, coords = torch.randn(2, 2, 5, 8), torch.randn(4, 2) * 5
    with pytest.warns(RuntimeWarning, match=reason) as record:
        outs = [pe(q, q, coords, num_prefix_tokens=1)[0] for _ in range(3)]
        outs.append(apply_frequency_rope(q, None, coords, pe.freqs[0], num_prefix_tokens=1)[0])
    assert len([w for w in record if issubclass(w.category, RuntimeWarning)]) == 1
    assert not rot
    want = _dense(pe, q, coords, 1)
    assert all(_rel(o, want) < 1e-6 for o in outs)


# ----------------------------------------------------------------------------- no silent fallbacks
def test_the_basis_kernel_does_no_work_of_its_own_in_the_first_forward_pass(interpreter, monkeypatch):
    """The first call of an encoding on a new shape launches the kernel for q and k only (no self-test inside the
    user's forward pass), and gives the dense float64 values."""
    pe = _perturbed("cayley", 64, coord_dim=3)  # a shape no earlier call has used: a first call in any test order
    _, bas = _kernel_calls(monkeypatch)
    q, k, coords = torch.randn(1, 2, 4, 64), torch.randn(1, 2, 4, 64), torch.randn(4, 3)
    qo, ko = pe(q, k, coords)
    assert len(bas) == 2
    assert _rel(qo, _dense(pe, q, coords, 0)) < 2e-6 and _rel(ko, _dense(pe, k, coords, 0)) < 2e-6


def test_axial_per_head_with_fixed_frequencies_is_refused():
    with pytest.raises(ValueError, match="per_head=True needs learnable_freqs=True"):
        create_pe("axial", head_dim=8, coord_dim=2, num_heads=2, per_head=True)
    with pytest.raises(ValueError, match="learnable_freqs"):
        VisionTransformer(vit_config("tiny", embed_dim=16, depth=1, num_heads=2, pe="axial", pe_sharing="head"))
    pe = create_pe("axial", head_dim=8, coord_dim=2, num_heads=2, per_head=True, learnable_freqs=True)
    assert pe.per_head and pe.freqs.shape == (2, 2, 4)


def test_nope_follows_the_module_device_and_dtype():
    pe = create_pe("none", head_dim=8, coord_dim=2, num_heads=2).double()
    gen, (p, freqs) = pe.generators(), pe.to_rope()
    r = pe.matrix(torch.randn(3, 2, dtype=torch.float64))
    assert gen.dtype == p.dtype == freqs.dtype == r.dtype == torch.float64
    assert torch.equal(gen, torch.zeros(2, 2, 8, 8, dtype=torch.float64))
    assert torch.equal(r, torch.eye(8, dtype=torch.float64).expand(2, 3, 8, 8))
    assert torch.equal(p, torch.eye(8, dtype=torch.float64).expand(2, 8, 8)) and not freqs.any()
    meta = pe.to("meta")
    assert meta.generators().is_meta and all(t.is_meta for t in meta.to_rope())
    assert pe.state_dict() == {}


# ----------------------------------------------------------------------------- configuration keys
def test_saved_vit_config_with_unknown_keys_warns_and_loads(monkeypatch):
    cfg = vit_config("tiny", embed_dim=16, depth=1, num_heads=2, pe="mixed")
    saved = {**cfg.to_dict(), "rope_theta": 3.0, "future_flag": True}
    with pytest.warns(UserWarning, match="ignoring unknown field.*future_flag, rope_theta"):
        assert ViTConfig.from_dict(saved, source="checkpoint x.pt", strict=False) == cfg
    with pytest.raises(ValueError, match="unknown field.*future_flag, rope_theta"):
        ViTConfig.from_dict(saved)
    import ropekit.nn.vit as vit_module

    monkeypatch.setitem(vit_module.RENAMED, "rotary", "pe")  # as if pe had once been called rotary
    old = {k if k != "pe" else "rotary": v for k, v in cfg.to_dict().items()}
    assert ViTConfig.from_dict(old) == cfg and ViTConfig.from_dict(old, strict=False) == cfg


def test_typed_model_options_stay_strict():
    with pytest.raises(ValueError, match="vit_config: unknown field.*embed_dimm"):
        vit_config("tiny", embed_dimm=32)
    from ropekit.classification import TrainConfig

    with pytest.raises(ValueError, match="model_options: unknown ViTConfig field.*embed_dimm"):
        TrainConfig.from_dict(dict(model_options={"embed_dimm": 32})).validate()


def _checkpoint(tmp_path, extra_keys):
    torch.manual_seed(0)
    cfg = vit_config("tiny", embed_dim=16, depth=1, num_heads=2, image_size=(8, 8), num_classes=3, pe="mixed")
    model = VisionTransformer(cfg).eval()
    path = tmp_path / "checkpoint.pt"
    torch.save({"format": "ropekit-checkpoint", "version": 1, "model": model.state_dict(),
                "vit_config": {**cfg.to_dict(), **extra_keys}, "train_config": {}, "path": str(path)}, path)
    return path, model


def test_every_checkpoint_loader_warns_about_unknown_vit_keys(tmp_path, monkeypatch):
    from ropekit_studies.runs import RunRecord
    from ropekit.train.finetune import init_from_checkpoint, load_source_model
    from ropekit.train import load_checkpoint
    from ropekit.classification import evaluation

    path, model = _checkpoint(tmp_path, {"newer_option": 1})
    x = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        want = model(x)
    with pytest.warns(UserWarning, match="newer_option"):
        loaded = load_source_model(str(path))
    with torch.no_grad():
        assert torch.equal(loaded(x), want)
    with pytest.warns(UserWarning, match="newer_option"):
        rec = RunRecord(key="k", run_dir=path, config=None, history=[], summary={}, cached=True)
        assert torch.equal(rec.model()(x).detach(), want)
    rgbd = VisionTransformer(vit_config("tiny", embed_dim=16, depth=1, num_heads=2, image_size=(8, 8),
                                        num_classes=3, pe="mixed", modality="rgbd", depth_input="coord"))
    with pytest.warns(UserWarning, match="newer_option"):
        assert "3-D model from the 2-D checkpoint" in init_from_checkpoint(rgbd, load_checkpoint(path))

    class Stop(Exception):
        pass

    def stop(*a, **kw):
        raise Stop

    monkeypatch.setattr(evaluation, "load_data", stop)  # ropekit eval: the model is built before the data load
    with pytest.warns(UserWarning, match="newer_option"), pytest.raises(Stop):
        evaluation.evaluate_run(path, device="cpu")


# ----------------------------------------------------------------------------- second derivatives on the kernels
@pytest.mark.slow
def test_fused_rotary_second_derivatives_gradgradcheck(interpreter):
    torch.manual_seed(0)
    dt = torch.float64
    q = torch.randn(1, 2, 3, 4, dtype=dt, requires_grad=True)
    k = torch.randn(1, 1, 3, 4, dtype=dt, requires_grad=True)  # grouped keys
    coords = torch.randn(2, 2, dtype=dt, requires_grad=True)
    freqs = torch.randn(2, 2, dtype=dt, requires_grad=True)
    k_coords = torch.randn(1, 2, 2, dtype=dt, requires_grad=True)

    def shared(q, k, coords, freqs):
        return fused_rotary(q, k, coords, freqs, num_prefix_tokens=1)

    def separate(q, k, coords, freqs, k_coords):
        return fused_rotary(q, k, coords, freqs, k_coords=k_coords, num_prefix_tokens=1, pairs="half")

    assert torch.autograd.gradgradcheck(shared, (q, k, coords, freqs), fast_mode=True)
    assert torch.autograd.gradgradcheck(separate, (q, k, coords, freqs, k_coords), fast_mode=True)


@pytest.mark.parametrize("name,opts", [("mixed", {}), ("cayley", {}), ("circulant", {"block_size": 8})])
def test_second_derivatives_of_the_kernel_path_equal_the_float64_torch_path(interpreter, monkeypatch, name, opts):
    """``create_graph`` through the encodings' kernel path (fp32 kernels; Cayley and Circulant through the basis
    kernel) gives the second derivatives of the PyTorch path in float64."""
    pe = _perturbed(name, 32, **opts)
    ref = copy.deepcopy(pe).double()
    rot, bas = _kernel_calls(monkeypatch)
    q, k, coords = torch.randn(1, 2, 4, 32), torch.randn(1, 2, 4, 32), torch.randn(3, 2) * 3

    def second(pe, dtype):
        qq, kk = q.to(dtype).requires_grad_(), k.to(dtype).requires_grad_()
        cc = coords.to(dtype).requires_grad_()
        params = list(pe.parameters())
        qo, ko = pe(qq, kk, cc, num_prefix_tokens=1)
        g = torch.autograd.grad(((qo @ ko.transpose(-1, -2)) ** 2).sum(), [qq, cc, *params], create_graph=True)
        probe = sum((t * torch.cos(torch.arange(t.numel(), dtype=dtype)).view(t.shape)).sum() for t in g)
        return [*g, *torch.autograd.grad(probe, [qq, kk, cc, *params])]

    got = second(pe, torch.float32)  # "auto" in the interpreter: the kernels
    assert rot or bas
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    want = second(ref, torch.float64)
    for a, b in zip(got, want):
        assert _rel(a, b) < 2e-5


@pytest.mark.parametrize("name,opts", [("mixed", {}), ("cayley", {}), ("comrope-ld", {"block_size": 4})])
def test_vit_on_the_kernel_path_equals_the_torch_path(interpreter, name, opts):
    """A ViT whose folded rotations run the fused kernel (which forms its own angles: the model forms no angle
    tables there, and ComRoPE's block rotation takes its frequencies instead of a table) gives the logits and every
    gradient of the same ViT on the PyTorch path, with its batched tables and gradient collectors."""
    results = []
    for backend in ("torch", "triton"):
        torch.manual_seed(0)
        m = VisionTransformer(vit_config("tiny", num_classes=3, in_chans=1, image_size=(8, 8), patch_size=4, pe=name,
                                         depth=2, pe_options={**opts, "backend": backend}))
        x = torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(1))
        out = m(x)
        results.append((out, torch.autograd.grad(out.square().sum(), list(m.parameters()))))
    (out, grads), (ref, ref_grads) = results[1], results[0]
    assert _rel(out, ref) < 1e-5
    for g, r in zip(grads, ref_grads):
        assert _rel(g, r) < 2e-5
