"""Streaming video with a KV cache: each key is encoded once, when its frames arrive, and reused ever after.

Shape legend: ``B`` batch, ``C`` channels, ``T`` frames, ``tt`` frames per tubelet, ``H, W`` pixels, ``gh, gw``
the patch grid, ``m = gh * gw`` tokens per tubelet step, ``N`` tokens so far, ``D`` width, ``Hh`` heads, ``d`` head
dimension, ``d'`` the encoded key width (``pe.out_dim``).

A rotary encoding is separable: a key ``R(r_j) k_j`` depends on its own coordinate only, so it can be encoded
when its tubelet arrives and cached; later queries ``R(r_i) q_i`` meet it unchanged. With a commuting encoding the
logit depends on ``r_j - r_i`` only, so nothing cached ever has to be recomputed as the clip grows (an absolute
table resized to the clip length would have to be).

Streaming needs attention that does not look ahead: token ``i`` attends to token ``j`` iff ``t_j <= t_i``
(*frame-causal*: all tokens of the same and of earlier tubelets). :func:`video_features` runs a whole clip with
that mask (or without it, ``causal=False``, which is exactly the model's own ``forward_features``);
:class:`VideoStream` feeds the same model one tubelet at a time and returns, step by step, the same tokens.

Works with a ``ropekit.nn.VisionTransformer`` for video (``modality="video"``) with mean pooling (``cls="none"``),
``"grid"`` coordinates (the time index of a tubelet must not depend on the clip length) and no learned absolute
table (``ape`` ``"none"`` or ``"sincos"``). Call ``model.eval()`` first (jitter and dropout are training-only).

Example::

    stream = VideoStream(model)
    for t in range(0, clip.shape[2], model.cfg.tubelet_size):
        tokens = stream.step(clip[:, :, t:t + model.cfg.tubelet_size])   # (B, m, D) for the new tubelet
        logits = stream.logits()                                       # online prediction so far
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.coords import grid_coords
from ..nn.embed import SinCosPosEmbed

__all__ = ["VideoStream", "video_features", "frame_causal_mask", "check_streamable"]


def check_streamable(model: nn.Module) -> None:
    """Raise ``ValueError`` unless ``model`` is a video ViT that can be streamed (see the module docstring)."""
    cfg = getattr(model, "cfg", None)
    if cfg is None or getattr(cfg, "modality", None) != "video":
        raise ValueError("streaming needs a ropekit.nn.VisionTransformer built with modality='video'")
    if cfg.cls != "none":
        raise ValueError(f"streaming needs mean pooling (cls='none'), got cls={cfg.cls!r}")
    if cfg.coords != "grid":
        raise ValueError("streaming needs coords='grid': normalised time coordinates depend on the clip length")
    if cfg.ape_kind == "learned":
        raise ValueError("streaming cannot use a learned absolute table (it is resized to the clip length); "
                         "use a rotary encoding, optionally with ape='sincos'")


def frame_causal_mask(num_steps: int, tokens_per_step: int, device=None) -> Tensor:
    """``(N, N)`` bool, ``N = num_steps * tokens_per_step``: ``True`` where query ``i`` may attend to key ``j``
    (``step(j) <= step(i)``); tokens are ordered step-major (as ``TubeletEmbed`` flattens ``(gt, gh, gw)``)."""
    step = torch.arange(num_steps * tokens_per_step, device=device) // tokens_per_step  # (N,)
    return step[None, :] <= step[:, None]


def _attend(blk: nn.Module, x: Tensor, coords: Optional[Tensor], past: Optional[Tuple[Tensor, Tensor]],
            mask: Optional[Tensor]) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
    """One pre-norm block on new tokens ``x`` ``(B, m, D)`` attending to ``past`` keys/values and themselves.

    Returns the block output ``(B, m, D)`` and this block's cache ``(keys (B, Hh, N, d'), values (B, Hh, N, d))``.
    """
    attn = blk.attn
    b, m, dim = x.shape
    h = blk.norm1(x)
    # grouped-query layers: each group's key and value rows once per query head (as Attention.forward computes)
    qkv = attn.qkv(h) if attn.num_kv_heads == attn.num_heads else F.linear(h, *attn.expanded_qkv())  # (B, m, 3D)
    qkv = qkv.reshape(b, m, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)  # (3, B, Hh, m, d)
    q, k, v = qkv.unbind(0)  # (B, Hh, m, d) each
    if attn.pe is not None:
        q = attn.pe.rotate(q, coords)  # (B, Hh, m, d')
        k = attn.pe.rotate(k, coords)  # encoded once, here, then cached
    if past is not None:
        k = torch.cat([past[0], k], dim=2)  # (B, Hh, N, d')
        v = torch.cat([past[1], v], dim=2)  # (B, Hh, N, d)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scale)  # (B, Hh, m, d)
    out = attn.proj_drop(attn.proj(out.transpose(1, 2).reshape(b, m, dim)))  # (B, m, D)
    x = x + blk.drop_path(out)
    x = x + blk.drop_path(blk.mlp(blk.norm2(x)))
    return x, (k, v)


def video_features(model: nn.Module, clip: Tensor, causal: bool = True) -> Tensor:
    """All normalised tokens ``(B, N, D)`` of ``clip`` ``(B, C, T, H, W)`` in one pass.

    ``causal=True`` uses the frame-causal mask (the reference that :class:`VideoStream` reproduces step by step);
    ``causal=False`` is the model's own bidirectional ``forward_features``.
    """
    check_streamable(model)
    tokens, coords, num_prefix = model.embed(clip)  # (B, N, D), (N, 3) or None, 0
    gt = clip.shape[2] // model.cfg.tubelet_size
    mask = frame_causal_mask(gt, tokens.shape[1] // gt, tokens.device) if causal else None
    for blk in model.blocks:
        tokens, _ = _attend(blk, tokens, coords, None, mask)
    return model.norm(tokens)


class VideoStream:
    """Feed a video ViT one tubelet (``tubelet_size`` frames) at a time, with a per-block KV cache.

    ``step(frames)`` returns the new tokens ``(B, m, D)`` -- equal to the matching rows of
    ``video_features(model, whole_clip)`` -- and :meth:`logits` the mean-pooled prediction over everything seen.
    Memory grows with the number of tokens seen (``2 * depth`` tensors of ``(B, Hh, N, d)``); :meth:`reset` starts
    a new clip.
    """

    def __init__(self, model: nn.Module) -> None:
        check_streamable(model)
        self.model = model
        self.reset()

    def reset(self) -> None:
        self.cache: List[Optional[Tuple[Tensor, Tensor]]] = [None] * len(self.model.blocks)
        self.steps = 0
        self.grid: Optional[Tuple[int, int]] = None
        self._sum: Optional[Tensor] = None  # running sum of output tokens (B, D)
        self._count = 0

    @property
    def num_tokens(self) -> int:
        """Tokens seen so far (``N``)."""
        return 0 if self.cache[0] is None else self.cache[0][0].shape[2]

    @torch.no_grad()
    def step(self, frames: Tensor) -> Tensor:
        """Process the next ``(B, C, tubelet_size, H, W)`` frames; return their tokens ``(B, m, D)`` (normalised)."""
        model, cfg = self.model, self.model.cfg
        if frames.dim() != 5 or frames.shape[2] != cfg.tubelet_size:
            raise ValueError(f"step takes (B, C, {cfg.tubelet_size}, H, W) frames (one tubelet), "
                             f"got {tuple(frames.shape)}")
        tokens, grid = model.patch_embed(frames)  # (B, m, D), (1, gh, gw)
        if self.grid is None:
            self.grid = tuple(grid[1:])
        elif tuple(grid[1:]) != self.grid:
            raise ValueError(f"frame size changed mid-stream: patch grid {tuple(grid[1:])}, was {self.grid}")
        coords = grid_coords(grid, "grid", device=tokens.device)  # (m, 3) = (t, y, x) with t = 0
        coords[:, 0] += self.steps  # the tubelet's time index
        if isinstance(model.ape, SinCosPosEmbed):
            from ..nn.embed import sincos_pos_embed

            tokens = tokens + sincos_pos_embed(coords, tokens.shape[-1], model.ape.temperature).to(tokens.dtype)
        for i, blk in enumerate(model.blocks):
            tokens, self.cache[i] = _attend(blk, tokens, coords if blk.attn.pe is not None else None,
                                            self.cache[i], None)
        out = model.norm(tokens)  # (B, m, D)
        self.steps += 1
        total = out.sum(dim=1)  # (B, D)
        self._sum = total if self._sum is None else self._sum + total
        self._count += out.shape[1]
        return out

    @torch.no_grad()
    def logits(self) -> Tensor:
        """The classifier on the mean of every token seen so far: ``(B, K)``."""
        if self._sum is None:
            raise RuntimeError("no frames yet: call step() first")
        return self.model.head(self._sum / self._count)
