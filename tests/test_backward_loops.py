"""The CPU backward reductions have two forms -- a loop over the batch in one scratch buffer (large slices) and one
batched operation (every accelerator, and CPU slices below ``LOOP_MIN_BYTES``). Both must give the same
gradients; this module forces each form in turn on the CPU."""

from __future__ import annotations

import pytest
import torch

import ropekit.encodings.ops.rotation as fn
from ropekit import create_pe


def _grads(name: str, per_example: bool, loop: bool, monkeypatch) -> list:
    monkeypatch.setattr(fn, "LOOP_MIN_BYTES", 0 if loop else 1 << 40)
    torch.manual_seed(0)
    opts = {"block_size": 4} if name.startswith("comrope") else {}
    c = 3 if per_example else 2
    pe = create_pe(name, head_dim=24, coord_dim=c, num_heads=2, **opts)
    q, k = torch.randn(3, 2, 7, 24, requires_grad=True), torch.randn(3, 2, 7, 24, requires_grad=True)
    coords = torch.randn(3, 6, c) * 4 if per_example else torch.randn(6, c) * 4
    qo, ko = pe(q, k, coords, num_prefix_tokens=1)
    w = torch.randn(qo.shape, generator=torch.Generator().manual_seed(1))
    loss = (qo * w).sum() + (ko * w.flip(0)).sum()
    return torch.autograd.grad(loss, [q, k, *[p for p in pe.parameters() if p.requires_grad]])


@pytest.mark.parametrize("name,per_example", [("mixed", False), ("mixed", True), ("comrope-ld", True),
                                              ("comrope-ap", True)])
def test_loop_and_batched_backward_agree(name, per_example, monkeypatch):
    monkeypatch.setattr(fn, "LOOP_MIN_BYTES", 1024)
    assert fn.slice_loops(torch.zeros(2, 1 << 16)) and not fn.slice_loops(torch.zeros(2, 16))
    looped = _grads(name, per_example, True, monkeypatch)
    batched = _grads(name, per_example, False, monkeypatch)
    assert len(looped) == len(batched) >= 3  # q, k and at least one parameter
    for a, b in zip(looped, batched):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
