"""Transformer building blocks that take any ``create_pe`` encoding: attention, ViT / ViTD / video ViT, a text tower.

>>> from ropekit.nn import VisionTransformer, vit_config
>>> model = VisionTransformer(vit_config("tiny", num_classes=10, in_chans=1, pe="cayley"))
>>> logits = model(torch.rand(8, 1, 28, 28))                       # doctest: +SKIP
"""

from .attention import Attention, PreparedPE
from .coords import COORD_MODES, centroid, grid_coords, jitter_coords, patch_units
from .depth import DepthLift, patch_mean_depth, valid_depth_mask
from .linear_attention import LinearAttention
from .text import TextConfig, TextTransformer
from .embed import LearnedPosEmbed, PatchEmbed, SinCosPosEmbed, TubeletEmbed, sincos_pos_embed
from .vit import (ABSOLUTE_PES, PAPER_SHARING, VIT_SIZES, Block, DropPath, Mlp, ViTConfig, VisionTransformer,
                  build_encodings, vit_config)

__all__ = [
    "Attention", "PreparedPE", "LinearAttention", "VisionTransformer", "ViTConfig", "VIT_SIZES", "ABSOLUTE_PES",
    "PAPER_SHARING", "vit_config", "build_encodings",
    "Block", "Mlp", "DropPath", "PatchEmbed", "TubeletEmbed", "LearnedPosEmbed", "SinCosPosEmbed",
    "sincos_pos_embed", "DepthLift", "patch_mean_depth", "valid_depth_mask", "COORD_MODES", "grid_coords",
    "patch_units", "jitter_coords", "centroid", "TextConfig", "TextTransformer",
]
