"""A commuting STRING's learnt basis ``P`` is absorbed by free q/k projections, unless the keys are shared by
heads that have different bases.

Every commuting STRING is ``R(r) = P^T RoPE(r) P`` (circulant: a fixed ``P``) or ``RoPE(r) P`` (cayley); attention
sees ``q^T R(r)^T R(s) k``, and ``P`` applied to ``q = W_q x`` is the projection ``P W_q``. So a multi-head
attention with such an encoding computes exactly what an attention with RoPE-Mixed of the same frequencies
computes once its weight holds ``P W_q`` and ``P W_k``: the two have one function class, and only the
parametrisation differs. With one key head shared by all query heads (multi-query attention), a basis per head
would have to be merged into the one key projection once per head, which cannot be done: ``P`` then adds
functions. Everything here is float64.

Shape legend: ``B`` batch, ``N`` tokens, ``D`` width, ``H`` heads, ``d`` head dimension, ``c`` coordinate
dimension.
"""

import pytest
import torch
import torch.nn.functional as F

import ropekit
from ropekit.fold import rope_form
from ropekit.nn import Attention

D, H, C = 16, 2, 2
HD = D // H


def _perturbed(name: str, seed: int, **opts) -> ropekit.encodings.PositionEncoding:
    """A float64 encoding whose parameters are moved away from their initialisation (so ``P != I``)."""
    torch.manual_seed(seed)
    pe = ropekit.create_pe(name, head_dim=HD, coord_dim=C, num_heads=H, **opts).double()
    with torch.no_grad():
        for p in pe.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return pe


def _mixed_with(freqs: torch.Tensor) -> ropekit.encodings.PositionEncoding:
    """RoPE-Mixed (float64) whose frequencies are ``freqs`` ``(Hp, c, d/2)``, per head when ``Hp = H``."""
    mixed = ropekit.create_pe("mixed", head_dim=HD, coord_dim=C, num_heads=H, per_head=freqs.shape[0] > 1).double()
    with torch.no_grad():
        mixed.freq_param.copy_(freqs)
    assert torch.equal(rope_form(mixed).freqs, freqs)
    return mixed


def _merge_basis(weight: torch.Tensor, bias: torch.Tensor, basis: torch.Tensor):
    """``(weight, bias)`` of a fused qkv projection ``(3D, D)`` with ``P_h`` ``(Hp, d, d)`` applied to the q and k rows
    of every head ``h``: ``W_q -> P_h W_q``, ``W_k -> P_h W_k``, ``W_v`` unchanged."""
    basis = basis.expand(H, HD, HD)
    w = weight.reshape(3, H, HD, D).clone()  # (q/k/v, H, d, D)
    b = bias.reshape(3, H, HD).clone()
    w[:2] = torch.einsum("hij,shjk->shik", basis, w[:2])
    b[:2] = torch.einsum("hij,shj->shi", basis, b[:2])
    return w.reshape(3 * D, D), b.reshape(3 * D)


def _inputs(seed: int):
    """Tokens ``(B, N, D)`` and coordinates: a shared grid ``(N, c)`` and per-example ones ``(B, N, c)``, far from
    the origin too."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 9, D, generator=g, dtype=torch.float64)
    grid = torch.stack(torch.meshgrid(torch.arange(3.0), torch.arange(3.0), indexing="ij"), -1).reshape(9, C)
    per_example = torch.randn(3, 9, C, generator=g, dtype=torch.float64) * 20
    return x, [grid.double(), grid.double() + 1000.0, per_example]


@pytest.mark.parametrize("name,opts", [("cayley", {}), ("cayley", {"per_head": True}), ("circulant", {}),
                                       ("circulant", {"block_size": 4, "per_head": True})],
                         ids=["cayley", "cayley-per-head", "circulant", "circulant-b4-per-head"])
def test_commuting_string_equals_rope_mixed_with_the_basis_in_the_projection(name, opts):
    """Attention with the STRING encoding == attention with RoPE-Mixed of the same frequencies and the weight
    ``P W``, to float64 round-off, for random tokens on a grid, on a shifted grid and at random coordinates."""
    pe = _perturbed(name, seed=1, **opts)
    form = rope_form(pe)
    assert form.basis is not None
    assert (form.basis - torch.eye(HD, dtype=torch.float64)).abs().max() > 0.1  # a basis that is not the identity
    torch.manual_seed(2)
    string_attn = Attention(D, H, pe, fold=False).double()  # the encoding applied to every token, as written
    rope_attn = Attention(D, H, _mixed_with(form.freqs.detach()), fold=False).double()
    rope_attn.load_state_dict({k: v for k, v in string_attn.state_dict().items() if not k.startswith("pe.")},
                              strict=False)
    x, coord_sets = _inputs(0)
    assert (string_attn(x, coord_sets[2]) - rope_attn(x, coord_sets[2])).abs().max() > 1e-2  # P matters ...
    with torch.no_grad():  # ... and the projection absorbs it
        w, b = _merge_basis(string_attn.qkv.weight, string_attn.qkv.bias, form.basis.detach())
        rope_attn.qkv.weight.copy_(w)
        rope_attn.qkv.bias.copy_(b)
    for seed in range(3):
        x, coord_sets = _inputs(seed)
        for coords in coord_sets:
            out, ref = string_attn(x, coords), rope_attn(x, coords)
            assert out.abs().max() > 0.1
            torch.testing.assert_close(out, ref, rtol=0, atol=1e-11)


def _mqa(x: torch.Tensor, coords: torch.Tensor, pe, w_q: torch.Tensor, w_k: torch.Tensor,
         w_v: torch.Tensor) -> torch.Tensor:
    """Multi-query attention: queries per head ``w_q`` ``(H, d, D)``, one key and one value head ``w_k``, ``w_v``
    ``(d, D)`` that every query head reads, each head's copy of the key turned by that head's encoding.
    Returns ``(B, H, N, d)``."""
    q = torch.einsum("hed,bnd->bhne", w_q, x)  # (B, H, N, d)
    k = torch.einsum("ed,bnd->bne", w_k, x).unsqueeze(1).expand(-1, H, -1, -1)  # (B, H, N, d): one head, H copies
    v = torch.einsum("ed,bnd->bne", w_v, x).unsqueeze(1).expand(-1, H, -1, -1)
    q, k = pe(q, k, coords)
    return F.scaled_dot_product_attention(q, k, v)


def _commutant(rotations: torch.Tensor) -> torch.Tensor:
    """The linear map ``Y -> (Y M - M Y for every M)`` as a matrix ``(m d^2, d^2)``: its null space is the set of
    ``d x d`` matrices that commute with every rotation ``M`` in ``rotations`` ``(m, d, d)``."""
    eye = torch.eye(HD, dtype=torch.float64)
    # column-major vec: vec(Y M) = (M^T kron I) vec(Y), vec(M Y) = (I kron M) vec(Y)
    return torch.cat([torch.kron(m.T.contiguous(), eye) - torch.kron(eye, m) for m in rotations])


def _shared_key_bases(pe, coords: torch.Tensor) -> int:
    """The dimension of the space of key bases that absorb every head's ``P_h`` into one shared key projection,
    for a two-head cayley encoding ``R_h(r) = RoPE_h(r) P_h`` at ``coords`` ``(M, c)``.

    A RoPE attention with one key head matches head ``h`` of the STRING one (``W_q = W_k = I``) exactly when
    ``A_h^T M B = P_h^T M P_h`` for every ``M = RoPE_h(r)``; ``M = I`` gives ``A_h^T = B^-1``, and then
    ``Y_h = P_h B^-1`` must commute with every ``RoPE_h(r)``. One ``B`` for all heads means
    ``Y_1 = P_1 P_0^T Y_0``: the candidates ``Y_0`` are the null space of the stacked commutation conditions, and
    without a non-zero one no shared key can absorb the bases.
    """
    form = rope_form(pe)
    basis = form.basis.detach().expand(H, HD, HD)
    rotations = pe.matrix(coords).detach() @ basis.transpose(-1, -2).unsqueeze(1)  # RoPE_h(r) (H, M, d, d)
    to_head1 = torch.kron(torch.eye(HD, dtype=torch.float64), basis[1] @ basis[0].T)  # vec(Y) -> vec(P_1 P_0^T Y)
    conditions = torch.cat([_commutant(rotations[0]), _commutant(rotations[1]) @ to_head1])
    singular = torch.linalg.svdvals(conditions)
    return int((singular < 1e-9 * singular[0]).sum())


def test_shared_key_absorbs_a_basis_shared_by_the_heads():
    """With one key head and one basis for all heads, ``P`` is absorbed as before: merged into every query head's
    projection and into the one key projection."""
    pe = _perturbed("cayley", seed=3)
    basis = rope_form(pe).basis.detach()[0]
    mixed = _mixed_with(rope_form(pe).freqs.detach())
    g = torch.Generator().manual_seed(4)
    w_q, w_k, w_v = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((H, HD, D), (HD, D), (HD, D)))
    x, coord_sets = _inputs(5)
    for coords in coord_sets:
        torch.testing.assert_close(_mqa(x, coords, pe, w_q, w_k, w_v),
                                   _mqa(x, coords, mixed, basis @ w_q, basis @ w_k, w_v), rtol=0, atol=1e-11)
    assert _shared_key_bases(pe, coord_sets[2][0]) == HD  # P itself, times anything that commutes with RoPE


def test_shared_key_cannot_absorb_bases_per_head():
    """With one key head and a basis per head, the STRING attention is outside RoPE's function class: merging
    each head's ``P_h`` into its queries and one of them into the shared key matches that head only, and no key
    basis serves both heads (the space of candidates is ``{0}``) -- where the same frequencies with one basis
    for both heads leave ``d`` dimensions of candidates."""
    pe = _perturbed("cayley", seed=6, per_head=True)
    with torch.no_grad():
        pe.freq_param[1].copy_(pe.freq_param[0])  # same frequencies in both heads: only the bases differ
    form = rope_form(pe)
    basis, freqs = form.basis.detach(), form.freqs.detach()[:1]
    mixed = _mixed_with(freqs)
    g = torch.Generator().manual_seed(7)
    w_q, w_k, w_v = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((H, HD, D), (HD, D), (HD, D)))
    x, coord_sets = _inputs(8)
    coords = coord_sets[2]
    string = _mqa(x, coords, pe, w_q, w_k, w_v)
    merged = _mqa(x, coords, mixed, basis @ w_q, basis[0] @ w_k, w_v)  # the key carries head 0's basis
    torch.testing.assert_close(merged[:, 0], string[:, 0], rtol=0, atol=1e-11)
    assert (merged[:, 1] - string[:, 1]).abs().max() > 1e-2
    assert _shared_key_bases(pe, coords[0]) == 0
    shared = _perturbed("cayley", seed=6)  # the control: the same frequencies, head 0's basis for both heads
    with torch.no_grad():
        shared.freq_param.copy_(freqs)
        shared.cayley_params.copy_(pe.cayley_params[:1])
    assert _shared_key_bases(shared, coords[0]) == HD
