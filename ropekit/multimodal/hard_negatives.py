"""Depth relations tested directly: each test caption that states a depth relation ("in front of" / "behind")
against the same caption with the relation flipped, the hard negative. A model that reads depth order ranks the
true caption higher for the image; one that reads only objects, colours and sizes cannot tell the two apart, so
its accuracy sits at chance (0.5), which the RGB-only towers must show -- unless 2-D cues (apparent size, height,
occlusion) give the depth order away, which the depth-only scenes of :mod:`ropekit.data.captioned` remove.

:func:`flip_depth_relation` makes the negative, :func:`depth_relation_share` and :func:`depth_relation_counts`
count the captions that carry a depth relation, :func:`pairwise_accuracy` scores the comparison and
:func:`depth_hard_negative_accuracy` runs it for a :class:`~ropekit.multimodal.retrieval.DualEncoder` (anything
with ``encode_image`` / ``encode_text``).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["flip_depth_relation", "depth_relation_share", "depth_relation_counts", "pairwise_accuracy",
           "depth_hard_negative_accuracy"]

_FRONT = ["in", "front", "of"]


def flip_depth_relation(words: Sequence[str]) -> Optional[List[str]]:
    """The caption (a list of words) with its depth relation flipped (``in front of`` <-> ``behind``), or
    ``None`` when it states none. A caption states at most one relation (:mod:`ropekit.data.captioned`); two
    depth relations are an error."""
    w = list(words)
    hits = [i for i in range(len(w)) if w[i:i + 3] == _FRONT] + [i for i, x in enumerate(w) if x == "behind"]
    if not hits:
        return None
    if len(hits) > 1:
        raise ValueError(f"caption states {len(hits)} depth relations: {' '.join(w)!r}")
    i = hits[0]
    if w[i] == "behind":
        return w[:i] + _FRONT + w[i + 1:]
    return w[:i] + ["behind"] + w[i + 3:]


def depth_relation_share(captions: Sequence[Sequence[str]]) -> float:
    """The fraction of ``captions`` that state a depth relation (0 for no captions)."""
    return sum(flip_depth_relation(c) is not None for c in captions) / len(captions) if captions else 0.0


def depth_relation_counts(captions: Sequence[Sequence[Sequence[str]]], num_objects: Sequence[int]
                          ) -> Dict[str, int]:
    """How many captions state a depth relation: ``captions`` per scene (lists of captions, each a list of
    words), ``num_objects`` per scene. Returns ``{"captions", "depth", "multi_object", "multi_object_depth"}``:
    all captions, those with a depth relation, those of scenes with two or more objects (the only ones that can
    state a relation) and those of them with a depth relation."""
    if len(captions) != len(num_objects):
        raise ValueError(f"{len(captions)} caption lists but {len(num_objects)} object counts")
    out = {"captions": 0, "depth": 0, "multi_object": 0, "multi_object_depth": 0}
    for caps, k in zip(captions, num_objects):
        for c in caps:
            d = int(flip_depth_relation(c) is not None)
            out["captions"] += 1
            out["depth"] += d
            if int(k) >= 2:
                out["multi_object"] += 1
                out["multi_object_depth"] += d
    return out


def pairwise_accuracy(image_emb: Tensor, true_emb: Tensor, negative_emb: Tensor) -> Tensor:
    """Per row ``i``: 1 when ``<image_i, true_i> > <image_i, negative_i>``, 0.5 on a tie, 0 otherwise; float
    ``(N,)`` from three ``(N, E)`` embeddings (unit-norm in a DualEncoder, so the dot product is its cosine)."""
    if not (image_emb.shape == true_emb.shape == negative_emb.shape) or image_emb.dim() != 2:
        raise ValueError(f"expected three (N, E) embeddings of one shape, got {tuple(image_emb.shape)}, "
                         f"{tuple(true_emb.shape)}, {tuple(negative_emb.shape)}")
    t = (image_emb * true_emb).sum(-1)
    n = (image_emb * negative_emb).sum(-1)
    return (t > n).float() + 0.5 * (t == n).float()


@torch.no_grad()
def depth_hard_negative_accuracy(model: Any, tokenizer: Callable[[Sequence[str]], Tensor], images: Tensor,
                                 captions: Sequence[Sequence[Sequence[str]]], *, batch_size: int = 256
                                 ) -> Dict[str, Any]:
    """Score every caption with a depth relation against its flipped twin. ``images``: ``(N, C, H, W)`` as the
    model's vision tower takes them (the caller prepares them as the evaluation does: normalised, RGB or RGB-D);
    ``captions``: ``N`` lists of captions (lists of words); ``tokenizer(texts) -> (B, L)`` ids. Returns
    ``{"accuracy", "n", "share", "per_caption"}`` (accuracy ``nan`` when no caption carries a depth relation;
    chance is 0.5)."""
    if images.shape[0] != len(captions):
        raise ValueError(f"{images.shape[0]} images but {len(captions)} caption lists")
    pairs = [(i, c, flip_depth_relation(c)) for i, cs in enumerate(captions) for c in cs]
    share = sum(neg is not None for _, _, neg in pairs) / len(pairs) if pairs else 0.0
    pairs = [(i, c, neg) for i, c, neg in pairs if neg is not None]
    if not pairs:
        return {"accuracy": float("nan"), "n": 0, "share": share, "per_caption": []}
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    scores: List[Tensor] = []
    try:
        for s in range(0, len(pairs), batch_size):
            chunk = pairs[s:s + batch_size]
            idx = torch.tensor([i for i, _, _ in chunk], device=images.device)
            img = model.encode_image(images[idx])
            pos = model.encode_text(tokenizer([" ".join(c) for _, c, _ in chunk]).to(img.device))
            neg = model.encode_text(tokenizer([" ".join(n) for _, _, n in chunk]).to(img.device))
            scores.append(pairwise_accuracy(img, pos, neg).cpu())
    finally:
        if was_training and hasattr(model, "train"):
            model.train()
    per = torch.cat(scores)
    return {"accuracy": float(per.mean()), "n": int(per.numel()), "share": share, "per_caption": per.tolist()}
