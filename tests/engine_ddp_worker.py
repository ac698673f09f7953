"""Run by tests/test_engine.py under ``torchrun --nproc_per_node 2``: one short DDP run of the 3-D detector and of
the robot policy on the CPU (gloo); each rank saves its final weights as ``<out>/<task>-rank<r>.pt``."""

import os
import sys
from pathlib import Path

import torch

from test_detection_model import _toy_scenes
from test_engine import TinyDemos, tiny_policy

from ropekit.detection.model import Detector3D, detector_config
from ropekit.detection.train import DetTrainConfig, mean_box, train_detector
from ropekit.robot.train import PolicyTrainConfig, train_policy
from ropekit.train.engine import EngineOptions


def main(out: Path) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])  # (both runs share the process group the first one sets up)
    opts = EngineOptions(device="cpu", progress=False, tensorboard=False, plots=False)

    torch.manual_seed(0)  # the same initial weights on both ranks (DDP also broadcasts rank 0's)
    scenes = _toy_scenes(8)
    det = Detector3D(detector_config("cayley", "rgbd", image_size=32, patch_size=8, depth=1, embed_dim=24))
    det.init_box_prior(mean_box(scenes))
    rows = train_detector(det, scenes, DetTrainConfig(steps=2, batch_size=4, warmup_steps=0, log_every=2),
                          out_dir=out / "det", options=opts)
    torch.save({"state": det.state_dict(), "rows": rows}, out / f"det-rank{rank}.pt")

    torch.manual_seed(0)
    policy = tiny_policy()
    rows = train_policy(policy, TinyDemos(), PolicyTrainConfig(steps=2, batch_size=4, warmup_steps=0, log_every=2,
                                                                ema_decay=0.0), out / "policy", progress=False,
                        options=opts)
    torch.save({"state": policy.state_dict(), "rows": rows}, out / f"policy-rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
