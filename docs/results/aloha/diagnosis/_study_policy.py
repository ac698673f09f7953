"""Shared driver of the ALOHA diagnosis scripts: train one variant of the CPU study's policy and evaluate it like
the study (`ropekit robot aloha experiment --preset cpu --aux-weight 0`: same demos, recipe without the object
loss, encoder row and training seed; 20 held-out poses at 2000 and 4000 steps, 50 at the end), then write
``result.json`` into the run folder."""
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ropekit_studies.aloha import PRESETS
from ropekit.robot.aloha.expert import load_or_collect
from ropekit.robot.aloha.policy import ENCODINGS, AlohaChunks, AlohaPolicy, evaluate_policy
from ropekit.robot.aloha.sim import AlohaSim
from ropekit.robot.train import train_policy


class CubeLossPolicy(AlohaPolicy):
    """The study's policy (its own object loss off) plus a diagnosis's cube loss: ``aux_head`` maps features a
    subclass keeps in ``self._feat`` during the forward pass to the standardised cube position ``(B, 3)``; the
    loss adds ``weight`` times its mean squared error to the diffusion loss."""

    def __init__(self, config, make_head: Callable[["CubeLossPolicy"], torch.nn.Module], mean: torch.Tensor,
                 scale: torch.Tensor, weight: float = 1.0):
        super().__init__(config)
        self.aux_head = make_head(self)
        self.register_buffer("cube_mean", mean)
        self.register_buffer("cube_scale", scale)
        self._feat, self._weight = None, weight

    def loss(self, images, state, actions, noise_samples=1, generator=None, object_pos=None):
        head, self.aux_head = self.aux_head, None  # the base loss's auxiliary term is the library's
        try:
            loss = super().loss(images, state, actions, noise_samples, generator)
        finally:
            self.aux_head = head
        feat, self._feat = self._feat, None  # keep no graph on the module (the EMA snapshot deep-copies it)
        target = (object_pos - self.cube_mean) / self.cube_scale  # (B, 3)
        return loss + self._weight * torch.nn.functional.mse_loss(head(feat), target)


def run(what: str, make_policy: Callable[[Any, Any, torch.Tensor], Any],
        adapt_data: Callable[[Any, torch.Tensor], None] = lambda data, cube: None, parallel: Any = None) -> None:
    """``python SCRIPT OUT SEED [ENCODER]``. ``make_policy(config, demos, cube)`` builds the variant,
    ``adapt_data(data, cube)`` changes the training examples; ``cube (N, 3)`` is each example's initial cube
    position (privileged, from the simulator). ``parallel``: episodes simulated in lockstep (default the study's)."""
    out, seed = Path(sys.argv[1]), int(sys.argv[2])
    label = sys.argv[3] if len(sys.argv) > 3 else "Cayley-STRING"
    cfg = PRESETS["cpu"]()
    cfg.threads = 1
    torch.set_num_threads(1)
    modality = ENCODINGS[label][0]
    pcfg, tcfg = cfg.run_configs(label, seed)
    pcfg.aux_weight = 0.0  # the diagnoses vary the study's recipe as it was before it gained the object loss
    dcfg = cfg.demo_config("transfer_cube")
    demos, path, _ = load_or_collect(dcfg, cfg.cache_dir, progress=False)
    if modality != "rgbd":
        demos.pop("depth", None)  # 2.5 GB the RGB policies do not read
    sim = AlohaSim("transfer_cube", cameras=())
    cube = torch.tensor(np.stack([sim.sample_object_pose(int(s))[:3] for s in demos["episode_seed"]]),
                        dtype=torch.float32)  # (episodes, 3)
    data = AlohaChunks(demos, pcfg)
    frame_episode = torch.from_numpy(np.asarray(demos["episode"])[np.asarray(demos["frame_row"])])  # (N,)
    adapt_data(data, cube[frame_episode])
    eval_seeds = cfg.eval_seeds()
    t0 = time.time()
    torch.manual_seed(seed)
    policy = make_policy(pcfg, demos, cube)
    curve = []

    def evaluate(step, snapshot, episodes):
        ev = evaluate_policy(snapshot, "transfer_cube", eval_seeds[:episodes], cfg.eval_steps or cfg.episode_steps,
                             parallel=parallel or cfg.eval_parallel, seed=seed)
        gap = float(np.median(ev["reach_gap"]) * 100)
        curve.append({"step": step, "episodes": episodes, "success_rate": ev["success_rate"], "reach_cm": gap})
        print(f"{label} {what} s{seed} step {step}: success {ev['success_rate']:.2f} of {episodes}, closest "
              f"approach median {gap:.1f} cm ({time.time() - t0:.0f} s in)", flush=True)
        return ev

    history = train_policy(policy, data, tcfg, out_dir=out / "train", progress=False, snapshot_at=cfg.curve_steps(),
                           on_snapshot=lambda step, snap: evaluate(step, snap, cfg.curve_episodes))
    ev = evaluate(int(tcfg.steps), policy, cfg.eval_episodes)
    json.dump({"encoder": label, "seed": seed, "demos": str(path), "policy": pcfg.to_dict(),
               "train": tcfg.to_dict(), "curve": curve, "final": ev, "final_loss": history[-1]["loss"],
               "seconds": time.time() - t0}, open(out / "result.json", "w"), indent=2)
