"""ALOHA diagnosis: how well does a trained policy's object head locate the cube in new scenes?

For each policy checkpoint (trained with the object loss), renders the first frame of the 50 held-out evaluation
poses (seeds 100000-100049, the policy's own camera), asks the head where the cube is and compares with where the
simulator put it: the mean horizontal (x, y) error, beside that of always answering the mean position. Prints a
table and writes it as JSON to OUT.

    python locate.py OUT RUN [RUN ...]      # RUN: a policy folder or checkpoint.pt
"""
import json
import sys
from pathlib import Path

import numpy as np
import torch

from ropekit.robot.aloha.policy import load_aloha_policy
from ropekit.robot.aloha.sim import AlohaSim
from ropekit.robot.policy import images_from_obs

SEEDS = range(100_000, 100_050)


def locate(run: str) -> dict:
    policy = load_aloha_policy(run)
    c = policy.config
    sim = AlohaSim("transfer_cube", cameras=("top",), image_hw=c.image_hw, depth=c.modality == "rgbd", fovy=c.fovy)
    images, states, cube = [], [], []
    for seed in SEEDS:
        obs = sim.reset(seed=seed, render=False)
        rgb, depth = sim.render("top")
        images.append(images_from_obs(rgb[None], None if depth is None else depth[None]))
        states.append(obs["qpos"])
        cube.append(sim.object_positions()[:3])
    cube = np.stack(cube)  # (50, 3)
    estimate = policy.aux_position(torch.cat(images), torch.from_numpy(np.stack(states)).float()).numpy()[:, :3]
    err = np.linalg.norm(estimate[:, :2] - cube[:, :2], axis=1)
    mean = np.linalg.norm(cube[:, :2] - cube[:, :2].mean(0), axis=1)
    return {"run": str(run), "error_cm": float(err.mean() * 100), "error_median_cm": float(np.median(err) * 100),
            "mean_position_error_cm": float(mean.mean() * 100)}


if __name__ == "__main__":
    torch.set_num_threads(1)
    rows = [locate(r) for r in sys.argv[2:]]
    for r in rows:
        print(f"{r['run']}: cube located to {r['error_cm']:.1f} cm (median {r['error_median_cm']:.1f}); "
              f"the mean position: {r['mean_position_error_cm']:.1f} cm")
    Path(sys.argv[1]).write_text(json.dumps(rows, indent=2))
