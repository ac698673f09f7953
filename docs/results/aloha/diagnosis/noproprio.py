"""ALOHA diagnosis: does the head act blind because it follows its own joint positions (the "copycat" shortcut)?

Trains one policy of the CPU study (`ropekit robot aloha experiment --preset cpu --aux-weight 0`: same demos,
recipe, encoder row and training seed) whose conditioning sees a constant joint state instead of the real one,
evaluates it like the study (20 held-out poses at 2000 and 4000 steps, 50 at the end) and writes `result.json` into
OUT.

    python noproprio.py OUT SEED [ENCODER]      # ENCODER: a row label of the study (default Cayley-STRING)
"""
import torch

from ropekit.robot.aloha.policy import AlohaPolicy

from _study_policy import run


class ImagesOnlyPolicy(AlohaPolicy):
    """The study's policy with the joint state replaced by zeros in the conditioning (a constant: no information).
    The executed actions are still absolute joint targets, so the real state is needed nowhere else."""

    def encode_parts(self, images, state, image_features=True):  # the one path of training and sampling
        return super().encode_parts(images, torch.zeros_like(state), image_features)


if __name__ == "__main__":
    run("images-only", lambda config, demos, cube: ImagesOnlyPolicy(config))
