"""Evaluating robot policies: success over seeded episodes of a condition, its Wilson interval, the
two-proportion z statistic, and the cached, parallel evaluation of run folders behind ``ropekit robot eval``
(the robot study, in the ``ropekit-studies`` distribution, evaluates through these too).
"""

from __future__ import annotations

import hashlib
import json
import math
import multiprocessing as mp
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..train.metrics import atomic_write_text
from .demos import default_start_method

__all__ = ["wilson_interval", "pooled_z", "evaluate_policy", "evaluate_run", "map_jobs", "format_rate"]


def wilson_interval(successes: int, n: int, z: float = 1.96) -> Tuple[float, float]:
    """Wilson score interval of a binomial proportion (95 % for ``z = 1.96``); ``(0, 1)`` when ``n = 0``."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def pooled_z(k1: int, n1: int, k2: int, n2: int) -> float:
    """Two-proportion z statistic of ``k1 / n1`` against ``k2 / n2`` with the pooled variance (``nan`` when both
    proportions are 0 or both are 1, where it is undefined). It treats every episode as independent, so it
    ignores the spread between training seeds: read it beside the per-seed differences."""
    pooled = (k1 + k2) / (n1 + n2)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n1 + 1 / n2))
    return (k1 / n1 - k2 / n2) / se if se > 0 else float("nan")


def evaluate_policy(policy: Any, condition: str, episodes: int, seed: int = 1000,
                    env_overrides: Optional[Mapping[str, Any]] = None, progress: bool = False,
                    sample_seed: int = 0) -> Dict[str, Any]:
    """Success of ``policy`` (a :class:`DiffusionPolicy` or a run folder) on ``episodes`` episodes of a condition.

    Episode ``i`` uses env seed ``episode_seeds(seed, episodes)[i]`` and diffusion seed ``sample_seed + i``, so
    every policy and condition sees the same scenes. Returns counts, the rate, its 95 % Wilson interval, the
    mean step of first success, the per-episode outcomes and grasp errors
    (:func:`~ropekit.robot.diagnose.grasp_errors`) and the failure kinds.
    """
    from .diagnose import grasp_errors, summarize_grasp_errors

    rows = grasp_errors(policy, episodes, condition, seed, env_overrides=env_overrides, sample_seed=sample_seed,
                        progress=progress)
    outcomes = [r["success"] for r in rows]
    first = [r["steps"] for r in rows if r["success"]]
    k = int(sum(outcomes))
    lo, hi = wilson_interval(k, episodes)
    return {"condition": condition, "episodes": episodes, "successes": k, "success_rate": k / episodes,
            "ci95_low": lo, "ci95_high": hi, "mean_steps_to_success": float(np.mean(first)) if first else None,
            "outcomes": outcomes, "failures": summarize_grasp_errors(rows), "grasp": rows}


def evaluate_run(args: Tuple[str, str, str, int, int, Dict[str, Any]]) -> Dict[str, Any]:
    """Evaluate one ``(name, run folder, condition, episodes, seed, env overrides)`` job; the result is kept in ``<run>/eval_<condition>.json`` and reused
    while the run's checkpoint and the evaluation settings are unchanged."""
    name, run_dir, condition, episodes, seed, overrides = args
    from .train import CHECKPOINT

    ckpt = Path(run_dir) / CHECKPOINT
    cache = Path(run_dir) / f"eval_{condition}.json"
    key = {"episodes": episodes, "seed": seed, "env": overrides, "version": 2,
           "checkpoint_sha256": hashlib.sha256(ckpt.read_bytes()).hexdigest() if ckpt.exists() else None}
    if cache.exists():
        hit = json.loads(cache.read_text())
        if hit.get("key") == key:
            return hit["result"]
    result = {"policy": name, **evaluate_policy(run_dir, condition, episodes, seed, overrides)}
    if ckpt.exists():
        atomic_write_text(cache, json.dumps({"key": key, "result": result}))
    return result


def map_jobs(fn, jobs: Sequence[Any], workers: int, progress: bool, desc: str) -> List[Any]:
    """``[fn(j) for j in jobs]``, in ``workers`` processes (forkserver, like demo collection) when ``> 1``."""
    from tqdm.auto import tqdm

    bar = tqdm(total=len(jobs), desc=desc, disable=not progress)
    out: List[Any] = []
    try:
        if workers <= 1:
            for j in jobs:
                out.append(fn(j))
                bar.update(1)
        else:
            method = default_start_method()
            ctx = mp.get_context(method)
            if method == "forkserver":
                ctx.set_forkserver_preload(sorted({__name__, fn.__module__}))
            with ctx.Pool(min(workers, len(jobs))) as pool:
                for r in pool.imap(fn, jobs):
                    out.append(r)
                    bar.update(1)
    finally:
        bar.close()
    return out


def format_rate(r: Mapping[str, Any]) -> str:
    """``k/n = p % [low, high]``: an :func:`evaluate_policy` result's success rate with its 95 % interval."""
    return (f"{r['successes']}/{r['episodes']} = {100 * r['success_rate']:.0f} % "
            f"[{100 * r['ci95_low']:.0f}, {100 * r['ci95_high']:.0f}]")
