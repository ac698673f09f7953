"""A small text transformer with ropekit's own 1-D rotary positions: the text tower of a contrastive model.

Shape legend: ``B`` texts, ``L`` context length (tokens, padded at the end), ``D`` width, ``V`` vocabulary size.

>>> from ropekit.data.text import Tokenizer                                      # doctest: +SKIP
>>> tok = Tokenizer()
>>> tower = TextTransformer(TextConfig(vocab_size=tok.vocab_size, context_length=tok.context_length))
>>> emb = tower(tok(["a big red 3", "a small blue square"]))                    # (2, D) pooled embeddings

Token ``i`` has the 1-D coordinate ``i`` (``(L, 1)`` coordinates for a ``create_pe`` encoding with
``coord_dim = 1``; ``"axial"`` is classic RoPE). The tower always runs on ``context_length`` tokens -- shorter
inputs are padded with ``pad_id`` -- so a text's embedding never depends on the other texts of its batch.
Padding tokens take part in attention as ordinary tokens (ropekit's attention has no mask: with relative
positions and padding at the end they only tell the model the text's length); the pooled embedding is the mean
of the final-norm outputs over the non-padding tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import torch
from torch import Tensor, nn

from ..encodings import PositionEncoding, create_pe, list_pes
from .vit import Block, init_linear_layers

__all__ = ["TextConfig", "TextTransformer"]


@dataclass
class TextConfig:
    """A :class:`TextTransformer`.

    Attributes:
        vocab_size: ``V`` (ids ``0..V-1``; ``pad_id`` is padding).
        context_length: ``L``, the most tokens a text may have.
        embed_dim, depth, num_heads, mlp_ratio: the transformer (``embed_dim / num_heads`` even).
        pe: a ``create_pe`` name built with ``coord_dim=1`` (default ``"axial"``: RoPE), ``"absolute"`` (a learned
            position table added to the token embeddings, no rotary encoding) or ``"none"``.
        pe_options: keyword options of the encoding.
        pad_id: the padding id (left out of the pooled mean).
    """

    vocab_size: int
    context_length: int = 32
    embed_dim: int = 96
    depth: int = 2
    num_heads: int = 2
    mlp_ratio: float = 2.0
    pe: str = "axial"
    pe_options: Dict[str, Any] = field(default_factory=dict)
    pad_id: int = 0

    def validate(self) -> "TextConfig":
        """One-line ``ValueError`` for a bad setting."""
        for name in ("vocab_size", "context_length", "embed_dim", "depth", "num_heads"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"text tower: {name} must be a positive integer, got {getattr(self, name)!r}")
        if self.embed_dim % self.num_heads or (self.embed_dim // self.num_heads) % 2:
            raise ValueError(f"text tower: embed_dim / num_heads must be an even integer, got {self.embed_dim} / "
                             f"{self.num_heads}")
        if self.pe not in ("absolute", "none") and self.pe not in list_pes():
            raise ValueError(f"text tower: unknown pe {self.pe!r}; known: absolute, none, {', '.join(list_pes())}")
        if not 0 <= self.pad_id < self.vocab_size:
            raise ValueError(f"text tower: pad_id {self.pad_id} is not an id of the vocabulary")
        return self

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


class TextTransformer(nn.Module):
    """Token embedding, ``depth`` pre-norm blocks with a 1-D position encoding shared by the layers, a final norm,
    and the mean over non-padding tokens: ids ``(B, L')`` int64 -> ``(B, D)`` (``L' <= L``)."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.cfg = cfg = cfg.validate()
        dim = cfg.embed_dim
        self.token_embed = nn.Embedding(cfg.vocab_size, dim)
        self.pos_table = nn.Parameter(torch.zeros(cfg.context_length, dim)) if cfg.pe == "absolute" else None
        pe: Optional[PositionEncoding] = None
        if cfg.pe not in ("absolute", "none"):
            pe = create_pe(cfg.pe, head_dim=dim // cfg.num_heads, coord_dim=1, num_heads=cfg.num_heads,
                           **cfg.pe_options)
        self.blocks = nn.ModuleList([Block(dim, cfg.num_heads, pe, cfg.mlp_ratio) for _ in range(cfg.depth)])
        self.norm = nn.LayerNorm(dim)
        # (L, 1) positions as int64: a model cast (.to(torch.bfloat16)) leaves them exact (bf16 holds integers only
        # up to 256); the encodings form their angles from them in float64
        self.register_buffer("coords", torch.arange(cfg.context_length, dtype=torch.int64)[:, None], persistent=False)
        self.reset_parameters()

    @property
    def embed_dim(self) -> int:
        return self.cfg.embed_dim

    def reset_parameters(self) -> None:
        """Token embedding and position table normal(0.02), linear layers xavier-uniform (q, k and v each as its own
        square matrix) with zero biases, norms at ones / zeros; the encoding keeps its own initialisation."""
        nn.init.normal_(self.token_embed.weight, std=0.02)
        if self.pos_table is not None:
            nn.init.normal_(self.pos_table, std=0.02)
        for blk in self.blocks:
            blk.reset_parameters()
        self.norm.reset_parameters()
        init_linear_layers(self)

    def no_weight_decay(self) -> set:
        """The position table's and the encoding's parameter names (as in ``named_parameters()``)."""
        names = {"pos_table"} if self.pos_table is not None else set()
        for i, blk in enumerate(self.blocks):
            names |= {f"blocks.{i}.{n}" for n in blk.no_weight_decay()}
        return names

    def forward_features(self, ids: Tensor) -> Tensor:
        """Final-norm token features ``(B, L, D)`` of ids ``(B, L')``, padded to ``L``."""
        if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"text ids must be an integer (B, L) tensor, got {ids.dtype} {tuple(ids.shape)}")
        b, length = ids.shape
        cap = self.cfg.context_length
        if length > cap:
            raise ValueError(f"text of {length} tokens is longer than the tower's context of {cap}")
        if length < cap:
            ids = torch.cat([ids, ids.new_full((b, cap - length), self.cfg.pad_id)], dim=1)  # (B, L)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.cfg.vocab_size):
            raise ValueError(f"text ids must lie in [0, {self.cfg.vocab_size}), got "
                             f"[{int(ids.min())}, {int(ids.max())}]")
        x = self.token_embed(ids)  # (B, L, D)
        if self.pos_table is not None:
            x = x + self.pos_table.to(x.dtype)
        pe = self.blocks[0].attn.pe
        state = self.blocks[0].attn.prepare(self.coords, 0, x.dtype) if pe is not None else None
        for blk in self.blocks:
            x = blk(x, self.coords if pe is not None else None, 0, state)
        return self.norm(x)

    def forward(self, ids: Tensor) -> Tensor:
        """Pooled text embeddings ``(B, D)``: the mean of the token features over non-padding tokens (a text of
        padding only is refused)."""
        feats = self.forward_features(ids)  # (B, L, D)
        keep = torch.zeros(feats.shape[:2], dtype=feats.dtype, device=feats.device)  # (B, L)
        keep[:, : ids.shape[1]] = (ids != self.cfg.pad_id).to(feats.dtype)
        count = keep.sum(1, keepdim=True)  # (B, 1)
        if bool((count == 0).any()):
            raise ValueError("a text of padding only has no tokens to pool (an empty caption?)")
        return (feats * keep[..., None]).sum(1) / count  # (B, D)
