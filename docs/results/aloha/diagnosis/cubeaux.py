"""ALOHA diagnosis: does an auxiliary loss that makes the conditioning say where the cube is make the policy follow it?

Trains the CPU study's policy (`ropekit robot aloha experiment --preset cpu --aux-weight 0`: same demos, recipe,
encoder row and training seed) with one more training loss: a linear head on the policy's conditioning predicts the
cube's initial position (privileged, from the simulator; normalised per axis over the demos), weight 1. The policy
never sees the position when it acts: evaluation is the study's (20 held-out poses at 2000 and 4000 steps, 50 at the
end). Writes `result.json` into OUT.

    python cubeaux.py OUT SEED [ENCODER]      # ENCODER: a row label of the study (default Cayley-STRING)
"""
from torch import nn

from _study_policy import CubeLossPolicy, run


class CubeAuxPolicy(CubeLossPolicy):
    """The study's policy plus ``aux_head``: conditioning ``(B, E)`` -> normalised cube position ``(B, 3)``."""

    def __init__(self, config, mean, scale):
        super().__init__(config, lambda p: nn.Linear(config.cond_dim, 3), mean, scale)

    def encode_parts(self, images, state, image_features=True):
        cond, feats = super().encode_parts(images, state, image_features)
        self._feat = cond  # (B, E), before the loss repeats it per noise sample
        return cond, feats


def _set_targets(data, cube):
    data.object_pos = cube  # (N, 3): what the auxiliary head is trained to predict


if __name__ == "__main__":
    run("with the cube loss",
        lambda config, demos, cube: CubeAuxPolicy(config, cube.mean(0), cube.std(0, unbiased=False).clamp_min(1e-2)),
        _set_targets)
