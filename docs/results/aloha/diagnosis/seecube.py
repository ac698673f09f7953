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

The cube positions are cached next to the demo set (``<demo set>.cube-now.npy``, ~6 min to replay 2000 demos).
"""
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ropekit.robot.aloha.policy import AlohaPolicy
from ropekit.robot.aloha.sim import AlohaSim

from _study_policy import run

AUX_WEIGHT = 1.0


def cube_now(demos, path) -> np.ndarray:
    """``(steps, 3)`` the cube's position before each recorded step of every demo (row order of ``demos``)."""
    cache = Path(str(path) + ".cube-now.npy")
    if cache.exists():
        return np.load(cache)
    sim = AlohaSim("transfer_cube", mode="joint", cameras=())
    actions, qpos = np.asarray(demos["action"]), np.asarray(demos["qpos"])
    out, row = np.zeros((len(actions), 3), np.float32), 0
    for seed, length in zip(demos["episode_seed"], demos["episode_length"]):
        obs = sim.reset(seed=int(seed), render=False)
        if np.abs(obs["qpos"] - qpos[row]).max() > 0:
            raise RuntimeError(f"the replay of demo seed {seed} does not start where the recorded one did")
        for t in range(int(length)):
            out[row + t] = sim.object_state[:3]
            sim.step(actions[row + t].astype(np.float64), render=False)
        row += int(length)
    np.save(cache, out)
    return out


class SeeCubePolicy(AlohaPolicy):
    """The study's policy plus ``aux_head``: image features -> the cube's current position ``(B, 3)``, standardised."""

    def __init__(self, config, mean, scale):
        super().__init__(config)
        d, q = self.encoder.cfg.embed_dim, config.num_queries
        self._img_cols = ((q + 1) * d, 128)  # the conditioning's input: pooled + mean tokens, state (128), keypoints
        feat = (q + 1) * d + (2 * q if config.keypoints else 0)
        self.aux_head = nn.Sequential(nn.LayerNorm(feat), nn.Linear(feat, 3))
        self.register_buffer("cube_mean", mean)
        self.register_buffer("cube_scale", scale)
        self._img = None
        self.cond_proj.register_forward_pre_hook(self._keep_image_features)

    def _keep_image_features(self, module, args):
        x = args[0]  # (B, F): image features, then the state's 128, then the keypoints
        a, n = self._img_cols
        self._img = torch.cat([x[:, :a], x[:, a + n:]], dim=-1)

    def loss(self, images, state, actions, noise_samples=1, generator=None, object_pos=None):
        head, self.aux_head = self.aux_head, None  # the base loss's auxiliary term is the study's one
        try:
            loss = super().loss(images, state, actions, noise_samples, generator)
        finally:
            self.aux_head = head
        img, self._img = self._img, None  # keep no graph on the module (the EMA snapshot deep-copies it)
        target = (object_pos - self.cube_mean) / self.cube_scale  # (B, 3)
        return loss + AUX_WEIGHT * nn.functional.mse_loss(head(img), target)


def _set_targets(data, cube, demos_and_path):
    demos, path = demos_and_path
    now = torch.from_numpy(cube_now(demos, path))[torch.from_numpy(np.asarray(demos["frame_row"]))]
    data.object_pos = now  # (N, 3): where the cube is in each training frame


_stats = {}


def _make(config, demos, cube):
    now = torch.from_numpy(cube_now(demos, _stats["path"]))
    return SeeCubePolicy(config, now.mean(0), now.std(0, unbiased=False).clamp_min(1e-2))


def _set(data, cube, demos_and_path):
    _stats["path"] = demos_and_path[1]
    _set_targets(data, cube, demos_and_path)


if __name__ == "__main__":
    run("seeing the cube now", _make, _set)
