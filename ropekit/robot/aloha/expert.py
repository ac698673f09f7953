"""Scripted ALOHA experts and cached demonstration sets.

The recipe of the ACT paper (Zhao et al., 2023): a scripted policy moves the two grippers through
end-effector waypoints (the gripper links follow mocap bodies), the joint trajectory this produces is
recorded, then replayed as joint position targets in the joint-controlled scene -- the scene the learned
policies act in. A demo counts only if the replay succeeds (reward 4); failed ones are dropped and counted.

Waypoints (``t`` in 50 Hz steps; gripper 1 open, 0 closed; positions linearly interpolated, quaternions
interpolated then normalised):

* transfer_cube: the right gripper (tilted 60 degrees about y) descends onto the cube, closes, carries it
  to a meeting point ``(0, 0.5, 0.25)``; the left gripper (rolled 90 degrees about x) comes in, closes on the
  cube, the right one opens and both move apart.
* insertion: each gripper picks its object (right: peg, left: socket), lifts it, and they meet at
  ``(0, 0.5, 0.15)``, ending 0.04 m either side of it (0.05 in ACT's script, which fails often with
  MuJoCo 3.x contact; 0.04 pushes the peg to the pin).

Demo set arrays (``T`` steps per episode, ``E`` kept episodes, ``N = E T`` rows; see :func:`collect_demos`):
``qpos (N, 14)`` float32, ``action (N, 14)`` float32, ``object_pos (N, 6)`` float32 (where the right arm's
and the left arm's objects are before each step, metres; replayed once for sets cached before it was recorded),
``episode (N,)``, ``step (N,)``; the images of every
``frame_stride``-th step, ``F`` frames: ``frame_row (F,)`` (their rows), ``rgb (F, Hi, Wi, 3)`` uint8 (first
camera), ``depth (F, Hi, Wi)`` float32 metres (when asked); ``episode_seed (E,)``,
``episode_length (E,)``, ``episode_success (E,)`` (all ones: only replayed successes are kept).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import numpy as np

from ..._io import atomic_write
from .sim import AlohaSim, axis_angle_quat, quat_mul, task_spec

__all__ = ["DemoConfig", "waypoints", "expert_actions", "expert_episode", "collect_demos", "load_or_collect",
           "default_cache_dir", "save_demo_set", "load_demo_set"]

PathLike = Union[str, "os.PathLike[str]"]
_FORMAT_VERSION = 1


@dataclass
class DemoConfig:
    """A demonstration set: task, episodes (seeds ``seed, seed + 1, ...``), what is rendered.

    Args:
        task: ``transfer_cube`` or ``insertion``.
        episodes: demos to keep (successful replays); collection gives up after ``episodes * max_tries_factor``
            attempts.
        seed: first object-pose seed.
        episode_steps: steps per episode (the scripts are timed for 400).
        cameras: rendered cameras; the first is the policy's view.
        image_hw: ``(Hi, Wi)`` rendered size.
        depth: also record depth (metres) of the first camera.
        fovy: vertical field of view (degrees) of the recorded camera; ``None``: the scene's.
        frame_stride: images are rendered every ``frame_stride`` steps (the training examples are those
            steps; proprioception and actions are kept for every step).
    """

    task: str = "transfer_cube"
    episodes: int = 50
    seed: int = 0
    episode_steps: int = 400
    cameras: Tuple[str, ...] = ("top",)
    image_hw: Tuple[int, int] = (48, 64)
    depth: bool = False
    fovy: Optional[float] = None
    frame_stride: int = 2
    max_tries_factor: float = 2.0

    def __post_init__(self) -> None:
        self.task = task_spec(self.task).name
        self.cameras = tuple(self.cameras)
        self.image_hw = (int(self.image_hw[0]), int(self.image_hw[1]))
        if self.episodes < 1:
            raise ValueError(f"episodes must be >= 1, got {self.episodes}")
        if self.episode_steps < 1:
            raise ValueError(f"episode_steps must be >= 1, got {self.episode_steps}")

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["cameras"], d["image_hw"] = list(self.cameras), list(self.image_hw)
        return d

    def key(self) -> str:
        """A short hash of everything that changes the arrays (the cache file's name)."""
        d = self.to_dict()
        if d["fovy"] is None:  # the scene's own camera: the key of sets recorded before the option existed
            del d["fovy"]
        blob = json.dumps({**d, "version": _FORMAT_VERSION}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def waypoints(task: str, object_pose: np.ndarray, init_left: np.ndarray, init_right: np.ndarray
              ) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """The scripted waypoints ``[{t, xyz (3,), quat (4,), gripper}]`` of the left and right grippers."""
    spec = task_spec(task)
    obj = np.asarray(object_pose, dtype=np.float64)

    def wp(t, xyz, quat, g):
        return {"t": t, "xyz": np.asarray(xyz, dtype=np.float64), "quat": np.asarray(quat, dtype=np.float64),
                "gripper": float(g)}

    if spec.name == "transfer_cube":
        box = obj[:3]
        pick = quat_mul(init_right[3:], axis_angle_quat([0, 1, 0], -60))
        meet_left = axis_angle_quat([1, 0, 0], 90)
        meet = np.array([0.0, 0.5, 0.25])
        ident = np.array([1.0, 0, 0, 0])
        left = [wp(0, init_left[:3], init_left[3:], 0),
                wp(100, meet + [-0.1, 0, -0.02], meet_left, 1),   # approach the meeting point
                wp(260, meet + [0.02, 0, -0.02], meet_left, 1),   # reach the cube
                wp(310, meet + [0.02, 0, -0.02], meet_left, 0),   # close on it
                wp(360, meet + [-0.1, 0, -0.02], ident, 0),       # pull it away
                wp(400, meet + [-0.1, 0, -0.02], ident, 0)]
        right = [wp(0, init_right[:3], init_right[3:], 0),
                 wp(90, box + [0, 0, 0.08], pick, 1),             # above the cube
                 wp(130, box + [0, 0, -0.015], pick, 1),          # down
                 wp(170, box + [0, 0, -0.015], pick, 0),          # grasp
                 wp(200, meet + [0.05, 0, 0], pick, 0),           # carry
                 wp(220, meet, pick, 0),                          # to the meeting point
                 wp(310, meet, pick, 1),                          # release
                 wp(360, meet + [0.1, 0, 0], pick, 1),            # move away
                 wp(400, meet + [0.1, 0, 0], pick, 1)]
        return left, right
    peg, socket = obj[:3], obj[7:10]
    pick_r = quat_mul(init_right[3:], axis_angle_quat([0, 1, 0], -60))
    pick_l = quat_mul(init_left[3:], axis_angle_quat([0, 1, 0], 60))
    meet = np.array([0.0, 0.5, 0.15])
    lift_r = 0.00715
    left = [wp(0, init_left[:3], init_left[3:], 0),
            wp(120, socket + [0, 0, 0.08], pick_l, 1),
            wp(170, socket + [0, 0, -0.03], pick_l, 1),
            wp(220, socket + [0, 0, -0.03], pick_l, 0),
            wp(285, meet + [-0.1, 0, 0], pick_l, 0),
            wp(340, meet + [-0.04, 0, 0], pick_l, 0),             # insert
            wp(400, meet + [-0.04, 0, 0], pick_l, 0)]
    right = [wp(0, init_right[:3], init_right[3:], 0),
             wp(120, peg + [0, 0, 0.08], pick_r, 1),
             wp(170, peg + [0, 0, -0.03], pick_r, 1),
             wp(220, peg + [0, 0, -0.03], pick_r, 0),
             wp(285, meet + [0.1, 0, lift_r], pick_r, 0),
             wp(340, meet + [0.04, 0, lift_r], pick_r, 0),
             wp(400, meet + [0.04, 0, lift_r], pick_r, 0)]
    return left, right


def _interp(traj: List[Dict[str, Any]], t: int) -> np.ndarray:
    """``[xyz, quat, gripper]`` ``(8,)`` at step ``t`` (held after the last waypoint)."""
    for a, b in zip(traj[:-1], traj[1:]):
        if a["t"] <= t <= b["t"]:
            f = (t - a["t"]) / max(1, b["t"] - a["t"])
            q = a["quat"] + f * (b["quat"] - a["quat"])
            return np.concatenate([a["xyz"] + f * (b["xyz"] - a["xyz"]), q / np.linalg.norm(q),
                                   [a["gripper"] + f * (b["gripper"] - a["gripper"])]])
    last = traj[-1]
    return np.concatenate([last["xyz"], last["quat"], [last["gripper"]]])


def expert_actions(task: str, object_pose: np.ndarray, steps: int = 400) -> np.ndarray:
    """End-effector actions ``(steps, 16)`` of the scripted expert for one object pose."""
    init_left = np.array([-0.31718881, 0.5, 0.29525084, 1, 0, 0, 0])
    init_right = np.array([0.31718881, 0.49999888, 0.29525084, 1, 0, 0, 0])
    left, right = waypoints(task, object_pose, init_left, init_right)
    return np.stack([np.concatenate([_interp(left, t), _interp(right, t)]) for t in range(steps)])


def expert_episode(task: str, seed: int, steps: int = 400, replay: Optional[AlohaSim] = None,
                   ee_sim: Optional[AlohaSim] = None, frame_stride: int = 1) -> Dict[str, Any]:
    """Run the scripted expert for object-pose ``seed`` and replay its joint trajectory.

    Args:
        replay: the joint-controlled sim to replay in (its cameras and size are what is recorded); a
            camera-less one is made when ``None``.
        ee_sim: a reusable end-effector sim (made when ``None``).
        frame_stride: render only every ``frame_stride``-th step (``F = ceil(T / frame_stride)`` frames).

    Returns:
        ``{"qpos": (T, 14), "action": (T, 14), "rgb": (F, Hi, Wi, 3) or None, "depth": (F, Hi, Wi) or None,
        "ee_success": bool, "success": bool (the replay's), "max_reward": int, "reach_gap": float (the
        replay's closest approach of the right gripper to its object, metres; see ``AlohaSim.reach_gap``)}``;
        ``T = steps``; ``qpos[t]`` and the images are the observation the action ``action[t]`` answers.
    """
    ee = ee_sim if ee_sim is not None else AlohaSim(task, mode="ee", cameras=())
    ee.reset(seed=seed)
    pose = ee.object_pose
    joint_traj, ee_reward = [], 0
    for a in expert_actions(task, pose, steps):
        _, r = ee.step(a)
        ee_reward = max(ee_reward, r)
        q = ee.qpos().astype(np.float64)
        q[6], q[13] = ee.gripper_ctrl()  # command the gripper, not its lagging finger position
        joint_traj.append(q)
    actions = np.asarray(joint_traj, dtype=np.float32)  # (T, 14)
    sim = replay if replay is not None else AlohaSim(task, mode="joint", cameras=())
    cam = sim.cameras[0] if sim.cameras else None
    obs = sim.reset(object_pose=pose, render=False)
    qpos, objects, rgb, depth, best, gap = [], [], [], [], 0, sim.reach_gap()
    for t, a in enumerate(actions):
        qpos.append(obs["qpos"])
        objects.append(sim.object_positions())
        if cam is not None and t % frame_stride == 0:
            image, d = sim.render(cam)
            rgb.append(image)
            if d is not None:
                depth.append(d)
        obs, r = sim.step(a, render=False)
        best, gap = max(best, r), min(gap, sim.reach_gap())
    return {"qpos": np.asarray(qpos, dtype=np.float32), "action": actions,
            "object_pos": np.asarray(objects, dtype=np.float32),
            "rgb": np.asarray(rgb) if rgb else None, "depth": np.asarray(depth) if depth else None,
            "ee_success": ee_reward >= 4, "success": best >= 4, "max_reward": best, "reach_gap": gap}


class _Episodes:
    """Replays expert episodes of one demo configuration: ``(seed) -> (seed, episode)``, reusing one replay sim
    and one end-effector sim."""

    def __init__(self, cfg: DemoConfig) -> None:
        self.cfg = cfg
        self.sim = AlohaSim(cfg.task, mode="joint", cameras=cfg.cameras[:1], image_hw=cfg.image_hw,
                            depth=cfg.depth, fovy=cfg.fovy)
        self.ee = AlohaSim(cfg.task, mode="ee", cameras=())

    def __call__(self, seed: int) -> Tuple[int, Dict[str, Any]]:
        c = self.cfg
        return seed, expert_episode(c.task, seed, c.episode_steps, replay=self.sim, ee_sim=self.ee,
                                    frame_stride=c.frame_stride)


_IN_WORKER: List[_Episodes] = []  # a pool worker's own _Episodes (set by its initialiser)


def _worker_init(cfg: Dict[str, Any]) -> None:
    _IN_WORKER.append(_Episodes(DemoConfig(**cfg)))


def _worker_episode(seed: int) -> Tuple[int, Dict[str, Any]]:
    return _IN_WORKER[0](seed)


def _episodes(cfg: DemoConfig, seeds: range, workers: int):
    """``(seed, episode)`` for ``seeds`` in seed order; ``workers > 1`` simulates them in that many processes
    (each episode depends only on its seed, so the order and the arrays are those of one process)."""
    if workers <= 1:
        yield from map(_Episodes(cfg), seeds)
        return
    import multiprocessing as mp

    # spawn, not fork: a forked MuJoCo/EGL context is not safe to reuse.
    with mp.get_context("spawn").Pool(workers, initializer=_worker_init, initargs=(cfg.to_dict(),)) as pool:
        yield from pool.imap(_worker_episode, seeds, chunksize=1)


def collect_demos(cfg: DemoConfig, progress: bool = False, workers: int = 1) -> Dict[str, np.ndarray]:
    """Collect ``cfg.episodes`` successful replayed expert demos (arrays in the module docstring).

    Seeds are tried in order from ``cfg.seed``; the first ``cfg.episodes`` successes are kept, so the set does
    not depend on ``workers`` (processes that simulate episodes side by side).

    Also returns ``attempts``, ``failed_seeds`` and ``seconds`` entries (the expert's success rate is
    ``episodes / attempts``).

    Raises:
        RuntimeError: fewer than ``cfg.episodes`` successes within ``episodes * max_tries_factor`` attempts.
        ValueError: ``workers < 1``.
    """
    from tqdm.auto import tqdm

    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    t0 = time.time()
    max_tries = max(cfg.episodes, int(np.ceil(cfg.episodes * cfg.max_tries_factor)))
    kept: List[Dict[str, Any]] = []
    seeds: List[int] = []
    failed: List[int] = []
    bar = tqdm(total=cfg.episodes, desc=f"demos {cfg.task}", unit="demo", disable=not progress)
    episodes = _episodes(cfg, range(cfg.seed, cfg.seed + max_tries), workers)
    try:
        for s, ep in episodes:
            if ep["success"]:
                kept.append(ep)
                seeds.append(s)
                bar.update(1)
            else:
                failed.append(s)
            if len(kept) == cfg.episodes:
                break
    finally:
        episodes.close()
    bar.close()
    attempts = len(kept) + len(failed)
    if len(kept) < cfg.episodes:
        raise RuntimeError(f"the scripted {cfg.task} expert succeeded in only {len(kept)} of {attempts} "
                           f"replays (wanted {cfg.episodes})")
    T = cfg.episode_steps
    out: Dict[str, np.ndarray] = {
        "qpos": np.concatenate([e["qpos"] for e in kept]),
        "action": np.concatenate([e["action"] for e in kept]),
        "object_pos": np.concatenate([e["object_pos"] for e in kept]),
        "rgb": np.concatenate([e["rgb"] for e in kept]),
        "episode": np.repeat(np.arange(len(kept)), T),
        "step": np.tile(np.arange(T), len(kept)),
        "frame_row": np.concatenate([i * T + np.arange(0, T, cfg.frame_stride) for i in range(len(kept))]),
        "episode_seed": np.asarray(seeds),
        "episode_length": np.full(len(kept), T),
        "episode_success": np.ones(len(kept), dtype=bool),
        "attempts": np.asarray(attempts),
        "failed_seeds": np.asarray(failed, dtype=np.int64),
        "seconds": np.asarray(time.time() - t0),
    }
    if cfg.depth:
        out["depth"] = np.concatenate([e["depth"] for e in kept]).astype(np.float32)
    return out


def default_cache_dir() -> Path:
    """``$ROPEKIT_ALOHA_CACHE`` or ``~/.cache/ropekit/aloha``."""
    env = os.environ.get("ROPEKIT_ALOHA_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "ropekit" / "aloha"


def save_demo_set(demos: Dict[str, np.ndarray], path: PathLike, cfg: Optional[DemoConfig] = None) -> Path:
    """Write ``demos`` (and ``cfg`` as JSON) to ``path`` (.npz) atomically: a temporary file, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = dict(demos)
    if cfg is not None:
        arrays["config_json"] = np.asarray(json.dumps(cfg.to_dict(), sort_keys=True))
    return atomic_write(path, lambda f: np.savez(f, **arrays))


def load_demo_set(path: PathLike) -> Dict[str, np.ndarray]:
    """Read a demo set written by :func:`save_demo_set` (all arrays in memory)."""
    with np.load(Path(path), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def replay_object_positions(task: str, demos: Mapping[str, Any], progress: bool = False) -> np.ndarray:
    """Replay every demo of ``demos`` (physics only: its seed's object pose, then its recorded joint targets) and
    return where each arm's object was before each step: ``(steps, 6)`` float32 in the set's row order (see
    :meth:`AlohaSim.object_positions`). About 0.2 s per 400-step demo.

    Raises:
        RuntimeError: a replay does not start from the recorded joint positions (another simulator version).
    """
    from tqdm.auto import tqdm

    sim = AlohaSim(task, mode="joint", cameras=())
    actions, qpos = np.asarray(demos["action"]), np.asarray(demos["qpos"])
    out, row = np.zeros((len(actions), 6), np.float32), 0
    pairs = list(zip(np.asarray(demos["episode_seed"]), np.asarray(demos["episode_length"])))
    for seed, length in tqdm(pairs, desc=f"object positions {task}", unit="demo", disable=not progress):
        obs = sim.reset(seed=int(seed), render=False)
        if np.abs(obs["qpos"] - qpos[row]).max() > 1e-6:
            raise RuntimeError(f"the replay of demo seed {seed} does not start from the recorded joint positions")
        for t in range(int(length)):
            out[row + t] = sim.object_positions()
            sim.step(actions[row + t].astype(np.float64), render=False)
        row += int(length)
    return out


def _replayed_object_positions(task: str, demos: Mapping[str, Any], path: Path, progress: bool) -> np.ndarray:
    """:func:`replay_object_positions` of the cached set at ``path``, itself cached beside it."""
    side = path.with_name(path.name + ".objects.npy")
    if side.exists():
        return np.load(side)
    positions = replay_object_positions(task, demos, progress)
    atomic_write(side, lambda f: np.save(f, positions))
    return positions


def load_or_collect(cfg: DemoConfig, cache_dir: Optional[PathLike] = None, progress: bool = False,
                    workers: int = 1) -> Tuple[Dict[str, np.ndarray], Path, bool]:
    """The demo set of ``cfg`` from ``cache_dir/<task>-<hash>.npz``, collecting and caching it when absent
    (``workers`` processes side by side; the set does not depend on their number).

    Returns:
        ``(demos, path, was_cached)``.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = root / f"{cfg.task}-{cfg.key()}.npz"
    if path.exists():
        demos = load_demo_set(path)
        if "object_pos" not in demos:  # a set collected before the positions were recorded
            demos["object_pos"] = _replayed_object_positions(cfg.task, demos, path, progress)
        return demos, path, True
    demos = collect_demos(cfg, progress=progress, workers=workers)
    save_demo_set(demos, path, cfg)
    demos["config_json"] = np.asarray(json.dumps(cfg.to_dict(), sort_keys=True))  # as a cached set reads back
    return demos, path, False
