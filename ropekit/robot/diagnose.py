"""Measurements that explain a pick policy's failures.

* :func:`expert_tolerance` -- how precise a policy has to be: the scripted expert's success when it plans
  with a wrong belief of the target's position (an offset along one axis), for a given grasp strategy.
* :func:`grasp_errors` -- where a policy's gripper went: per episode, how close the suction link came to the
  target, and the tip's horizontal and vertical offsets there; :func:`summarize_grasp_errors` sorts the
  failures into horizontal misses, height errors, suction off, and grasps that did not lift.
* :func:`chunk_tracking` -- whether the predicted action chunks follow the target, per step of the episode:
  on demonstrations the policy did not train on, the correlation between the predicted and the expert's
  chunk end (tip target ``H - 1`` steps ahead) per horizontal axis, the mean error, and -- for a policy with
  the auxiliary head -- how well its conditioning locates the target.
* :func:`depth_shuffle_effect` -- whether an RGB-D policy reads depth: the change of its predicted tip
  targets when the depth patches of each image are permuted (the RGB and the state are kept).

Each is a plain function returning rows (dicts); ``ropekit robot diagnose`` prints and saves them.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np

from .demos import episode_seeds, rollout
from .env import STATE_SLICES, PickConfig, PickEnv, env_config
from .expert import ScriptedExpert

__all__ = ["AXES", "expert_tolerance", "grasp_errors", "summarize_grasp_errors", "chunk_tracking",
           "depth_shuffle_effect"]

AXES = {"x": np.array([1.0, 0.0, 0.0]), "y": np.array([0.0, 1.0, 0.0]), "z": np.array([0.0, 0.0, 1.0])}


def expert_tolerance(
    offsets: Sequence[float],
    axis: str = "z",
    episodes: int = 40,
    seed: int = 5000,
    expert_kwargs: Optional[Mapping[str, Any]] = None,
    env_overrides: Optional[Mapping[str, Any]] = None,
) -> List[Dict[str, Any]]:
    """Success of the scripted expert planning with ``target + offset * axis`` instead of the true target.

    Args:
        offsets: belief errors in metres (positive z: the expert believes the target is higher than it is).
        axis: ``"x"``, ``"y"`` or ``"z"`` (world frame).
        episodes: scenes per offset (in-distribution, env seeds from :func:`episode_seeds`).
        expert_kwargs: :class:`ScriptedExpert` arguments (e.g. ``press_depth=0, suction_height=0`` for the
            close-on-the-top-face strategy).
    Returns:
        One row per offset: ``axis``, ``offset_m``, ``episodes``, ``success_rate``, ``mean_steps``.
    Raises:
        ValueError: unknown axis.
    """
    if axis not in AXES:
        raise ValueError(f"axis must be one of {tuple(AXES)}, got {axis!r}")
    seeds = episode_seeds(seed, episodes)
    rows = []
    cfg = PickConfig.in_distribution(terminate_on_success=True, **dict(env_overrides or {}))
    with PickEnv(cfg) as env:
        for off in offsets:
            expert = ScriptedExpert(env, **{**dict(expert_kwargs or {}), "belief_offset": AXES[axis] * off})
            results = [rollout(env, expert, seed=int(s)) for s in seeds]  # (rollout resets the expert)
            rows.append({"axis": axis, "offset_m": float(off), "episodes": episodes,
                         "success_rate": sum(r.success for r in results) / episodes,
                         "mean_steps": float(np.mean([r.num_steps for r in results]))})
    return rows


def grasp_errors(policy: Any, episodes: int, condition: str = "in_distribution", seed: int = 1000,
                 env_overrides: Optional[Mapping[str, Any]] = None, sample_seed: int = 0,
                 progress: bool = False) -> List[Dict[str, Any]]:
    """Roll out ``policy`` (a ``DiffusionPolicy`` or a run folder) and record how close its gripper came.

    Episode ``i`` uses env seed ``episode_seeds(seed, episodes)[i]`` and diffusion seed ``sample_seed + i``
    (this is the evaluation loop of :func:`ropekit.robot.evaluate.evaluate_policy`). Returns one row per
    episode: ``success``, ``steps`` (the step of the first success when it succeeded), ``table_height_m``, and,
    at the step where the suction link came closest to the target before holding it: ``gap_m`` (the closest
    distance between them, :meth:`PickEnv.suction_gap`), ``dxy_m`` (horizontal tip-to-target distance),
    ``dz_m`` (tip height above the target's top face) and ``suction_on``; plus ``in_range_suction_on``
    (whether the gap was within the suction range at some step with the suction commanded on).
    """
    import torch
    from tqdm.auto import tqdm

    from .policy import PolicyRunner
    from .train import load_policy

    torch.set_num_threads(1)
    if not hasattr(policy, "config"):
        policy = load_policy(policy)
    seeds = episode_seeds(seed, episodes)
    rows = []
    with PickEnv(env_config(condition, policy.config.image_size, env_overrides)) as env:
        reach = env.config.suction_range
        for i in tqdm(range(episodes), desc=condition, unit="ep", disable=not progress):
            best: Dict[str, Any] = {"gap_m": float("inf"), "in_range_suction_on": False}

            def track(action: np.ndarray, obs: Mapping[str, np.ndarray], info: Mapping[str, Any]) -> None:
                if info["holding"]:
                    return
                gap = env.suction_gap()
                on = bool(action[3] > 0.5)
                best["in_range_suction_on"] |= on and gap <= reach
                if gap < best["gap_m"]:
                    tip = np.asarray(obs["state"][STATE_SLICES["ee_pos"]], dtype=np.float64)
                    target = env.target_position()
                    best.update(gap_m=gap, dxy_m=float(np.linalg.norm(tip[:2] - target[:2])),
                                dz_m=float(tip[2] - target[2] - env.target_half_height()), suction_on=on)

            res = rollout(env, PolicyRunner(policy, seed=sample_seed + i), seed=int(seeds[i]), on_step=track)
            if not math.isfinite(best["gap_m"]):  # held from the first step on: nothing to measure
                best.update(gap_m=None, dxy_m=None, dz_m=None, suction_on=True)
            rows.append({"episode": i, "success": bool(res.success), "steps": int(res.num_steps),
                         "table_height_m": env.table_height, **best})
    return rows


def summarize_grasp_errors(rows: Sequence[Mapping[str, Any]], suction_range: float = 0.012,
                           xy_tolerance: float = 0.06) -> Dict[str, Any]:
    """Counts of the failure kinds in :func:`grasp_errors` rows.

    ``off_target``: the suction link never came within ``suction_range`` of the target and, where it came
    closest, the tip was more than ``xy_tolerance`` away horizontally (the scripted expert still succeeds with
    6 cm of horizontal error: a horizontal miss); ``too_high``: never within range, but horizontally close
    enough (a height error); ``suction_off``: within range only with the suction off; ``no_lift``: within
    range with the suction on, yet no lift (pushed, dropped, timed out). Also the median closest gap of
    the failures (mm).
    """
    fails = [r for r in rows if not r["success"]]
    kinds = {"off_target": 0, "too_high": 0, "suction_off": 0, "no_lift": 0}
    for r in fails:
        if r["in_range_suction_on"]:
            kinds["no_lift"] += 1
        elif r["gap_m"] is not None and r["gap_m"] <= suction_range:
            kinds["suction_off"] += 1
        elif r["dxy_m"] is not None and r["dxy_m"] > xy_tolerance:
            kinds["off_target"] += 1
        else:
            kinds["too_high"] += 1
    gaps = [r["gap_m"] * 1000 for r in fails if r["gap_m"] is not None]
    return {"episodes": len(rows), "successes": len(rows) - len(fails), **{f"fail_{k}": v for k, v in kinds.items()},
            "median_gap_mm_fail": float(np.median(gaps)) if gaps else None}


def chunk_tracking(policy: Any, demos: Mapping[str, Any], steps: Sequence[int] = (0, 2, 4, 8),
                   seed: int = 0) -> List[Dict[str, Any]]:
    """How well ``policy``'s chunks follow the target at each episode step in ``steps`` (see module doc).

    ``demos`` should be episodes the policy was not trained on (``ropekit robot collect --seed`` another seed).
    Returns one row per step: ``step``, ``observations``, ``corr_x`` / ``corr_y`` (predicted vs expert chunk
    end), ``err_mm`` (mean horizontal distance between them), and with an auxiliary head ``aux_err_mm`` (mean
    horizontal error of its target position) and ``aux_corr_x``.
    """
    import torch

    from .train import DemoChunks, load_policy

    if not hasattr(policy, "config"):
        policy = load_policy(policy)
    data = DemoChunks(demos, policy.config, only_successful=False)
    step_of = np.asarray(demos["step"])[np.isin(np.asarray(demos["episode"]), data.episodes)]
    rows = []
    for k in steps:
        index = torch.from_numpy(np.flatnonzero(step_of == k))
        if len(index) < 3:
            continue
        images, state, actions = data.batch(index)
        with torch.no_grad():
            pred = policy.predict(images, state, torch.Generator().manual_seed(seed))  # (B, H, A)
        p_end, e_end = pred[:, -1, :2].numpy(), actions[:, -1, :2].numpy()
        row: Dict[str, Any] = {"step": int(k), "observations": int(len(index)),
                               "corr_x": float(np.corrcoef(p_end[:, 0], e_end[:, 0])[0, 1]),
                               "corr_y": float(np.corrcoef(p_end[:, 1], e_end[:, 1])[0, 1]),
                               "err_mm": float(np.linalg.norm(p_end - e_end, axis=1).mean() * 1000)}
        if getattr(policy, "aux_head", None) is not None and data.object_pos is not None:
            where = policy.aux_position(images, state)  # (B, 3) world
            truth = data.object_pos[index]
            row["aux_err_mm"] = float((where[:, :2] - truth[:, :2]).norm(dim=-1).mean() * 1000)
            row["aux_corr_x"] = float(np.corrcoef(where[:, 0].numpy(), truth[:, 0].numpy())[0, 1])
        rows.append(row)
    return rows


def depth_shuffle_effect(policy: Any, demos: Mapping[str, Any], every: int = 16, seed: int = 0) -> Dict[str, Any]:
    """Mean and largest change (mm) of an RGB-D policy's predicted tip targets when each image's depth patches
    are randomly permuted, on every ``every``-th demo observation (same diffusion noise for both predictions).

    Zero means the policy ignores depth. Raises ``ValueError`` for an RGB policy.
    """
    import torch

    from .train import DemoChunks, load_policy

    if not hasattr(policy, "config"):
        policy = load_policy(policy)
    if policy.config.modality != "rgbd":
        raise ValueError("depth_shuffle_effect needs an RGB-D policy (modality='rgbd')")
    data = DemoChunks(demos, policy.config, only_successful=False)
    images, state, _ = data.batch(torch.arange(0, len(data), every))  # (B, 4, Hi, Wi)
    p = policy.encoder.cfg.patch_size
    b, _, hi, wi = images.shape
    depth = images[:, 3].reshape(b, hi // p, p, wi // p, p).permute(0, 1, 3, 2, 4).reshape(b, -1, p, p)
    gen = torch.Generator().manual_seed(seed)
    perm = torch.stack([torch.randperm(depth.shape[1], generator=gen) for _ in range(b)])  # (B, M)
    shuffled = torch.gather(depth, 1, perm[:, :, None, None].expand_as(depth))
    shuffled = shuffled.reshape(b, hi // p, wi // p, p, p).permute(0, 1, 3, 2, 4).reshape(b, hi, wi)
    moved = images.clone()
    moved[:, 3] = shuffled
    with torch.no_grad():
        a = policy.predict(images, state, torch.Generator().manual_seed(seed))
        a_shuf = policy.predict(moved, state, torch.Generator().manual_seed(seed))
    diff = (a[..., :3] - a_shuf[..., :3]).norm(dim=-1) * 1000  # (B, H) mm
    return {"observations": b, "shuffle_diff_mm_mean": diff.mean().item(), "shuffle_diff_mm_max": diff.max().item()}
