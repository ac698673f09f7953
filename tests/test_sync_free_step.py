"""A training step that never makes the host wait for the device: what a CUDA graph (``torch.compile`` with
``mode="reduce-overhead"``) needs, and what keeps an eager GPU step from stalling on each small operation.

Checked on the CPU: one training step (forward, backward, fused AdamW) of a tiny ViT per registered encoding under a
dispatch mode that raises on every ATen operation that reads a value back to the host -- ``item`` and every
``bool(tensor)`` / ``int(tensor)`` (``_local_scalar_dense``, ``is_nonzero``), ``nonzero``, boolean-mask
indexing, ``unique``, ``masked_select``, the linear-algebra error checks (``_linalg_check_errors``: ``solve``,
``inv``, ``cholesky`` without ``_ex``), ``solve_ex`` (on an H200 it copies between host and device), the eigensolvers and SVD (whose error checks run inside the kernel). The
setup (model, optimiser state, constant tables) runs before the checked step, unchecked, as it would before a
graph capture. Coordinates are validated in the deferred mode, as on an accelerator.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ropekit.encodings import PE_REGISTRY, set_coord_validation
from ropekit.nn import VisionTransformer, vit_config

aten = torch.ops.aten

#: ATen operations that make the host wait for the device (or that have a shape only the data decides).
SYNCING = {aten._local_scalar_dense, aten.item, aten.is_nonzero, aten.nonzero, aten.masked_select,
           aten._unique2, aten.unique_dim, aten.unique_consecutive, aten._linalg_check_errors,
           aten._linalg_eigh, aten.linalg_eig, aten._linalg_svd, aten.linalg_lstsq,
           # measured on an H200 (torch 2.11): a batched float64 ``solve_ex`` copies between host and device, which
           # broke the CUDA-graph capture of ComRoPE's Schur finish; ``lu_factor_ex`` + ``lu_solve`` did not
           aten._linalg_solve_ex}
INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}

#: Encodings whose training step synchronises, with the reason. Every other registered encoding must not.
EXCEPTIONS = {
    "relaxed": "not commuting (exact=False, the default; not folded): one matrix exponential per token from an "
               "eigendecomposition (encodings.ops.expm), whose error check syncs",
    "liere": "non-commuting with 2 coordinates (not folded): each token's generator is exponentiated through "
             "an eigendecomposition of a sum of generators (encodings.ops.expm), whose error check syncs",
}


class _NoSync(TorchDispatchMode):
    """Raises on the operations in ``SYNCING`` and on indexing by a boolean mask (a ``nonzero`` inside)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = getattr(func, "overloadpacket", None)
        if packet in SYNCING or (func is not aten.repeat_interleave.self_int and packet is aten.repeat_interleave
                                 and kwargs.get("output_size") is None):  # tensor repeats: the output size is read
            raise AssertionError(f"host synchronisation in the training step: {func}")
        if func in INDEXING:
            idx = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in idx):
                raise AssertionError(f"boolean-mask indexing (a hidden nonzero) in the training step: {func}")
        return func(*args, **kwargs)


def _step(pe: str):
    torch.manual_seed(0)
    opts = dict(PE_REGISTRY[pe].bench_vit_options)
    model = VisionTransformer(vit_config("tiny", num_classes=4, in_chans=1, image_size=(8, 8), patch_size=4,
                                         depth=2, pe=pe, pe_options=opts))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x, y = torch.randn(2, 1, 8, 8), torch.tensor([0, 3])

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def test_the_checker_catches_synchronisations():
    """The dispatch mode raises on what it is meant to catch (so that the test below can fail)."""
    t = torch.randn(4, 4)
    for bad in (lambda: t.sum().item(), lambda: bool(t.sum() > 0), lambda: t[t > 0], lambda: torch.nonzero(t),
                lambda: torch.linalg.eigh(t @ t.T), lambda: torch.linalg.solve(t @ t.T + 4 * torch.eye(4), t),
                lambda: torch.linalg.inv(t @ t.T + 4 * torch.eye(4)),
                lambda: torch.linalg.solve_ex(t @ t.T + 4 * torch.eye(4), t),
                lambda: torch.arange(3).repeat_interleave(torch.tensor([1, 0, 2]))):
        with pytest.raises(AssertionError, match="synchronisation|boolean-mask"), _NoSync():
            bad()
    with _NoSync():  # the sync-free forms pass
        lu, pivots, _ = torch.linalg.lu_factor_ex(t @ t.T + 4 * torch.eye(4))
        torch.linalg.lu_solve(lu, pivots, t)
        torch.where(t > 0, t, 0.0)

    class ReadsInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * float(g.sum())  # a host read in the backward pass

    x = torch.randn(3, requires_grad=True)
    with pytest.raises(AssertionError, match="synchronisation"), _NoSync():
        ReadsInBackward.apply(x).sum().backward()  # the backward pass is checked too


@pytest.mark.parametrize("b", [2, 4, 6, 8])
def test_skew_schur_form_is_sync_free(b):
    """The block Schur form of skew matrices (ComRoPE's basis) on its own, for the blocks up to 8 x 8 (larger ones,
    e.g. one-axis LieRE's whole head, take the eigensolver path)."""
    from ropekit.encodings.ops.skew import skew_real_schur

    k = torch.randn(3, b, b, dtype=torch.float64)
    skew_real_schur(k - k.mT)  # setup: the cached index tables
    with _NoSync():
        skew_real_schur(k - k.mT)


@pytest.mark.parametrize("pe", sorted(PE_REGISTRY))
def test_training_step_is_sync_free(pe):
    step = _step(pe)
    previous = set_coord_validation("deferred")
    try:
        step()  # setup: optimiser state, cached index tables and bases
        if pe in EXCEPTIONS:
            with pytest.raises(AssertionError, match="synchronisation"), _NoSync():
                step()  # still true: drop the exception when it no longer syncs
            return
        with _NoSync():
            step()
    finally:
        set_coord_validation(previous)


#: The encodings whose ViT training step is meant to run without host synchronisation on a GPU and to be captured
#: in a CUDA graph: the RoPE family and the folded ones.
GRAPH_PES = ["axial", "mixed", "cayley", "circulant", "comrope-ld"]


def _cuda_step(model: torch.nn.Module, capturable: bool = False):
    """A training step of ``model`` (on the GPU) with fused AdamW on fixed data: ``(optimiser, step)``."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=capturable)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 3, 32, 32, generator=g).cuda(), torch.tensor([0, 1, 2, 3]).cuda()

    def step() -> torch.Tensor:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return opt, step


def _graph_step(model: torch.nn.Module, device: str):
    """PyTorch's whole-network capture recipe, step by step: ``(optimiser, step)`` where ``step`` zeroes the
    gradients in place (``zero_grad(set_to_none=False)``: the gradient buffers exist before the capture and every
    replay writes the same ones), runs forward and backward on static inputs, and takes a fused AdamW step
    (``capturable=True`` on CUDA: its step counters live on the device)."""
    dev = torch.device(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=dev.type == "cuda")
    g = torch.Generator().manual_seed(0)
    x = torch.empty(4, 3, 32, 32, device=dev)  # static inputs: the data is copied in, the buffers never change
    y = torch.empty(4, dtype=torch.long, device=dev)
    x.copy_(torch.randn(4, 3, 32, 32, generator=g))
    y.copy_(torch.tensor([0, 1, 2, 3]))

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return opt, step


def _twin(model: torch.nn.Module, opt: torch.optim.Optimizer, device: str):
    """An independent copy of ``model`` and its optimiser's state, for eager steps: ``(twin, step)``.

    ``opt.state_dict()`` holds the optimiser's own state tensors (``load_state_dict`` moves them with ``.to``,
    which returns the same tensor on the same device), so loading it unchanged would let the twin and the
    original update one set of moments and step counters -- the deep copy keeps them apart."""
    import copy

    twin = copy.deepcopy(model)
    twin_opt, twin_step = _graph_step(twin, device)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    return twin, twin_step


def _cuda_model(pe: str, device: str = "cuda") -> torch.nn.Module:
    """The tiny ViT with encoding ``pe`` (a registered encoding, or ``"absolute"``) on ``device``."""
    torch.manual_seed(0)
    options = dict(PE_REGISTRY[pe].bench_vit_options) if pe in PE_REGISTRY else {}
    return VisionTransformer(vit_config("tiny", num_classes=4, in_chans=3, image_size=(32, 32), patch_size=8,
                                        pe=pe, pe_options=options)).to(device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("pe", GRAPH_PES)
def test_cuda_training_step_does_not_synchronise(pe):
    """On the device itself: ``torch.cuda.set_sync_debug_mode("error")`` raises at any synchronising call."""
    opt, step = _cuda_step(_cuda_model(pe))
    for _ in range(2):  # setup: optimiser state, cached tables, kernel compilation
        opt.zero_grad(set_to_none=True)
        step()
    torch.cuda.synchronize()
    opt.zero_grad(set_to_none=True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


CAPTURE_DEVICES = ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.gpu)] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", CAPTURE_DEVICES)
@pytest.mark.parametrize("pe", ["absolute", "none"] + GRAPH_PES)
def test_cuda_training_step_captures_in_a_cuda_graph(pe, device):
    """The whole step (zeroing the gradients, forward, backward, fused capturable AdamW) captured in one CUDA graph
    as PyTorch's whole-network capture recipe does it, and replayed three times, equals three eager steps of an
    independent copy taken from the same state -- the absolute-embedding and no-encoding ViTs first, which show
    that the procedure is right. On the CPU the same procedure runs eagerly (no capture): it checks the twin's
    independence and the recipe's steps, which the CUDA run relies on."""
    model = _cuda_model(pe, device)
    opt, step = _graph_step(model, device)
    if device == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream: optimiser state, gradient buffers, kernels
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
    else:
        for _ in range(3):
            step()
    assert all(p.grad is not None for p in model.parameters())  # allocated before the capture, never None
    twin, twin_step = _twin(model, opt, device)
    if device == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # recorded, not run: the parameters do not move here
            loss = step()
        run = graph.replay
    else:
        loss = torch.zeros(())

        def run() -> None:
            loss.copy_(step().detach())
    for _ in range(3):
        run()
        twin_loss = twin_step()
        if device == "cuda":
            torch.cuda.synchronize()
        assert torch.allclose(loss, twin_loss, rtol=1e-4, atol=1e-5), (loss.item(), twin_loss.item())
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.allclose(p, q, rtol=1e-4, atol=1e-5)
