"""Two-tower image-text models: the SigLIP sigmoid loss, retrieval recall and the model.

Shape legend: ``B`` pairs in a batch, ``N`` images, ``T`` texts, ``E`` the joint embedding width, ``L`` the text
context.

* :func:`siglip_loss` -- the pairwise sigmoid loss of SigLIP (Zhai et al., 2023): every image-text pair of a batch
  is a binary problem, positive for matching pairs, with logits ``exp(t) * <x_i, y_j> + b`` of unit-norm
  embeddings and a learnable temperature ``t`` and bias ``b``.
* :func:`retrieval_recall` -- image->text and text->image recall@k, with an explicit rule for ties and for texts
  that are equal.
* :class:`DualEncoder` -- a vision tower (:class:`~ropekit.nn.VisionTransformer`, RGB or RGB-D) and a text tower
  (:class:`~ropekit.nn.TextTransformer`), each pooled and linearly projected to ``E``, then L2-normalised.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn import TextTransformer, VisionTransformer

__all__ = ["siglip_loss", "retrieval_recall", "recall_ranks", "DualEncoder", "RECALL_KS"]

RECALL_KS: Tuple[int, ...] = (1, 5, 10)


def siglip_loss(image_emb: Tensor, text_emb: Tensor, logit_scale: Tensor, logit_bias: Tensor,
                positives: Optional[Tensor] = None) -> Tensor:
    """SigLIP's sigmoid loss of a batch, summed over its ``B x B`` pairs and divided by ``B``.

    ``L = -(1/B) sum_ij log sigmoid(z_ij (exp(t) <x_i, y_j> + b))`` with ``z_ij = +1`` for a matching pair and
    ``-1`` otherwise; computed in float32 (or float64 for float64 inputs).

    Args:
        image_emb: ``(B, E)`` unit-norm image embeddings ``x_i``.
        text_emb: ``(B, E)`` unit-norm text embeddings ``y_j``.
        logit_scale: scalar ``t`` (the temperature is ``exp(t)``; SigLIP starts at ``t = log 10``).
        logit_bias: scalar ``b`` (SigLIP starts at ``-10``).
        positives: optional bool ``(B, B)``, which pairs match (default the diagonal). Two texts of a batch that are
            equal make both of their images positives for both.

    Returns:
        A scalar.
    """
    if image_emb.shape != text_emb.shape or image_emb.dim() != 2:
        raise ValueError(f"image and text embeddings must both be (B, E), got {tuple(image_emb.shape)} and "
                         f"{tuple(text_emb.shape)}")
    dtype = torch.float64 if image_emb.dtype == torch.float64 else torch.float32
    x, y = image_emb.to(dtype), text_emb.to(dtype)
    logits = x @ y.T * logit_scale.to(dtype).exp() + logit_bias.to(dtype)  # (B, B)
    b = x.shape[0]
    if positives is None:
        positives = torch.eye(b, dtype=torch.bool, device=x.device)
    signs = positives.to(dtype) * 2 - 1  # (B, B): +1 matching, -1 not
    return -F.logsigmoid(signs * logits).sum() / b


def recall_ranks(scores: Tensor, relevant: Tensor) -> Tensor:
    """For each query (row), how many irrelevant items score at least as high as its best relevant item.

    A tie between a relevant and an irrelevant item counts against the query (the pessimistic rule), so a model
    that scores everything equally gets no credit. Recall@k of a query is ``rank < k``.

    Args:
        scores: ``(Q, C)`` query-candidate similarities.
        relevant: bool ``(Q, C)``, at least one ``True`` per row.

    Returns:
        int64 ``(Q,)``.
    """
    if not bool(relevant.any(1).all()):
        raise ValueError("every query needs at least one relevant candidate")
    best = torch.where(relevant, scores, torch.full_like(scores, -float("inf"))).max(1, keepdim=True).values
    return ((scores >= best) & ~relevant).sum(1)


def retrieval_recall(image_emb: Tensor, text_emb: Tensor, text_ids: Optional[Sequence] = None,
                     ks: Sequence[int] = RECALL_KS, chunk: int = 1024) -> Dict[str, float]:
    """Image->text and text->image recall@k of ``N`` paired images and texts (pair ``i`` matches).

    Relevance: text ``j`` is a right answer for image ``i`` when it is *equal* to text ``i`` (``text_ids[j] ==
    text_ids[i]``; by default only ``j = i``) -- a caption shared by two scenes is right for both -- and likewise
    image ``j`` is a right answer for text ``i`` when text ``j`` equals text ``i``. Scores are dot products; ties
    count against the query (:func:`recall_ranks`).

    Args:
        image_emb, text_emb: ``(N, E)``.
        text_ids: ``N`` hashable keys of the texts (e.g. the caption strings) marking equal texts.
        ks: the ``k`` of recall@k.
        chunk: queries scored at once (memory ``chunk x N``).

    Returns:
        ``{"i2t_r1", "i2t_r5", ..., "t2i_r1", ..., "mean_recall"}`` as fractions in [0, 1]; ``mean_recall`` is the
        mean of the ``2 * len(ks)`` recalls (the STRING paper's summary number, there in percent).
    """
    n = image_emb.shape[0]
    if text_emb.shape[0] != n or n == 0:
        raise ValueError(f"need N > 0 paired images and texts, got {n} and {text_emb.shape[0]}")
    if text_ids is None:
        key = torch.arange(n)
    else:
        if len(text_ids) != n:
            raise ValueError(f"text_ids must have {n} entries, got {len(text_ids)}")
        codes: Dict[object, int] = {}
        key = torch.as_tensor([codes.setdefault(t, len(codes)) for t in text_ids])
    key = key.to(image_emb.device)
    out: Dict[str, float] = {}
    for name, (q, c) in {"i2t": (image_emb, text_emb), "t2i": (text_emb, image_emb)}.items():
        ranks = []
        for s in range(0, n, chunk):
            scores = q[s:s + chunk].float() @ c.float().T  # (chunk, N)
            relevant = key[s:s + chunk, None] == key[None, :]  # (chunk, N)
            ranks.append(recall_ranks(scores, relevant))
        r = torch.cat(ranks)
        for k in ks:
            out[f"{name}_r{k}"] = float((r < k).float().mean())
    out["mean_recall"] = sum(out.values()) / len(out)
    return out


class DualEncoder(nn.Module):
    """A vision tower and a text tower projected into one ``E``-dimensional space (unit-norm embeddings), with
    SigLIP's learnable logit scale ``t`` (init ``log 10``) and bias ``b`` (init ``-10``).

    Args:
        vision: a :class:`VisionTransformer` built with ``num_classes=0`` (its forward returns pooled features).
        text: a :class:`TextTransformer`.
        embed_dim: ``E``.
        logit_scale_init, logit_bias_init: the initial ``t`` and ``b``.
    """

    def __init__(self, vision: VisionTransformer, text: TextTransformer, embed_dim: int = 64,
                 logit_scale_init: float = math.log(10.0), logit_bias_init: float = -10.0) -> None:
        super().__init__()
        if getattr(vision.cfg, "num_classes", 0) != 0:
            raise ValueError("the vision tower must be built with num_classes=0 (pooled features)")
        self.vision, self.text = vision, text
        self.vision_proj = nn.Linear(vision.cfg.embed_dim, embed_dim, bias=False)
        self.text_proj = nn.Linear(text.embed_dim, embed_dim, bias=False)
        nn.init.xavier_uniform_(self.vision_proj.weight)
        nn.init.xavier_uniform_(self.text_proj.weight)
        self.logit_scale = nn.Parameter(torch.tensor(float(logit_scale_init)))
        self.logit_bias = nn.Parameter(torch.tensor(float(logit_bias_init)))

    def no_weight_decay(self) -> set:
        """Both towers' no-decay names (encodings, depth lift, tables), the scale and the bias."""
        names = {"logit_scale", "logit_bias"}
        names |= {f"vision.{n}" for n in self.vision.no_weight_decay()}
        names |= {f"text.{n}" for n in self.text.no_weight_decay()}
        return names

    def encode_image(self, images: Tensor) -> Tensor:
        """``(B, C, H, W)`` or RGB-D ``(B, C + 1, H, W)`` -> unit-norm ``(B, E)``."""
        return F.normalize(self.vision_proj(self.vision(images)).float(), dim=-1)

    def encode_text(self, ids: Tensor) -> Tensor:
        """Token ids ``(B, L)`` -> unit-norm ``(B, E)``."""
        return F.normalize(self.text_proj(self.text(ids)).float(), dim=-1)

    def forward(self, images: Tensor, ids: Tensor) -> Tuple[Tensor, Tensor]:
        """``(image_emb (B, E), text_emb (B, E))``."""
        return self.encode_image(images), self.encode_text(ids)
