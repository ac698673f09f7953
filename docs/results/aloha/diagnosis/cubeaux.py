"""ALOHA diagnosis: does an auxiliary loss that makes the conditioning say where the cube is make the policy follow it?

Trains the CPU study's policy (`ropekit robot aloha experiment --preset cpu --aux-weight 0`: same demos, recipe,
encoder row and training seed) with one more training loss: a linear head on the policy's conditioning predicts the
cube's initial position (privileged, from the simulator; normalised per axis over the demos), weight 1. The policy
never sees the position when it acts: evaluation is the study's (20 held-out poses at 2000 and 4000 steps, 50 at the
end). Writes `result.json` into OUT.

    python cubeaux.py OUT SEED [ENCODER]      # ENCODER: a row label of the study (default Cayley-STRING)
"""
from torch import nn

from ropekit.robot.aloha.policy import AlohaPolicy

from _study_policy import run

AUX_WEIGHT = 1.0


class CubeAuxPolicy(AlohaPolicy):
    """The study's policy plus ``aux_head``: conditioning ``(B, E)`` -> normalised cube position ``(B, 3)``."""

    def __init__(self, config, mean, scale):
        super().__init__(config)
        self.aux_head = nn.Linear(config.cond_dim, 3)
        self.register_buffer("cube_mean", mean)
        self.register_buffer("cube_scale", scale)

    def encode(self, images, state):
        cond = super().encode(images, state)
        self._cond = cond  # (B, E), before the loss repeats it per noise sample
        return cond

    def loss(self, images, state, actions, noise_samples=1, generator=None, object_pos=None):
        head, self.aux_head = self.aux_head, None  # the base loss's auxiliary term is the KUKA one
        try:
            loss = super().loss(images, state, actions, noise_samples, generator)
        finally:
            self.aux_head = head
        cond, self._cond = self._cond, None  # keep no graph on the module (the EMA snapshot deep-copies it)
        target = (object_pos - self.cube_mean) / self.cube_scale  # (B, 3)
        return loss + AUX_WEIGHT * nn.functional.mse_loss(head(cond), target)


def _set_targets(data, cube):
    data.object_pos = cube  # (N, 3): what the auxiliary head is trained to predict


if __name__ == "__main__":
    run("with the cube loss",
        lambda config, demos, cube: CubeAuxPolicy(config, cube.mean(0), cube.std(0, unbiased=False).clamp_min(1e-2)),
        _set_targets)
