"""ALOHA diagnosis: can the policy's head and action loop do the task when it is *told* where the cube is?

Trains the CPU study's policy (`ropekit robot aloha experiment --preset cpu --aux-weight 0`: same demos, recipe,
encoder row and training seed) with the cube's initial position (x, y, z, metres; privileged: read from the
simulator) appended to the joint state it is conditioned on, evaluates it like the study (20 held-out poses at 2000
and 4000 steps, 50 at the end; one episode at a time, so that the position given is that episode's) and writes
`result.json` into OUT. If this policy succeeds, the diffusion head, chunking and control loop are sound and what
the study's policies miss is finding the cube in the image; if it fails too, the bound is downstream of the encoder.

    python oracle.py OUT SEED [ENCODER]      # ENCODER: a row label of the study (default Cayley-STRING)
"""
import torch
from torch import nn

from ropekit.robot.aloha.policy import AlohaPolicy
from ropekit.robot.aloha.sim import ACTION_DIM, AlohaSim
from ropekit.robot.policy import Normalizer

from _study_policy import run

CUBE = {"xyz": None}  # the current evaluation episode's initial cube position (set by AlohaSim.reset below)
_reset = AlohaSim.reset


def _reset_and_record(self, *args, **kwargs):
    obs = _reset(self, *args, **kwargs)
    CUBE["xyz"] = torch.tensor(self.object_pose[:3], dtype=torch.float32)
    return obs


AlohaSim.reset = _reset_and_record


class CubeToldPolicy(AlohaPolicy):
    """The study's policy whose state is ``(B, 14 + 3)``: joint positions, then the cube's initial position."""

    def __init__(self, config):
        if config.action_mode != "absolute":
            raise ValueError("absolute targets only: relative ones would read the extended state")
        super().__init__(config)
        self.state_mlp = nn.Sequential(nn.Linear(ACTION_DIM + 3, 128), nn.SiLU(), nn.Linear(128, 128))
        self.state_norm = Normalizer(ACTION_DIM + 3)

    @torch.no_grad()
    def predict(self, images, state, generator=None):
        if state.shape[-1] == ACTION_DIM:  # evaluation hands over the joints only
            if state.shape[0] != 1:
                raise ValueError("evaluate one episode at a time (parallel=1)")
            state = torch.cat([state, CUBE["xyz"].to(state)[None]], dim=-1)
        return super().predict(images, state, generator)[..., :ACTION_DIM]


def _append_cube(data, cube):
    data.state = torch.cat([data.state, cube], dim=-1)  # (N, 17)


if __name__ == "__main__":
    run("told the cube", lambda config, demos, cube: CubeToldPolicy(config), _append_cube, parallel=1)
