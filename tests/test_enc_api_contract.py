"""The encoding API contract: prepare/apply, key coordinates, grouped keys, layouts, pair conventions, 1-D positions."""

import pytest
import torch

from ropekit.encodings import PEState, create_pe, list_pes
from ropekit.encodings.ops.rotation import apply_frequency_rope

H, D = 4, 16
ROTATIONS = [n for n in list_pes() if n != "tensor"]


def _pe(name, coord_dim=2, num_heads=H, **kw):
    torch.manual_seed(0)
    opts = {"block_size": 8} if name in ("liere", "comrope-ap", "comrope-ld") else {}
    opts.update(kw)
    return create_pe(name, head_dim=D, coord_dim=coord_dim, num_heads=num_heads, **opts).double()


@pytest.mark.parametrize("name", list_pes())
def test_prepare_apply_equals_forward(name):
    pe = _pe(name)
    q, k = torch.randn(2, H, 7, D, dtype=torch.float64), torch.randn(2, H, 7, D, dtype=torch.float64)
    coords = torch.randn(2, 5, 2, dtype=torch.float64)
    qf, kf = pe(q, k, coords, num_prefix_tokens=2)
    state = pe.prepare(coords, 2)
    assert isinstance(state, PEState)
    qa, ka = pe.apply(q, k, state)
    torch.testing.assert_close(qa, qf, rtol=0, atol=1e-12)
    torch.testing.assert_close(ka, kf, rtol=0, atol=1e-12)
    torch.testing.assert_close(pe.apply_one(k, state, role="k"), kf, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ROTATIONS)
def test_k_coords_encode_keys_at_their_own_positions(name):
    """KV-cache decoding: one new query against cached keys; the logits equal encoding everything at once."""
    pe = _pe(name)
    coords = torch.randn(6, 2, dtype=torch.float64)
    q, k = torch.randn(1, H, 6, D, dtype=torch.float64), torch.randn(1, H, 6, D, dtype=torch.float64)
    q_all, k_all = pe(q, k, coords)
    q_last, k_enc = pe(q[:, :, -1:], k, coords[-1:], k_coords=coords)
    torch.testing.assert_close(q_last, q_all[:, :, -1:], rtol=0, atol=1e-12)
    torch.testing.assert_close(k_enc, k_all, rtol=0, atol=1e-12)


def test_different_lengths_without_k_coords_raise():
    pe = _pe("mixed")
    q, k = torch.randn(1, H, 3, D), torch.randn(1, H, 5, D)
    with pytest.raises(ValueError, match="k_coords"):
        pe.float()(q, k, torch.randn(3, 2))
    with pytest.raises(ValueError, match="k_coords"):
        apply_frequency_rope(q, k, torch.randn(3, 2), torch.randn(2, D // 2))


@pytest.mark.parametrize("name", list_pes())
def test_grouped_keys_with_shared_parameters(name):
    pe = _pe(name)
    coords = torch.randn(5, 2, dtype=torch.float64)
    q = torch.randn(2, H, 5, D, dtype=torch.float64)
    k = torch.randn(2, 2, 5, D, dtype=torch.float64)  # 2 key heads for 4 query heads
    _, ke = pe(q, k, coords)
    # each key head is encoded as a query head would be (shared parameters): compare with the repeated form
    _, k_full = pe(q, k.repeat_interleave(2, dim=1), coords)
    torch.testing.assert_close(ke, k_full[:, ::2], rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["mixed", "cayley", "liere", "comrope-ld"])
def test_grouped_keys_with_per_head_parameters_raise(name):
    pe = _pe(name, per_head=True)
    q, k = torch.randn(1, H, 5, D, dtype=torch.float64), torch.randn(1, 2, 5, D, dtype=torch.float64)
    with pytest.raises(ValueError, match="per_head=False"):
        pe(q, k, torch.randn(5, 2, dtype=torch.float64))


@pytest.mark.parametrize("name", list_pes())
def test_bnhd_layout(name):
    pe = _pe(name)
    pe_t = _pe(name, layout="bnhd")
    pe_t.load_state_dict(pe.state_dict())
    q, k = torch.randn(2, H, 6, D, dtype=torch.float64), torch.randn(2, H, 6, D, dtype=torch.float64)
    coords = torch.randn(5, 2, dtype=torch.float64)
    qe, ke = pe(q, k, coords, num_prefix_tokens=1)
    qt, kt = pe_t(q.transpose(1, 2), k.transpose(1, 2), coords, num_prefix_tokens=1)
    torch.testing.assert_close(qt, qe.transpose(1, 2), rtol=0, atol=1e-12)
    torch.testing.assert_close(kt, ke.transpose(1, 2), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="layout"):
        _pe(name, layout="nhbd")


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@pytest.mark.parametrize("name", ["axial", "mixed", "liere-commute"])
def test_half_pairs_match_hf_rotate_half(name):
    """HF / Llama: q * cos + rotate_half(q) * sin, cos/sin duplicated over the two halves."""
    pe = _pe(name, pairs="half")
    coords = torch.randn(5, 2, dtype=torch.float64) * 10
    q = torch.randn(2, H, 5, D, dtype=torch.float64)
    theta = pe.angles(coords)  # (Hp, M, d/2)
    emb = torch.cat((theta, theta), dim=-1)  # HF's cat((freqs, freqs))
    expected = q * emb.cos() + _rotate_half(q) * emb.sin()
    qe, _ = pe(q, q, coords)
    torch.testing.assert_close(qe, expected, rtol=0, atol=1e-12)
    fq, _ = apply_frequency_rope(q, None, coords, pe.freqs, pairs="half")
    torch.testing.assert_close(fq, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ROTATIONS)
def test_half_pairs_are_a_relabelling(name):
    """For every encoding, ``pairs="half"`` is the interleaved encoding conjugated by the pair permutation."""
    pe = _pe(name)
    pe_h = _pe(name, pairs="half")
    pe_h.load_state_dict(pe.state_dict())
    coords = torch.randn(3, 2, dtype=torch.float64)
    perm = torch.arange(D).view(2, D // 2).t().reshape(-1)  # interleaved position 2n+j <- half position j*d/2+n
    r, r_h = pe.matrix(coords), pe_h.matrix(coords)
    torch.testing.assert_close(r_h[..., perm, :][..., :, perm], r, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["axial", "mixed", "cayley", "circulant", "liere"])
def test_one_dimensional_positions(name):
    pe = _pe(name, coord_dim=1)
    q = torch.randn(2, H, 5, D, dtype=torch.float64)
    pos = torch.arange(5, dtype=torch.float64)
    ref, _ = pe(q, q, pos[:, None])
    got, _ = pe(q, q, pos)  # (N,)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    got, _ = pe(q, q, pos.expand(2, 5))  # (B, N) position ids
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    # one decoding step per example: (B, 1) position ids
    step, _ = pe(q[:, :, -1:], q[:, :, -1:], torch.full((2, 1), 4.0, dtype=torch.float64))
    torch.testing.assert_close(step, ref[:, :, -1:], rtol=0, atol=1e-12)


def test_apply_frequency_rope_matches_module_and_dense_reference():
    torch.manual_seed(0)
    pe = _pe("mixed", per_head=True)
    q, k = torch.randn(2, H, 6, D, dtype=torch.float64), torch.randn(2, H, 6, D, dtype=torch.float64)
    coords = torch.randn(2, 5, 2, dtype=torch.float64) * 3
    fq, fk = apply_frequency_rope(q, k, coords, pe.freqs, num_prefix_tokens=1)
    mq, mk = pe(q, k, coords, num_prefix_tokens=1)
    torch.testing.assert_close(fq, mq, rtol=0, atol=1e-12)
    torch.testing.assert_close(fk, mk, rtol=0, atol=1e-12)
    gen = pe.generators()  # (H, c, d, d)
    rot = torch.linalg.matrix_exp(torch.einsum("bmc,hcij->bhmij", coords, gen).contiguous())  # (B, H, M, d, d)
    ref = torch.einsum("bhmij,bhmj->bhmi", rot, q[:, :, 1:])
    torch.testing.assert_close(fq[:, :, 1:], ref, rtol=0, atol=1e-10)


def test_apply_frequency_rope_gradients():
    torch.manual_seed(0)
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 3, 8, dtype=torch.float64, requires_grad=True)
    coords = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)
    k_coords = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    freqs = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    for pairs in ("interleaved", "half"):
        def fn(q, k, coords, k_coords, freqs):
            return apply_frequency_rope(q, k, coords, freqs, k_coords=k_coords, pairs=pairs)
        torch.autograd.gradcheck(fn, (q, k, coords, k_coords, freqs))
        torch.autograd.gradgradcheck(fn, (q, k, coords, k_coords, freqs))


MINE = ["axial", "mixed", "liere-commute", "circulant"]


def _dense(pe, coords):
    """``expm(sum_k r_k L_k)`` per head and token from the generators, float64: ``(..., H, M, d, d)``."""
    gen = pe.generators().detach().double()  # (H, c, d, d)
    if coords.dim() == 2:
        return torch.linalg.matrix_exp(torch.einsum("mc,hcij->hmij", coords, gen).contiguous())
    return torch.linalg.matrix_exp(torch.einsum("bmc,hcij->bhmij", coords, gen).contiguous())


@pytest.mark.parametrize("name", MINE)
@pytest.mark.parametrize("shared", [True, False])
def test_per_head_parameters_against_dense_reference(name, shared):
    opts = {"learnable_freqs": True} if name == "axial" else {}
    pe = _pe(name, per_head=True, **opts)
    assert pe.param_heads == H
    with torch.no_grad():  # make the heads differ
        for p in pe.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    coords = torch.randn(5, 2, dtype=torch.float64) if shared else torch.randn(2, 5, 2, dtype=torch.float64)
    q = torch.randn(2, H, 7, D, dtype=torch.float64)
    qe, _ = pe(q, q, coords, num_prefix_tokens=2)
    rot = _dense(pe, coords)
    if shared:
        rot = rot.unsqueeze(0)
    want = torch.einsum("bhmij,bhmj->bhmi", rot.expand(2, -1, -1, -1, -1), q[:, :, 2:])
    torch.testing.assert_close(qe[:, :, 2:], want, rtol=0, atol=1e-10)
    torch.testing.assert_close(qe[:, :, :2], q[:, :, :2], rtol=0, atol=0)
    heads = [qe[:, h, 2:] for h in range(H)]
    assert not torch.allclose(heads[0], heads[1])  # per-head parameters are used per head


@pytest.mark.parametrize("name", ["none"] + MINE)
def test_meta_build_to_empty_reset_equals_eager(name):
    opts = {"learnable_freqs": True} if name == "axial" else {}
    torch.manual_seed(3)
    eager = create_pe(name, head_dim=D, coord_dim=2, num_heads=H, **opts)
    with torch.device("meta"):
        lazy = create_pe(name, head_dim=D, coord_dim=2, num_heads=H, **opts)
    assert all(t.device.type == "meta" for t in list(lazy.parameters()) + list(lazy.buffers()))
    lazy = lazy.to_empty(device="cpu")
    torch.manual_seed(3)
    lazy.reset_parameters()
    for (n1, a), (n2, b) in zip(eager.state_dict().items(), lazy.state_dict().items()):
        assert n1 == n2 and torch.equal(a, b), n1
    q, coords = torch.randn(1, H, 4, D), torch.randn(4, 2)
    torch.testing.assert_close(lazy(q, q, coords)[0], eager(q, q, coords)[0], rtol=0, atol=0)


def test_axial_table_rebuilt_after_to_empty():
    pe = create_pe("axial", head_dim=D, coord_dim=2, num_heads=H)
    ref = pe.freq_table.clone()
    pe = pe.to_empty(device="cpu")
    torch.testing.assert_close(pe.freq_table, ref, rtol=0, atol=0)


def test_fused_kernel_dispatch(monkeypatch):
    """Where ``ropekit.kernels`` says it is available, apply_frequency_rope and the RoPE modules call its
    ``fused_rotary`` with the agreed signature; where they cannot run (no Triton) the PyTorch path runs."""
    import sys
    import types

    import ropekit.encodings.ops.rotation as fn

    calls = []
    reference = apply_frequency_rope

    def fused_rotary(q, k, coords, freqs, *, k_coords=None, num_prefix_tokens=0, pairs="interleaved", validate=True):
        calls.append((tuple(q.shape), k is None, tuple(coords.shape), tuple(freqs.shape), num_prefix_tokens, pairs))
        with monkeypatch.context() as m:
            m.setattr(fn, "fused_kernel", lambda device, traceable=False, backend="auto": None)
            return reference(q, k, coords, freqs, k_coords=k_coords, num_prefix_tokens=num_prefix_tokens, pairs=pairs,
                             validate=validate)

    fake = types.SimpleNamespace(available=lambda device: True, fused_rotary=fused_rotary)
    monkeypatch.setitem(sys.modules, "ropekit.kernels", fake)
    monkeypatch.setattr(fn, "_KERNELS", [fake])
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU dispatch only happens in Triton's interpreter mode
    q, k = torch.randn(2, H, 6, D), torch.randn(2, H, 6, D)
    coords, freqs = torch.randn(5, 2), torch.randn(2, D // 2)
    got = apply_frequency_rope(q, k, coords, freqs, num_prefix_tokens=1, pairs="half")
    assert calls == [((2, H, 6, D), False, (5, 2), (2, D // 2), 1, "half")]
    pe = create_pe("mixed", head_dim=D, coord_dim=2, num_heads=H)
    qe, _ = pe(q, k, coords, num_prefix_tokens=1)
    # module path: q and k in one launch, prefix tokens passed to the kernel, shared frequencies as (c, d/2)
    assert len(calls) == 2 and calls[1] == ((2, H, 6, D), False, (5, 2), (2, D // 2), 1, "interleaved")
    absent = types.SimpleNamespace(available=lambda device: False, unavailable_reason=lambda device: "no Triton")
    monkeypatch.setattr(fn, "_KERNELS", [absent])  # Triton absent: the PyTorch path gives the same values
    torch.testing.assert_close(qe, pe(q, k, coords, num_prefix_tokens=1)[0])
    torch.testing.assert_close(got[0], apply_frequency_rope(q, k, coords, freqs, num_prefix_tokens=1, pairs="half")[0])
    assert len(calls) == 2


def test_functional_reexports_each_public_name_from_its_home():
    """``ropekit.encodings.functional`` is a namespace over the modules of each concept: every name in its
    ``__all__`` is the object of the module it lives in, and that module lists it in its own ``__all__``."""
    import importlib

    import ropekit.encodings.functional as functional
    import ropekit.encodings.ops.rotation as rotation

    assert len(functional.__all__) == len(set(functional.__all__)) == 20
    for name in functional.__all__:
        obj = getattr(functional, name)
        home = importlib.import_module(obj.__module__) if callable(obj) else rotation  # BACKENDS: a tuple
        assert home is not functional and getattr(home, name) is obj, name
        assert name in home.__all__, f"{name} is not public in {home.__name__}"
