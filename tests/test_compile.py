"""``torch.compile(fullgraph=True)`` on every commuting encoding: no graph breaks, same values and gradients.

Graph breaks are a Dynamo matter, so most cases compile with ``backend="aot_eager"`` (Dynamo + AOT autograd, the
backward traced too, no C++ code generation): ~2-5 s per encoding on 2 cores. One test runs the default Inductor
backend end to end (~40-60 s the first time on 2 shared cores, most of it Inductor's own start-up). Small shapes
throughout. Timing on the shared 2-core machine: about 2 min wall (50 s CPU) for the whole file, half of it the
Inductor test.
"""

import pytest
import torch

import ropekit

# every encoding whose R(r)^T R(s) depends on s - r only (the tensor-product encoding is invariant too)
COMMUTING = [
    ("none", {}), ("axial", {}), ("mixed", {}), ("liere-commute", {}), ("cayley", {}), ("circulant", {}),
    ("circulant", {"block_size": 4}), ("comrope-ap", {"block_size": 4}), ("comrope-ld", {"block_size": 4}),
    ("comrope-ld", {"block_size": 4, "init": "zero"}), ("string", {}), ("relaxed", {"exact": True}),
    ("liere", {"block_size": 2}), ("tensor", {}),
]
PER_EXAMPLE = [("mixed", {}), ("cayley", {}), ("circulant", {"block_size": 4}), ("comrope-ld", {"block_size": 4})]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # each test compiles new modules: no recompile limit across tests
    yield
    torch._dynamo.reset()


def _check(name, opts, per_example, backend, coord_dim=2):
    torch.manual_seed(0)
    pe = ropekit.create_pe(name, head_dim=8, coord_dim=coord_dim, num_heads=2, **opts)
    with torch.no_grad():  # away from the (often trivial) initialisation
        for p in pe.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    b, n, prefix = 2, 6, 1
    coords = torch.randn(b, n - prefix, coord_dim) if per_example else torch.randn(n - prefix, coord_dim)
    q = torch.randn(b, 2, n, 8, requires_grad=True)
    k = torch.randn(b, 2, n, 8, requires_grad=True)
    params = [p for p in pe.parameters() if p.requires_grad]
    compiled = torch.compile(pe, fullgraph=True, backend=backend)
    results = []
    for fn in (pe, compiled):
        qe, ke = fn(q, k, coords, prefix)
        loss = (qe @ ke.transpose(-1, -2)).square().sum()
        grads = torch.autograd.grad(loss, [q, k] + params)
        results.append([qe.detach(), ke.detach()] + list(grads))
    for want, got in zip(*results):  # float32: relative to the largest entry (gradients reach ~1e2 here)
        tol = 1e-5 * max(1.0, want.abs().max().item())
        assert torch.allclose(got, want, atol=tol, rtol=1e-4), (name, (got - want).abs().max().item())


@pytest.mark.parametrize("name,opts", COMMUTING, ids=lambda v: str(v))
def test_fullgraph_shared_grid(name, opts):
    _check(name, opts, per_example=False, backend="aot_eager")


@pytest.mark.parametrize("name,opts", PER_EXAMPLE, ids=lambda v: str(v))
def test_fullgraph_per_example_coords(name, opts):
    _check(name, opts, per_example=True, backend="aot_eager", coord_dim=3)


def test_fullgraph_inductor():
    """The default backend end to end on the encoding with the most machinery (custom autograd Functions,
    a complex Hermitian eigendecomposition, batched block products)."""
    _check("comrope-ld", {"block_size": 4}, per_example=False, backend="inductor")


@pytest.mark.parametrize("pe", ["circulant", "mixed"])
def test_a_compiled_vit_training_step_compiles_once(pe, monkeypatch):
    """Three training steps of a compiled ViT: one graph, no recompilation. Constants kept in module-level caches
    (Cayley's skew-index table, Circulant's DFT basis) are built in the graph while Dynamo traces, instead of
    being stored then -- a dictionary filled during tracing fails its guard on the next call and compiled the whole
    model a second time (emptied here, as in a fresh process). Cayley and ComRoPE-LD are compiled in a fresh
    process, compiled optimiser step included, by ``test_compile_step_backends.py`` (the CPU path) and
    ``test_compile_step.py`` (the GPU path)."""
    from torch._dynamo.utils import counters

    import ropekit.encodings.circulant as circulant
    import ropekit.encodings.ops.skew as skew
    from ropekit.nn import VisionTransformer, vit_config

    monkeypatch.setattr(skew, "_FLAT_INDICES", {})
    monkeypatch.setattr(circulant, "_DFT_BASES", {})
    counters.clear()
    torch.manual_seed(0)
    model = VisionTransformer(vit_config("tiny", num_classes=10, in_chans=1, image_size=(16, 16), pe=pe, depth=2,
                                         patch_size=4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = torch.compile(model, backend="aot_eager")
    x, y = torch.rand(4, 1, 16, 16), torch.randint(0, 10, (4,))
    for _ in range(3):
        torch.nn.functional.cross_entropy(step(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["recompiles"] and not counters["graph_break"]
