"""The first observation of two evaluation episodes under each condition of the robot study's evaluation.

Usage (from the repository root; needs pybullet, as the study does)::

    python docs/results/robot-ood/conditions.py

writes ``docs/results/robot-ood/conditions.png``: one column per condition, the camera's 64×64 RGB image at the
episode seeds 1000 and 1001 (the evaluation's first two).
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ropekit.robot.env import PickEnv, env_config  # noqa: E402
from ropekit_studies.robot import CONDITIONS  # noqa: E402

OUT = Path(__file__).resolve().parent / "conditions.png"


def main() -> None:
    seeds = (1000, 1001)
    fig, axes = plt.subplots(len(seeds), len(CONDITIONS), figsize=(2.5 * len(CONDITIONS), 2.5 * len(seeds)))
    for col, condition in enumerate(CONDITIONS):
        for row, seed in enumerate(seeds):
            env = PickEnv(env_config(condition, 64))
            obs = env.reset(seed=seed)
            axes[row, col].imshow(obs["rgb"])
            axes[row, col].set_axis_off()
            if row == 0:
                axes[row, col].set_title(condition.replace("_", " "), fontsize=9)
            env.close()
    fig.tight_layout()
    fig.savefig(OUT, dpi=100)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
