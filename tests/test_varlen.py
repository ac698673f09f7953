"""The varlen attention path of packed batches (ropekit.nn.masks.varlen_segments / varlen_attention, packed_forward's
``attention="varlen"`` / ``"auto"``): the gather order, ``cu_seqlens`` and ``max_seqlen`` against a hand-computed
case, the backend choice, the one-line errors, the whole path with a CPU reference kernel (sequences cut out by
``cu_seqlens`` and attended one by one in float64), and on CUDA the real kernel against each image alone through
SDPA, to a bfloat16 bound."""

import pytest
import torch
import torch.nn.functional as F

from ropekit.nn import masks
from ropekit.nn.masks import (VarlenKernel, VarlenSegments, masked_attention, segment_mask, varlen_attention,
                              varlen_function, varlen_segments)
from ropekit.nn.packing import pack, packed_forward, patchify
from ropekit.nn.vit import VisionTransformer, vit_config


def test_varlen_segments_hand_computed():
    # two rows of 5 tokens, 2 slots: row 0 = CLS of slot 0, CLS of slot 1, two patches of slot 0, padding;
    # row 1 = unused slot CLS (-1) ... written as segments: [1, 1, 0, -1, -1]
    seg = torch.tensor([[0, 1, 0, 0, -1], [1, 1, 0, -1, -1]])
    s = varlen_segments(seg, 2)
    # sequences, in order: row 0 slot 0 {0, 2, 3}, slot 1 {1}, padding {4}; row 1 slot 0 {7}, slot 1 {5, 6},
    # padding {8, 9}
    assert s.order.tolist() == [0, 2, 3, 1, 4, 7, 5, 6, 8, 9]
    assert s.cu_seqlens.tolist() == [0, 3, 4, 5, 6, 8, 10] and s.cu_seqlens.dtype == torch.int32
    assert s.max_seqlen == 5 and s.mode == "varlen"  # the row length: a bound that needs no host sync
    assert torch.equal(s.order[s.inverse], torch.arange(10)) and torch.equal(s.inverse[s.order], torch.arange(10))
    assert varlen_segments(seg, 2, max_seqlen=3).max_seqlen == 3
    # an empty slot is a sequence of length 0 (repeated offsets), not dropped: no data-dependent shape
    empty = varlen_segments(torch.tensor([[0, 0, -1]]), 3)
    assert empty.cu_seqlens.tolist() == [0, 2, 2, 2, 3]
    with pytest.raises(ValueError, match="num_segments must be a positive int"):
        varlen_segments(seg, 0)
    with pytest.raises(ValueError, match="mode must be"):
        varlen_segments(seg, 2, mode="flash")
    with pytest.raises(ValueError, match="integer tensor"):
        varlen_segments(seg.float(), 2)


def _reference_kernel(q, k, v, cu, max_len, scale, dropout_p):
    """Independent of the gather: each sequence ``cu[i]:cu[i+1]`` attended alone (dense softmax, float64)."""
    assert int((cu[1:] - cu[:-1]).max()) <= max_len
    out = torch.zeros_like(q)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if b > a:
            qs, ks, vs = (x[a:b].transpose(0, 1) for x in (q, k, v))  # (H, L, d)
            w = torch.softmax((qs @ ks.transpose(-1, -2)) * scale, dim=-1)
            out[a:b] = (w @ vs).transpose(0, 1)
    return out


CALLS = []


def _counting_kernel(*args):
    CALLS.append(1)
    return _reference_kernel(*args)


@pytest.fixture
def cpu_kernel(monkeypatch):
    """A CPU float64 reference in place of the installed kernel, so the whole path runs here."""
    kernel = VarlenKernel("reference", _counting_kernel, device_types=("cpu",), dtypes=(torch.float64,))
    monkeypatch.setattr(masks, "varlen_function", lambda: kernel)
    import ropekit.nn.packing as packing

    monkeypatch.setattr(packing, "varlen_function", lambda: kernel)
    CALLS.clear()
    return kernel


def test_varlen_attention_equals_sdpa_with_the_block_mask(cpu_kernel):
    g = torch.Generator().manual_seed(0)
    for trial in range(5):
        b, h, n, d, dv = 3, 2, 9, 8, 6 if trial % 2 else 8  # q / k wider than v (the tensor-product encoding)
        seg = torch.randint(-1, 3, (b, n), generator=g)
        q, k = torch.randn(2, b, h, n, d, generator=g, dtype=torch.float64)
        v = torch.randn(b, h, n, dv, generator=g, dtype=torch.float64)
        segs = varlen_segments(seg, 3)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=segment_mask(seg), scale=0.3)
        got = masked_attention(q, k, v, segs, scale=0.3)
        assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-12, atol=1e-12)


def _model(pe, cls="none"):
    opts = {"block_size": 4} if pe.startswith("comrope") else {}
    cfg = vit_config("tiny", num_classes=3, in_chans=1, image_size=(16, 16), patch_size=4, depth=2, pe=pe,
                     pe_options=opts, cls=cls)
    return VisionTransformer(cfg)


def _images(seed):
    g = torch.Generator().manual_seed(seed)
    sizes = [(12, 20), (16, 8), (8, 8), (20, 12), (4, 28)]  # 15, 8, 4, 15, 7 tokens
    return [torch.randn(1, h, w, generator=g) for h, w in sizes]


# three cases in the fast loop (a commuting encoding, a basis, widened q / k; each CLS mode once); all when slow
# tests run
FAST = {("axial", "none"), ("cayley", "centroid"), ("tensor", "unrotated")}
CASES = [(pe, cls) if (pe, cls) in FAST else pytest.param(pe, cls, marks=pytest.mark.slow)
         for pe in ("axial", "mixed", "cayley", "tensor") for cls in ("none", "unrotated", "centroid")]


@pytest.mark.parametrize("pe, cls", CASES)
def test_packed_varlen_logits_and_gradients_equal_each_image_alone(cpu_kernel, pe, cls):
    """float64 with the CPU reference kernel: the order, cu_seqlens, padding, CLS slots and v padding of the varlen
    path give each image exactly its logits and gradients alone (to float64 round-off)."""
    torch.manual_seed(1)
    model = _model(pe, cls).double()
    imgs = [im.double() for im in _images(2)]
    batch = pack([patchify(im, 4, label=i) for i, im in enumerate(imgs)], max_tokens=24)
    assert (batch.image_index < 0).any()  # an unused slot: an empty sequence
    w = torch.randn(len(imgs), 3, dtype=torch.float64)
    out = packed_forward(model, batch, attention="varlen")
    assert len(CALLS) == 2  # one call per block: the kernel ran
    (out * w).sum().backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    ref = torch.cat([model(im[None]) for im in imgs])
    (ref * w).sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(packed[name], p.grad, rtol=1e-9, atol=1e-10, msg=name)


def test_auto_chooses_varlen_where_the_kernel_runs(cpu_kernel):
    model = _model("axial").double()
    imgs = [im.double() for im in _images(3)]
    batch = pack([patchify(im, 4, label=i) for i, im in enumerate(imgs)], max_tokens=24)
    with torch.no_grad():
        sdpa = packed_forward(model, batch, attention="sdpa")
        assert not CALLS
        default = packed_forward(model, batch)  # the default stays SDPA although a kernel could run here
        assert not CALLS and torch.equal(default, sdpa)
        auto = packed_forward(model, batch, attention="auto")  # a kernel for this device and dtype is there
        assert len(CALLS) == 2 and torch.allclose(auto, sdpa, rtol=1e-12, atol=1e-12)
        CALLS.clear()
        packed_forward(model.float(), batch._replace(patches=batch.patches.float()), attention="auto")  # float32: SDPA
        assert not CALLS
    model.double().train()
    model.blocks[0].attn.attn_drop = 0.1  # dropout the kernel does not have: SDPA
    packed_forward(model, batch, attention="auto")
    assert len(CALLS) == 1
    with pytest.raises(ValueError, match="without dropout, heads .*; got cpu float64, head 48, dropout 0.1"):
        packed_forward(model, batch, attention="varlen")


def test_backend_choice_and_errors_without_a_usable_kernel(monkeypatch):
    """On this CPU machine: ``auto`` is exactly SDPA; ``varlen`` fails in one line, naming the reason."""
    model = _model("axial").eval()
    imgs = _images(4)
    batch = pack([patchify(im, 4, label=i) for i, im in enumerate(imgs)], max_tokens=24)
    with torch.no_grad():
        assert torch.equal(packed_forward(model, batch), packed_forward(model, batch, attention="sdpa"))
        if varlen_function() is not None:  # PyTorch's kernel is installed here, but runs on CUDA only
            with pytest.raises(ValueError, match=r"^attention='varlen' runs on cuda, the batch is on cpu") as e:
                packed_forward(model, batch, attention="varlen")
            assert "\n" not in str(e.value)
            q = torch.zeros(1, 1, 3, 8)
            with pytest.raises(ValueError, match=r"runs on cuda in float16 or bfloat16 without dropout, heads of a "
                                                 r"multiple of 8 up to 256; got cpu float32, head 8 \("):
                varlen_attention(q, q, q, varlen_segments(torch.zeros(1, 3, dtype=torch.long), 1))
        import ropekit.nn.packing as packing

        monkeypatch.setattr(masks, "varlen_function", lambda: None)
        monkeypatch.setattr(packing, "varlen_function", lambda: None)
        with pytest.raises(ValueError, match=r"^attention='varlen' needs torch.nn.attention.varlen.varlen_attn .*"
                                             r"neither is installed \(use attention='sdpa'\)$"):
            packed_forward(model, batch, attention="varlen")
        assert torch.equal(packed_forward(model, batch), packed_forward(model, batch, attention="sdpa"))
    with pytest.raises(ValueError, match="attention must be one of auto, sdpa, flex, varlen"):
        packed_forward(model, batch, attention="flash")


def test_installed_kernel_is_described():
    kernel = varlen_function()
    if kernel is None:
        pytest.skip("no varlen kernel installed")
    assert kernel.device_types == ("cuda",) and set(kernel.dtypes) == {torch.float16, torch.bfloat16}
    assert kernel.name in ("torch.nn.attention.varlen.varlen_attn", "flash_attn.flash_attn_varlen_func")
    assert isinstance(varlen_segments(torch.zeros(1, 2, dtype=torch.long), 1), VarlenSegments)


# ---------------------------------------------------------------------------------------------------- CUDA

# bf16 has 8 significant bits (2^-8 relative rounding); a depth-2 tiny ViT's logits are O(1) and gather a few dozen
# bf16 roundings in matmuls and softmax, partly cancelling: a few times 2^-8 of the logit scale. SDPA and varlen
# under the same autocast differ only in the attention kernels' accumulation order, so the bound is that of two bf16
# runs: 3e-2 absolute on O(1) logits; gradients in relative norm, 5e-2 over all parameters (twice that for each
# parameter holding at least 1 % of the gradient's norm: smaller ones are all rounding).
BF16_ATOL = 3e-2
BF16_GRAD = 5e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("pe", ["axial", "mixed", "cayley", "tensor", "comrope-ld"])
def test_varlen_on_cuda_equals_each_image_alone(pe):
    if varlen_function() is None:
        pytest.skip("no varlen kernel installed")
    torch.manual_seed(0)
    for cls in ("none", "unrotated"):
        model = _model(pe, cls).cuda()
        imgs = [im.cuda() for im in _images(6)]
        batch = pack([patchify(im.cpu(), 4, label=i) for i, im in enumerate(imgs)], max_tokens=24).to("cuda")
        w = torch.randn(len(imgs), 3, device="cuda")
        torch.cuda.set_sync_debug_mode("error")  # the varlen layout is built without a host synchronisation
        try:
            segs = varlen_segments(batch.segment_ids, batch.image_index.shape[1])
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert segs.cu_seqlens.is_cuda and segs.max_seqlen == batch.segment_ids.shape[1]
        grads = []
        outs = []
        for run in ("varlen", "alone"):
            model.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = packed_forward(model, batch, attention="varlen") if run == "varlen" else \
                    torch.cat([model(im[None]) for im in imgs])
            (out.float() * w).sum().backward()
            outs.append(out.float())
            grads.append({n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None})
        assert torch.isfinite(outs[0]).all()
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=BF16_ATOL)
        assert grads[0].keys() == grads[1].keys()
        flat = [torch.cat([g[n].flatten() for n in sorted(g)]) for g in grads]
        total = float(flat[1].norm())
        assert float((flat[0] - flat[1]).norm()) <= BF16_GRAD * total, (pe, cls)
        for name in grads[0]:  # each parameter that carries a visible share of the gradient, to twice the bound
            a, b = grads[0][name], grads[1][name]
            if float(b.norm()) >= 0.01 * total:
                assert float((a - b).norm()) <= 2 * BF16_GRAD * float(b.norm()), (pe, cls, name)


def test_autocast_dtype_and_head_width_decide(monkeypatch):
    """Under autocast the kernel gets q / k / v in the autocast dtype (as SDPA casts them); a head width that is not
    a multiple of 8 (or wider than the kernel takes) falls back to SDPA under ``auto`` and is refused by
    ``varlen``."""
    seen = []

    def kernel_fn(q, k, v, cu, max_len, scale, dropout_p):
        seen.append((q.dtype, k.dtype, v.dtype))
        return _reference_kernel(q.double(), k.double(), v.double(), cu, max_len, scale, dropout_p).to(q.dtype)

    kernel = VarlenKernel("reference-bf16", kernel_fn, device_types=("cpu",), dtypes=(torch.bfloat16,))
    monkeypatch.setattr(masks, "varlen_function", lambda: kernel)
    g = torch.Generator().manual_seed(1)
    seg = torch.tensor([[0, 0, 1, 1, 1, -1]])
    q, k, v = torch.randn(3, 1, 2, 6, 8, generator=g)
    segs = varlen_segments(seg, 2, mode="auto")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = masked_attention(q, k, v, segs, scale=0.5)
    assert seen == [(torch.bfloat16,) * 3] and out.dtype == torch.bfloat16
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=segment_mask(seg), scale=0.5)
    assert (out.float() - want).abs().max() <= 4 * 2.0 ** -8 * want.abs().max()  # bf16 inputs, O(1) values
    seen.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        masked_attention(q[..., :6], k[..., :6], v, segs)  # head 6: not a multiple of 8, SDPA
        assert not seen
        with pytest.raises(ValueError, match="heads of a multiple of 8 up to 256; got cpu bfloat16, head 6"):
            masked_attention(q[..., :6], k[..., :6], v, segs._replace(mode="varlen"))
    with pytest.raises(ValueError, match="got cpu float32, head 8"):  # no autocast: float32 is not taken
        masked_attention(q, k, v, segs._replace(mode="varlen"))
