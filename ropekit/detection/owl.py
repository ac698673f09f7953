"""Open-vocabulary detection after OWL-ViT: every output token of a vision tower predicts a box and a class
embedding that is compared with the text embeddings of the queries.

OWL-ViT (Minderer et al., 2022) removes the pooling of a contrastively trained image tower; each output token
then makes one prediction:

* a **class embedding** (a linear map of the token into the text tower's embedding space), L2-normalised and
  compared with the normalised query embeddings by a dot product, then shifted and scaled per token:
  ``logit = (cos + shift(x)) · (elu(scale(x)) + 1)`` with ``shift`` and ``scale`` two linear maps of the token
  (OWL-ViT's learned per-token logit shift and scale);
* a **box** from a 3-layer MLP.  In 2-D it is ``sigmoid(mlp(x) + b)`` in normalised ``(cx, cy, w, h)``
  (image width and height are 1), where the bias ``b`` is the inverse sigmoid of the token's patch centre and
  patch size, so every token's default box is its own patch.  In 3-D (the STRING paper's open-vocabulary 3-D
  boxes) it is the 12-vector box of :mod:`ropekit.detection.boxes` in the camera frame from the 3-D detector's
  box head (:class:`~ropekit.detection.model.BoxHead`, the token's viewing ray and the intrinsics features of
  :class:`~ropekit.detection.model.Detector3D`).

Training matches the ``M`` token predictions of an image to its objects with the Hungarian algorithm (scipy's
``linear_sum_assignment``) on the cost ``w_cls · focal + w_box · L1 + w_giou · (−GIoU)`` (3-D: ``w_corner ·
corner L1`` instead of the GIoU term); the loss is the sigmoid focal loss over every token × query (matched
pairs positive, everything else negative), plus L1 and generalised IoU (3-D: L1 and corner L1) over the matched
pairs, each divided by the number of objects in the batch (:func:`owl_loss`).

Shape legend: ``B`` images, ``M`` tokens (= predictions per image), ``D`` vision width, ``E`` text embedding
width, ``Q`` queries, ``T`` padded objects per image.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchvision.ops import box_convert, generalized_box_iou, generalized_box_iou_loss, sigmoid_focal_loss

from ..nn import VisionTransformer
from .boxes import box12_to_corners
from .matching import linear_assignment
from .model import NUM_INTRINSICS, BoxHead, intrinsics_features, token_rays

__all__ = ["BOX_KINDS", "OwlLossConfig", "OwlHeads", "OwlDetector", "patch_box_prior", "owl_match", "owl_loss",
           "top_detections"]

#: The logit shift's initial bias: every first score is about ``sigmoid(-4.6) ≈ 0.01`` (the focal-loss prior of
#: RetinaNet and DETR's descendants), so the many negatives do not swamp the first steps.
LOGIT_PRIOR = -4.6

#: ``2d``: normalised ``(cx, cy, w, h)`` boxes; ``3d``: camera-frame 12-vector boxes.
BOX_KINDS = ("2d", "3d")


@dataclass(frozen=True)
class OwlLossConfig:
    """Weights shared by the matching cost and the loss (OWL-ViT's / DETR's): focal ``alpha`` and ``gamma``;
    ``box_weight`` on the L1 of the box (mean over its 4 or 12 entries), ``giou_weight`` on ``1 − GIoU`` (2-D),
    ``corner_weight`` on the corner L1 (mean over 8 × 3 coordinates; 3-D)."""

    class_weight: float = 2.0
    box_weight: float = 5.0
    giou_weight: float = 2.0
    corner_weight: float = 5.0
    alpha: float = 0.25
    gamma: float = 2.0


def patch_box_prior(grid: Tuple[int, int], device: Optional[torch.device] = None) -> Tensor:
    """The inverse sigmoid of every token's patch box, ``(M, 4)`` in row-major token order: normalised
    ``(cx, cy, w, h)`` of patch ``(i, j)`` of a ``gh × gw`` grid is ``((j + ½)/gw, (i + ½)/gh, 1/gw, 1/gh)``."""
    gh, gw = grid
    cy, cx = torch.meshgrid((torch.arange(gh, device=device) + 0.5) / gh, (torch.arange(gw, device=device) + 0.5) / gw,
                            indexing="ij")
    box = torch.stack([cx.reshape(-1), cy.reshape(-1), torch.full((gh * gw,), 1 / gw, device=device),
                       torch.full((gh * gw,), 1 / gh, device=device)], dim=-1)  # (M, 4)
    box = box.clamp(1e-4, 1 - 1e-4)
    return torch.log(box) - torch.log1p(-box)


class OwlHeads(nn.Module):
    """OWL-ViT's per-token heads on ``D``-wide tokens: class embedding ``(E)``, logit shift and scale, and the box
    MLP (``4`` outputs in 2-D; ``12`` in 3-D, whose input also has the 4 intrinsics features)."""

    def __init__(self, dim: int, embed_dim: int, boxes: str = "2d", hidden: int = 0) -> None:
        super().__init__()
        if boxes not in BOX_KINDS:
            raise ValueError(f"boxes must be one of {', '.join(BOX_KINDS)}; got {boxes!r}")
        self.boxes = boxes
        self.class_embed = nn.Linear(dim, embed_dim)
        self.logit_shift = nn.Linear(dim, 1)
        self.logit_scale = nn.Linear(dim, 1)
        box_in = dim + (NUM_INTRINSICS if boxes == "3d" else 0)
        self.box = BoxHead(box_in, hidden or dim, 4 if boxes == "2d" else 12)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)
        nn.init.constant_(self.logit_shift.bias, LOGIT_PRIOR)  # (every first score ≈ sigmoid(prior))

    def class_logits(self, tokens: Tensor, queries: Tensor, query_mask: Optional[Tensor] = None) -> Tensor:
        """``(B, M, Q)`` logits of tokens ``(B, M, D)`` against query embeddings ``(Q, E)`` or ``(B, Q, E)``;
        masked-out queries (``query_mask`` False) get ``-1e4``."""
        emb = F.normalize(self.class_embed(tokens), dim=-1)  # (B, M, E)
        q = F.normalize(queries.to(emb.dtype), dim=-1)
        cos = emb @ (q.transpose(-1, -2) if q.dim() == 3 else q.t())  # (B, M, Q)
        logits = (cos + self.logit_shift(tokens)) * (F.elu(self.logit_scale(tokens)) + 1)
        if query_mask is not None:
            qm = query_mask if query_mask.dim() == 2 else query_mask[None]
            logits = logits.masked_fill(~qm[:, None, :].bool(), -1e4)
        return logits


class OwlDetector(nn.Module):
    """A vision tower (a :class:`~ropekit.nn.VisionTransformer` without pooling or classifier) with OWL-ViT's
    heads, and a text tower that embeds the queries.

    Args:
        vision: the image tower (its ``forward_features`` gives the tokens; a CLS token is dropped).
        text: any module mapping token ids ``(Q, L)`` to embeddings ``(Q, E)`` (a padding id of 0 is the text
            tower's business); ``None``: queries must be passed as embeddings.
        embed_dim: ``E``.
        boxes: ``"2d"`` or ``"3d"`` (:data:`BOX_KINDS`).
        input: ``"rgb"`` (a 4-channel input loses its depth channel) or ``"rgbd"`` (the vision tower gets RGB-D).
        head_hidden: width of the box MLP's hidden layers (0: the vision width).
        colour_stats: ``(mean, std)`` per colour channel that the vision tower was trained with (its images
            standardised), applied to the colour channels of every input; ``None``: colours in ``[0, 1]`` as given.

    >>> out = model(images, query_ids)                # doctest: +SKIP
    >>> out["logits"].shape, out["boxes"].shape      # (B, M, Q), (B, M, 4) or (B, M, 12)
    """

    def __init__(self, vision: VisionTransformer, text: Optional[nn.Module], embed_dim: int, boxes: str = "2d",
                 input: str = "rgb", head_hidden: int = 0,
                 colour_stats: Optional[Tuple[Sequence[float], Sequence[float]]] = None) -> None:
        super().__init__()
        if input not in ("rgb", "rgbd"):
            raise ValueError(f"input must be 'rgb' or 'rgbd'; got {input!r}")
        self.vision, self.text, self.input = vision, text, input
        mean, std = colour_stats if colour_stats is not None else ((0.0,) * 3, (1.0,) * 3)
        self.register_buffer("colour_mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1))
        self.register_buffer("colour_std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1))
        self.heads = OwlHeads(vision.cfg.embed_dim, embed_dim, boxes, head_hidden)
        self.boxes = boxes

    def no_weight_decay(self) -> set:
        """Encoding and depth-lift parameters of the towers (no weight decay), with their names here."""
        out = {f"vision.{n}" for n in self.vision.no_weight_decay()}
        if self.text is not None and hasattr(self.text, "no_weight_decay"):
            out |= {f"text.{n}" for n in self.text.no_weight_decay()}
        return out

    @torch.no_grad()
    def init_box_prior(self, mean_box: Tensor) -> None:
        """3-D only: start every token's box at ``mean_box (12,)`` with the lateral offset 0 (on its own ray)."""
        if self.boxes != "3d":
            raise ValueError("init_box_prior is for 3-D boxes; 2-D boxes start at their patch")
        bias = torch.as_tensor(mean_box, dtype=self.heads.box.fc3.bias.dtype).clone()
        bias[0:2] = 0.0
        self.heads.box.fc3.bias.copy_(bias)

    def encode_queries(self, query_ids: Tensor) -> Tensor:
        """Text embeddings ``(Q, E)`` of token ids ``(Q, L)`` (the text tower's forward)."""
        if self.text is None:
            raise ValueError("this detector has no text tower: pass query embeddings (Q, E)")
        if query_ids.dim() != 2 or query_ids.shape[0] == 0:
            raise ValueError(f"expected query token ids (Q >= 1, L), got {tuple(query_ids.shape)}")
        return self.text(query_ids)

    def tokens(self, x: Tensor) -> Tuple[Tensor, Tuple[int, int]]:
        """Patch tokens ``(B, M, D)`` of images ``x (B, 3 or 4, H, W)`` and the token grid ``(gh, gw)``."""
        if x.dim() != 4 or x.shape[1] not in (3, 4):
            raise ValueError(f"expected images (B, 3 or 4, H, W) (RGB then depth), got {tuple(x.shape)}")
        if self.input == "rgbd" and x.shape[1] != 4:
            raise ValueError(f"an RGB-D detector needs (B, 4, H, W) input (RGB then depth), got {tuple(x.shape)}")
        rgb = (x[:, :3] - self.colour_mean.to(x.dtype)) / self.colour_std.to(x.dtype)
        x = rgb if self.input == "rgb" else torch.cat([rgb, x[:, 3:]], dim=1)
        feats = self.vision.forward_features(x)  # (B, N, D)
        p = self.vision.cfg.patch_size
        grid = (x.shape[-2] // p, x.shape[-1] // p)
        return feats[:, feats.shape[1] - grid[0] * grid[1]:], grid

    def forward(self, x: Tensor, queries: Tensor, K: Optional[Tensor] = None,
                query_mask: Optional[Tensor] = None) -> Dict[str, Tensor]:
        """Per-token predictions.

        Args:
            x: ``(B, 4, H, W)`` RGB in ``[0, 1]`` then metric depth (``(B, 3, H, W)`` for an RGB model).
            queries: token ids ``(Q, L)`` (long; embedded by the text tower) or embeddings ``(Q, E)`` /
                ``(B, Q, E)`` (float).
            K: ``(B, 3, 3)`` intrinsics (3-D boxes only).
            query_mask: ``(Q,)`` or ``(B, Q)`` bool, False for padding queries.

        Returns:
            ``{"logits": (B, M, Q), "boxes": (B, M, 4) normalised (cx, cy, w, h) or (B, M, 12) camera-frame}``.
        """
        if queries.shape[-2] == 0:
            raise ValueError("no text query: give at least one")
        emb = self.encode_queries(queries) if not queries.is_floating_point() else queries
        tokens, grid = self.tokens(x)
        logits = self.heads.class_logits(tokens, emb, query_mask)
        if self.boxes == "2d":
            boxes = torch.sigmoid(self.heads.box(tokens) + patch_box_prior(grid, tokens.device).to(tokens.dtype))
        else:
            if K is None:
                raise ValueError("3-D boxes need the camera intrinsics: pass K (B, 3, 3)")
            intr = intrinsics_features(K.to(tokens.dtype), x.shape[-2], x.shape[-1])  # (B, 4)
            out = self.heads.box(torch.cat([tokens, intr[:, None].expand(-1, tokens.shape[1], -1)], -1))
            rays = token_rays(K.to(tokens.dtype), x.shape[-2], x.shape[-1], self.vision.cfg.patch_size)  # (B, M, 2)
            z = out[..., 2:3]
            boxes = torch.cat([rays * z + out[..., 0:2], out[..., 2:]], dim=-1)  # (B, M, 12)
        return {"logits": logits, "boxes": boxes}


# --------------------------------------------------------------------------------------------- matching and loss


def _focal_cost(logits: Tensor, alpha: float, gamma: float) -> Tensor:
    """Deformable-DETR's focal matching cost of each (token, query): ``(B, M, Q)``."""
    prob = logits.float().sigmoid()
    neg = (1 - alpha) * prob ** gamma * -torch.log(1 - prob + 1e-8)
    pos = alpha * (1 - prob) ** gamma * -torch.log(prob + 1e-8)
    return pos - neg


def _batch_cost(logits: Tensor, boxes: Tensor, labels: Tensor, tgt_boxes: Tensor, cfg: OwlLossConfig) -> Tensor:
    """``(B, M, T)`` matching cost (padding targets get finite, meaningless costs)."""
    cls = _focal_cost(logits, cfg.alpha, cfg.gamma)  # (B, M, Q)
    cost = cfg.class_weight * torch.gather(cls, 2, labels.long().clamp_min(0)[:, None, :].expand(-1, cls.shape[1], -1))
    n = boxes.shape[-1]
    cost = cost + cfg.box_weight * torch.cdist(boxes.float(), tgt_boxes.float(), p=1) / n
    if n == 4:
        pb = box_convert(boxes.float(), "cxcywh", "xyxy")
        tb = box_convert(tgt_boxes.float(), "cxcywh", "xyxy")
        giou = torch.stack([generalized_box_iou(pb[b], tb[b]) for b in range(len(pb))])  # (B, M, T)
        cost = cost - cfg.giou_weight * giou
    else:
        pc, tc = box12_to_corners(boxes.float()).flatten(-2), box12_to_corners(tgt_boxes.float()).flatten(-2)
        cost = cost + cfg.corner_weight * torch.cdist(pc, tc, p=1) / 24
    return cost


@torch.no_grad()
def owl_match(logits: Tensor, boxes: Tensor, labels: Tensor, tgt_boxes: Tensor, mask: Tensor,
              cfg: OwlLossConfig = OwlLossConfig()) -> List[Tuple[Tensor, Tensor]]:
    """Optimal one-to-one matching of each image's tokens to its objects (Hungarian, scipy).

    Args:
        logits: ``(B, M, Q)``; boxes: ``(B, M, 4)`` or ``(B, M, 12)``; labels: ``(B, T)`` query index of each
            object; tgt_boxes: ``(B, T, 4 or 12)``; mask: ``(B, T)`` bool, True for real objects.

    Returns:
        per image ``(token_idx, object_idx)`` int64 CPU tensors.
    """
    if tgt_boxes.shape[1] == 0:
        return [(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)) for _ in range(len(logits))]
    cost = _batch_cost(logits, boxes, labels, tgt_boxes, cfg).cpu()
    out = []
    for b in range(len(cost)):
        t_idx = torch.nonzero(mask[b].cpu(), as_tuple=False).flatten()
        if len(t_idx) == 0:
            out.append((torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)))
            continue
        rows, cols = linear_assignment(cost[b][:, t_idx])
        out.append((rows, t_idx[cols]))
    return out


def owl_loss(logits: Tensor, boxes: Tensor, labels: Tensor, tgt_boxes: Tensor, mask: Tensor,
             cfg: OwlLossConfig = OwlLossConfig()) -> Dict[str, Tensor]:
    """OWL-ViT's set loss (shapes as in :func:`owl_match`).

    ``loss_class``: sigmoid focal loss summed over every token × query, matched (token, its object's query)
    pairs positive and everything else negative; ``loss_box``: L1 over the matched boxes (mean over the box's
    entries); ``loss_giou`` (2-D): ``1 − GIoU``; ``loss_corners`` (3-D): corner L1 (mean over 8 × 3).  Each is
    summed over the batch and divided by the number of objects (at least 1); an image without objects adds
    negatives only.  ``loss`` is the weighted sum.

    Returns:
        ``{"loss", "loss_class", "loss_box", "loss_giou" or "loss_corners"}`` scalars.
    """
    if labels.numel() and mask.any() and (labels[mask.bool()] >= logits.shape[-1]).any():
        raise ValueError(f"an object's query index is >= the number of queries {logits.shape[-1]}")
    indices = owl_match(logits, boxes, labels, tgt_boxes, mask, cfg)
    dev = logits.device
    b_idx = torch.cat([torch.full_like(s, b) for b, (s, _) in enumerate(indices)]).to(dev)
    s_idx = torch.cat([s for s, _ in indices]).to(dev)
    t_idx = torch.cat([t for _, t in indices]).to(dev)
    n = mask.sum().clamp_min(1).float()
    target = torch.zeros_like(logits, dtype=torch.float32)
    if len(b_idx):
        target[b_idx, s_idx, labels[b_idx, t_idx].long()] = 1.0
    loss_class = sigmoid_focal_loss(logits.float(), target, cfg.alpha, cfg.gamma, reduction="sum") / n
    pb, tb = boxes[b_idx, s_idx].float(), tgt_boxes[b_idx, t_idx].float()  # (P, 4 or 12)
    loss_box = (pb - tb).abs().sum() / (pb.shape[-1] * n)
    out = {"loss_class": loss_class, "loss_box": loss_box}
    loss = cfg.class_weight * loss_class + cfg.box_weight * loss_box
    if boxes.shape[-1] == 4:
        giou = (generalized_box_iou_loss(box_convert(pb, "cxcywh", "xyxy"), box_convert(tb, "cxcywh", "xyxy"),
                                         reduction="sum") / n) if len(pb) else pb.sum()
        out["loss_giou"] = giou
        loss = loss + cfg.giou_weight * giou
    else:
        corners = (box12_to_corners(pb) - box12_to_corners(tb)).abs().sum() / (24 * n)
        out["loss_corners"] = corners
        loss = loss + cfg.corner_weight * corners
    out["loss"] = loss
    return out


@torch.no_grad()
def top_detections(logits: Tensor, boxes: Tensor, k: int = 100) -> List[Dict[str, Tensor]]:
    """The ``k`` highest-scoring (token, query) pairs of each image: ``[{"scores": (k',), "labels": (k',) query
    index, "boxes": (k', 4 or 12), "tokens": (k',)}]`` with ``k' = min(k, M · Q)``, best first; score =
    ``sigmoid(logit)``."""
    B, M, Q = logits.shape
    out = []
    for b in range(B):
        s = logits[b].float().sigmoid().flatten()  # (M·Q,)
        kk = min(k, s.numel())
        sc, idx = s.topk(kk)
        tok, lab = idx // Q, idx % Q
        out.append({"scores": sc, "labels": lab, "boxes": boxes[b, tok].float(), "tokens": tok})
    return out
