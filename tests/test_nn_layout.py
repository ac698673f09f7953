"""The residual stream of the ViT stays in the (B, N, D) memory layout (a transposed layout makes every residual
add and LayerNorm of an eager training step slower on a GPU)."""

import torch

from ropekit.nn import VisionTransformer, vit_config


def test_residual_stream_is_contiguous():
    for pe, extra in (("absolute", {}), ("none", {}), ("axial", {"cls": "unrotated"})):
        m = VisionTransformer(vit_config("tiny", num_classes=3, in_chans=3, image_size=(32, 32), patch_size=8, pe=pe,
                                         **extra))
        tokens, coords, prefix = m.embed(torch.randn(2, 3, 32, 32))
        assert tokens.is_contiguous()
        assert m.blocks[0](tokens, coords, prefix).is_contiguous()
