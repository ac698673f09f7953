"""Demonstration collection and policy rollouts for :class:`~ropekit.robot.env.PickEnv`.

* :func:`collect_demos` runs the :class:`~ropekit.robot.expert.ScriptedExpert` for ``n_episodes`` in
  worker processes and writes one ``.npz`` (atomically: temp file + ``os.replace``).
* :func:`load_demos` reads it back (with the config decoded).
* :func:`rollout` runs any ``policy_fn(obs) -> action`` for one episode, optionally recording frames.

Demo file layout (``N`` = total steps = sum of episode lengths, ``E`` = episodes, ``S`` = ``STATE_DIM``)::

    rgb              (N, H, W, 3) uint8    observation *before* the action
    depth            (N, H, W)    float32  metric depth, metres
    state            (N, S)       float32  tip xyz, gripper, 7 joint angles
    action           (N, 4)       float32  tip target xyz (world) + gripper command
    target           (N, 3)       float32  the target object's centre (world) before the action (privileged)
    episode          (N,)         int32    episode index in [0, E)
    step             (N,)         int32    step index within the episode
    step_success     (N,)         bool     target lifted after this step's action
    episode_success  (E,)         bool     success at the end of the episode
    episode_seed     (E,)         int64    seed passed to env.reset (reproduces the episode)
    episode_length   (E,)         int32
    table_height     (E,)         float32
    intrinsics       (3, 3)       float32  ;  extrinsics (4, 4) float32 camera-from-world (OpenCV)
    config_json      ()           str      PickConfig as JSON ; expert_json: the expert's arguments
    (+ rgb_side, depth_side, intrinsics_side, extrinsics_side when config.second_view)

Failed episodes are kept (filter with ``episode_success[episode]``). Episode ``i`` always uses the same
seed for a given ``seed`` whatever the number of workers, so files are reproducible.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import numpy as np

from .._io import atomic_write
from .env import PickConfig, PickEnv, require_pybullet
from .expert import ScriptedExpert

__all__ = ["collect_demos", "load_demos", "rollout", "RolloutResult", "episode_seeds", "default_start_method"]

PolicyFn = Callable[[Dict[str, np.ndarray]], Sequence[float]]


def episode_seeds(seed: int, n_episodes: int) -> np.ndarray:
    """Independent per-episode env seeds ``(n_episodes,)`` int64 derived from one ``seed``."""
    return np.random.SeedSequence(int(seed)).generate_state(max(n_episodes, 1), dtype=np.uint32)[
        :n_episodes
    ].astype(np.int64)


# ---- rollouts ----------------------------------------------------------------------------------------
@dataclass
class RolloutResult:
    """Outcome of :func:`rollout`.

    ``frames``: ``(T + 1, h, w, 3)`` uint8 (initial observation, then one per step) if recorded, else
    ``None``; ``depths``: ``(T + 1, H, W)`` float32 likewise (observation resolution).
    """

    success: bool
    num_steps: int
    first_success_step: Optional[int]
    total_reward: float
    frames: Optional[np.ndarray] = None
    depths: Optional[np.ndarray] = None


def rollout(
    env: PickEnv,
    policy_fn: PolicyFn,
    seed: Optional[int] = None,
    record: bool = False,
    frame_size: Optional[int] = None,
    on_step: Optional[Callable[[np.ndarray, Dict[str, np.ndarray], Dict[str, Any]], None]] = None,
) -> RolloutResult:
    """Run ``policy_fn`` for one episode of ``env`` from ``env.reset(seed)``.

    ``policy_fn(obs) -> action (4,)``; if it has a ``reset()`` method, it is called right after the env
    reset (stateful policies, the scripted expert). ``success`` is the env's success at the final step.
    With ``record``, RGB frames are kept: the observation images, or, if ``frame_size`` is given, a
    separate rendering of the front camera at that size (for GIFs / image strips). ``on_step(action, obs,
    info)`` is called after every step with the action taken and what the env returned (for measurements).
    """
    obs = env.reset(seed)
    if hasattr(policy_fn, "reset"):
        policy_fn.reset()  # type: ignore[attr-defined]
    frames: List[np.ndarray] = []
    depths: List[np.ndarray] = []

    def _record(o: Dict[str, np.ndarray]) -> None:
        if record:
            frames.append(env.render(size=frame_size) if frame_size else o["rgb"])
            depths.append(o["depth"])

    _record(obs)
    done, info, total, first = False, {"success": False}, 0.0, None
    while not done:
        action = np.asarray(policy_fn(obs), dtype=np.float64)
        obs, reward, done, info = env.step(action)
        if on_step is not None:
            on_step(action, obs, info)
        total += reward
        if info["success"] and first is None:
            first = int(info["t"])
        _record(obs)
    return RolloutResult(
        success=bool(info["success"]),
        num_steps=env.t,
        first_success_step=first,
        total_reward=total,
        frames=np.stack(frames) if record else None,
        depths=np.stack(depths) if record else None,
    )


# ---- demo collection ---------------------------------------------------------------------------------
_WORKER: Dict[str, Any] = {}


def _init_worker(config: PickConfig, expert_kwargs: Dict[str, Any], clean_labels: bool = False) -> None:
    env = PickEnv(config)
    _WORKER["env"] = env
    _WORKER["expert_kwargs"] = expert_kwargs
    _WORKER["clean_labels"] = clean_labels


def _record_episode(args: Sequence[int]) -> Dict[str, Any]:
    index, seed = int(args[0]), int(args[1])
    env: PickEnv = _WORKER["env"]
    expert = ScriptedExpert(env, seed=seed + 1, **_WORKER["expert_kwargs"])
    obs = env.reset(seed)
    expert.reset()
    keys = [k for k in obs if k.startswith(("rgb", "depth"))]
    rec: Dict[str, List[Any]] = {k: [] for k in keys + ["state", "action", "target", "step_success"]}
    done, info = False, {"success": False}
    while not done:
        action = expert(obs)
        for k in keys:
            rec[k].append(obs[k])
        rec["state"].append(obs["state"])
        rec["target"].append(env.target_position().astype(np.float32))
        rec["action"].append(expert.clean_action if _WORKER.get("clean_labels") else action)
        obs, _, done, info = env.step(action)
        rec["step_success"].append(bool(info["success"]))
    out: Dict[str, Any] = {k: np.stack(v) for k, v in rec.items()}
    out["index"], out["seed"], out["success"] = index, seed, bool(info["success"])
    out["table_height"] = env.table_height
    out["camera"] = {k: v for k, v in obs.items() if k.startswith(("intrinsics", "extrinsics"))}
    return out


def default_start_method() -> str:
    # forkserver/spawn: safe when the parent already runs threads (torch); fork is not.
    methods = mp.get_all_start_methods()
    return "forkserver" if (sys.platform.startswith("linux") and "forkserver" in methods) else "spawn"


def collect_demos(
    n_episodes: int,
    config: Optional[PickConfig] = None,
    seed: int = 0,
    workers: int = 2,
    out: Optional[Union[str, os.PathLike]] = None,
    progress: bool = True,
    noise: float = 0.0,
    expert_kwargs: Optional[Dict[str, Any]] = None,
    compress: bool = True,
    start_method: Optional[str] = None,
    clean_labels: bool = False,
) -> Dict[str, np.ndarray]:
    """Record ``n_episodes`` scripted-expert episodes; write them to ``out`` (``.npz``) if given.

    Args:
        n_episodes: number of episodes (each ``config.max_steps`` steps unless it terminates early).
        config: env config (default :meth:`PickConfig.in_distribution`).
        seed: master seed; episode ``i`` uses ``episode_seeds(seed, n_episodes)[i]``.
        workers: worker processes (``<= 1``: run in this process).
        out: output path; written atomically (temp file in the same directory, then ``os.replace``).
        progress: show a tqdm progress bar (episodes, running success rate).
        noise: std (m) of the expert's action noise.
        clean_labels: execute the noisy actions but record the expert's noise-free ones as the labels (DART:
            the demos then show corrections from the states the noise leads to).
        expert_kwargs: further :class:`ScriptedExpert` arguments.
        compress: ``np.savez_compressed`` instead of ``np.savez``.
        start_method: multiprocessing start method (default ``forkserver`` on Linux, else ``spawn``).

    Returns:
        The arrays written to the file (layout in the module docstring).
    """
    if n_episodes < 1:
        raise ValueError(f"n_episodes must be >= 1, got {n_episodes}")
    require_pybullet()  # here, not in the workers: a worker that fails to start is restarted, forever
    from tqdm.auto import tqdm

    config = config if config is not None else PickConfig.in_distribution()
    ekw = {"noise": float(noise), **(expert_kwargs or {})}
    seeds = episode_seeds(seed, n_episodes)
    tasks = [(i, int(s)) for i, s in enumerate(seeds)]
    episodes: List[Dict[str, Any]] = []
    bar = tqdm(total=n_episodes, desc="demos", unit="ep", disable=not progress)
    n_ok = 0

    def _consume(ep: Dict[str, Any]) -> None:
        nonlocal n_ok
        episodes.append(ep)
        n_ok += ep["success"]
        bar.update(1)
        bar.set_postfix(success=f"{n_ok / len(episodes):.2f}")

    try:
        if workers <= 1:
            _init_worker(config, ekw, clean_labels)
            try:
                for t in tasks:
                    _consume(_record_episode(t))
            finally:
                _WORKER.pop("env").close()
        else:
            method = start_method or default_start_method()
            ctx = mp.get_context(method)
            if method == "forkserver":  # import this module (and torch, via ropekit) once, in the server
                ctx.set_forkserver_preload([__name__])
            with ctx.Pool(min(workers, n_episodes), initializer=_init_worker,
                          initargs=(config, ekw, clean_labels)) as pool:
                for ep in pool.imap_unordered(_record_episode, tasks):
                    _consume(ep)
    finally:
        bar.close()

    episodes.sort(key=lambda e: e["index"])
    frame_keys = [k for k in episodes[0] if k.startswith(("rgb", "depth"))]
    data: Dict[str, np.ndarray] = {k: np.concatenate([e[k] for e in episodes]) for k in frame_keys}
    data["state"] = np.concatenate([e["state"] for e in episodes]).astype(np.float32)
    data["action"] = np.concatenate([e["action"] for e in episodes]).astype(np.float32)
    data["target"] = np.concatenate([e["target"] for e in episodes]).astype(np.float32)
    lengths = np.array([len(e["action"]) for e in episodes], dtype=np.int32)
    data["episode"] = np.repeat(np.arange(n_episodes, dtype=np.int32), lengths)
    data["step"] = np.concatenate([np.arange(n, dtype=np.int32) for n in lengths])
    data["step_success"] = np.concatenate([e["step_success"] for e in episodes]).astype(bool)
    data["episode_success"] = np.array([e["success"] for e in episodes], dtype=bool)
    data["episode_seed"] = seeds
    data["episode_length"] = lengths
    data["table_height"] = np.array([e["table_height"] for e in episodes], dtype=np.float32)
    data.update(episodes[0]["camera"])
    data["config_json"] = np.array(json.dumps(dataclasses.asdict(config)))
    data["expert_json"] = np.array(json.dumps({**ekw, "clean_labels": bool(clean_labels)}))
    if out is not None:
        atomic_write(Path(out), lambda f: (np.savez_compressed if compress else np.savez)(f, **data))
    return data


def load_demos(path: Union[str, os.PathLike]) -> Dict[str, Any]:
    """Load a file written by :func:`collect_demos`; ``config`` is decoded to a :class:`PickConfig`.

    Raises:
        FileNotFoundError: no such file (one line: how to record one).
        ValueError: a file that is not such a recording.
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"no demonstrations at {path} (record them with `ropekit robot collect --out FILE`)")
    what = f"{path} is not a demonstrations file of `ropekit robot collect`"
    try:
        z = np.load(file, allow_pickle=False)
    except (ValueError, OSError) as e:  # (not an .npz: numpy's words are about pickles)
        raise ValueError(f"{what} (not an .npz archive)") from e
    if not hasattr(z, "files"):
        raise ValueError(f"{what} (a single .npy array)")
    with z:
        if "config_json" not in z.files or "expert_json" not in z.files:
            raise ValueError(what)
        data: Dict[str, Any] = {k: z[k] for k in z.files}
    cfg = json.loads(str(data.pop("config_json")))
    for k, v in cfg.items():  # JSON turns tuples into lists
        if isinstance(v, list):
            cfg[k] = tuple(tuple(x) if isinstance(x, list) else x for x in v)
    data["config"] = PickConfig(**cfg)
    data["expert"] = json.loads(str(data.pop("expert_json")))
    return data
