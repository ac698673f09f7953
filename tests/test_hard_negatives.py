"""Depth-relation hard negatives (ropekit.multimodal.hard_negatives)."""

from __future__ import annotations

import pytest
import torch

from ropekit.multimodal.hard_negatives import (depth_hard_negative_accuracy, depth_relation_share,
                                               flip_depth_relation, pairwise_accuracy)

FRONT = "a big red 3 and a small blue square . the blue square is in front of the red 3".split()
BEHIND = "a big red 3 and a small blue square . the blue square is behind the red 3".split()
LEFT = "a big red 3 and a small blue square . the blue square is left of the red 3".split()


def test_flip_is_an_involution_and_leaves_other_captions_alone():
    assert flip_depth_relation(FRONT) == BEHIND
    assert flip_depth_relation(BEHIND) == FRONT
    assert flip_depth_relation(flip_depth_relation(FRONT)) == FRONT
    assert flip_depth_relation(LEFT) is None and flip_depth_relation("a red 3".split()) is None
    assert flip_depth_relation([]) is None
    with pytest.raises(ValueError, match="2 depth relations"):
        flip_depth_relation(FRONT + ["."] + BEHIND[-5:])
    assert depth_relation_share([FRONT, LEFT, BEHIND, LEFT]) == 0.5 and depth_relation_share([]) == 0.0


def test_pairwise_accuracy_counts_ties_as_half():
    img = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    pos = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    neg = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    assert pairwise_accuracy(img, pos, neg).tolist() == [1.0, 0.0, 0.5]
    with pytest.raises(ValueError):
        pairwise_accuracy(img, pos[:2], neg)


class _Toy:
    """A 'model' whose text embedding reads the depth word and whose image embedding reads a flag in the image:
    it knows which object is in front, so it must score 1; with the flag removed (an RGB tower) every pair ties."""

    def __init__(self, sees_depth: bool):
        self.sees_depth = sees_depth
        self.training = False

    def encode_image(self, images):
        flag = images[:, 0, 0, 0] if self.sees_depth else torch.zeros(images.shape[0])
        return torch.stack([flag, 1 - flag.abs()], -1)

    def encode_text(self, ids):
        return torch.stack([ids[:, 0].float(), torch.zeros(ids.shape[0])], -1)


def _tok(texts):
    # +1 when "in front of" is stated, -1 for "behind", 0 otherwise
    return torch.tensor([[1 if "in front of" in t else -1 if "behind" in t else 0] for t in texts])


def test_accuracy_on_a_model_that_reads_depth_and_one_that_cannot():
    images = torch.zeros(3, 1, 2, 2)
    images[0, 0, 0, 0] = 1.0   # scene 0: the stated relation is "in front of"
    images[1, 0, 0, 0] = -1.0  # scene 1: "behind"
    captions = [[FRONT, LEFT], [BEHIND], [LEFT]]
    good = depth_hard_negative_accuracy(_Toy(True), _tok, images, captions, batch_size=1)
    assert good["n"] == 2 and good["accuracy"] == 1.0 and good["share"] == 0.5
    blind = depth_hard_negative_accuracy(_Toy(False), _tok, images, captions)
    assert blind["accuracy"] == 0.5  # chance: the flipped caption scores the same
    none = depth_hard_negative_accuracy(_Toy(True), _tok, images[2:], [[LEFT]])
    assert none["n"] == 0 and none["accuracy"] != none["accuracy"]
    with pytest.raises(ValueError, match="caption lists"):
        depth_hard_negative_accuracy(_Toy(True), _tok, images, captions[:2])
