"""ALOHA diagnosis: does the cube loss work every time when its head reads the image alone and predicts where the
cube is *now*?

With the study's object loss (a head on the whole conditioning predicts where the cube *started*), some training
seeds succeed and others fail, and the encoders of the failing ones locate the cube no better than its mean
position. After the grasp, the joint state alone tells where the cube started, so that loss can be lowered without
looking at the image. Here the head sees only the image features (the pooled tokens, their mean and the queries'
keypoints; no joint state) and predicts the cube's position before each step (the demos replayed, physics only).
Trains the CPU study's policy (`ropekit robot aloha experiment --preset cpu --aux-weight 0`: same demos, recipe,
encoder row and training seed) with that loss (weight 1) and evaluates it like the study. Writes `result.json`.

    python seecube.py OUT SEED [ENCODER]      # ENCODER: a row label of the study (default Cayley-STRING)

The cube positions are the demo set's ``object_pos`` (a set cached before they were recorded is replayed once by
``load_or_collect``, ~7 min for 2000 demos, and they are kept beside it).
"""
import torch
from torch import nn

from _study_policy import CubeLossPolicy, run


class SeeCubePolicy(CubeLossPolicy):
    """The study's policy plus ``aux_head``: image features -> the cube's current position ``(B, 3)``, standardised."""

    def __init__(self, config, mean, scale):
        super().__init__(config, lambda p: nn.Sequential(nn.LayerNorm(p.image_feature_dim()),
                                                         nn.Linear(p.image_feature_dim(), 3)), mean, scale)
        # the conditioning's input: pooled + mean tokens, the state's 128, keypoints
        self._img_cols = ((config.num_queries + 1) * self.encoder.cfg.embed_dim, 128)
        self.cond_proj.register_forward_pre_hook(self._keep_image_features)

    def _keep_image_features(self, module, args):
        x = args[0]  # (B, F): image features, then the state's 128, then the keypoints
        a, n = self._img_cols
        self._feat = torch.cat([x[:, :a], x[:, a + n:]], dim=-1)


def _make(config, demos, cube):
    now = torch.from_numpy(demos["object_pos"][:, :3])  # (steps, 3): where the cube is before each step
    return SeeCubePolicy(config, now.mean(0), now.std(0, unbiased=False).clamp_min(1e-2))


def _set_targets(data, cube):
    data.object_pos = data.object_pos[:, :3]  # (N, 3): where the cube is in each training frame


if __name__ == "__main__":
    run("seeing the cube now", _make, _set_targets)
