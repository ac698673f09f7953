"""A scripted expert for :class:`~ropekit.robot.env.PickEnv` (uses the privileged object pose).

Phases: *approach* (to ``approach_height`` above the target's top) → *descend* (towards ``press_depth``
below the top face, suction switched on once the tip is within ``suction_height`` of the top) → *lift* (to
``lift_height`` above the resting top, as soon as the suction holds the target) → *hold*. A descent that
reaches its waypoint without attaching closes the suction for ``close_steps`` in place (*close*); a
descent that stalls, or a target lost during the lift, starts over from *approach*.

Why press with the suction already on: the suction attaches within ``PickConfig.suction_range`` (12 mm)
of the gripper's last link, and a learned policy has to read the target's height from the image. Measured with this
expert given a wrong belief of the target's height (40 in-distribution scenes each,
``docs/results/robot/diagnosis``): stopping *on* the top face and closing there (``press_depth=0,
suction_height=0``) succeeds only for height errors within ±10 mm (0/40 at +15 mm), while pressing 2 cm in
with the suction on from 3 cm above (the default) succeeds for errors from −20 mm to +30 mm. The
demonstrations then show a motion that a policy with centimetre-level height errors still completes.
Horizontal errors up to 6 cm cost nothing (the suction link is wider than the targets' tops).

Actions are in the env's action space: ``(4,)`` float32 = absolute tip target xyz (world frame, m) +
gripper command (1.0 closed / 0.0 open). ``belief_offset`` (metres, world frame) is added to the target
position the expert plans with: a wrong belief, for measuring how precise a policy must be
(:func:`ropekit.robot.diagnose.expert_tolerance`). Each action moves at most ``max_step`` metres from the current
tip position, so demonstrations are smooth waypoint sequences. ``noise > 0`` adds Gaussian noise (std in
metres) to the position part of every action for diversity; the gripper command is never noised.
:attr:`clean_action` keeps the last action before its noise: recording it as the label while the noisy
one is executed (``collect_demos(clean_labels=True)``) shows a policy how the expert corrects a deviation
(DART, Laskey et al. 2017) instead of teaching it the noise.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import numpy as np

from .env import STATE_SLICES, PickEnv

__all__ = ["ScriptedExpert"]

APPROACH, DESCEND, CLOSE, LIFT, HOLD = "approach", "descend", "close", "lift", "hold"


class ScriptedExpert:
    """Callable policy ``expert(obs) -> action (4,)`` for the current episode of ``env``.

    Call :meth:`reset` after every ``env.reset`` (``demos.rollout`` does it). ``seed`` seeds the noise.
    """

    def __init__(
        self,
        env: PickEnv,
        noise: float = 0.0,
        seed: Optional[int] = None,
        max_step: float = 0.05,
        approach_height: float = 0.08,
        lift_height: float = 0.22,
        reach_tol: float = 0.012,
        close_steps: int = 1,
        press_depth: float = 0.02,
        suction_height: float = 0.03,
        belief_offset: Sequence[float] = (0.0, 0.0, 0.0),
    ) -> None:
        self.env = env
        self.noise = float(noise)
        self.max_step = float(max_step)
        self.approach_height = float(approach_height)
        self.lift_height = float(lift_height)
        self.reach_tol = float(reach_tol)
        self.close_steps = int(close_steps)
        self.press_depth = float(press_depth)
        self.suction_height = float(suction_height)
        self.belief_offset = np.asarray(belief_offset, dtype=np.float64).reshape(3)
        self._rng = np.random.default_rng(seed)
        self.phase = APPROACH
        self._phase_steps = 0
        self._rest_top = 0.0
        self.clean_action: Optional[np.ndarray] = None

    def reset(self, seed: Optional[int] = None) -> None:
        """Start a new episode (optionally reseeding the action noise)."""
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        self.phase = APPROACH
        self._phase_steps = 0
        self._rest_top = float(self.env.target_position()[2] + self.env.target_half_height())

    def _goto(self, phase: str) -> None:
        self.phase, self._phase_steps = phase, 0

    def __call__(self, obs: Dict[str, Any]) -> np.ndarray:
        """Action ``(4,)`` float32 for observation ``obs`` (uses ``obs["state"]`` and privileged poses)."""
        ee = np.asarray(obs["state"][STATE_SLICES["ee_pos"]], dtype=np.float64)
        obj = self.env.target_position() + self.belief_offset
        top = obj[2] + self.env.target_half_height()
        above = np.array([obj[0], obj[1], top + self.approach_height])
        grasp = np.array([obj[0], obj[1], top - self.press_depth])
        holding = self.env.holding_target

        # state transitions (evaluated before choosing the waypoint)
        if self.phase == APPROACH and np.linalg.norm(ee - above) < self.reach_tol:
            self._goto(DESCEND)
        elif self.phase == DESCEND and holding:
            self._goto(LIFT)
        elif self.phase == DESCEND and np.linalg.norm(ee - grasp) < self.reach_tol:
            self._goto(CLOSE)
        elif self.phase == DESCEND and self._phase_steps > 6:  # blocked: try again from above
            self._goto(APPROACH)
        elif self.phase == CLOSE and self._phase_steps >= self.close_steps:
            self._goto(LIFT if holding else APPROACH)
        elif self.phase in (LIFT, HOLD) and not holding:
            self._goto(APPROACH)  # dropped or never attached
        elif self.phase == LIFT and ee[2] > self._rest_top + self.lift_height - self.reach_tol:
            self._goto(HOLD)

        if self.phase == APPROACH:
            # first rise above the approach height if below it, then move over the object
            if ee[2] < above[2] - self.reach_tol and np.linalg.norm(ee[:2] - above[:2]) > self.reach_tol:
                way, grip = np.array([ee[0], ee[1], above[2]]), 0.0
            else:
                way, grip = above, 0.0
        elif self.phase == DESCEND:
            way, grip = grasp, float(ee[2] < top + self.suction_height)
        elif self.phase == CLOSE:
            way, grip = grasp, 1.0
        else:  # LIFT / HOLD
            way, grip = np.array([ee[0], ee[1], self._rest_top + self.lift_height]), 1.0
        self._phase_steps += 1

        delta = way - ee
        dist = np.linalg.norm(delta)
        if dist > self.max_step:
            delta *= self.max_step / dist
        target = ee + delta
        self.clean_action = np.concatenate([target, [grip]]).astype(np.float32)
        if self.noise > 0 and self.phase != CLOSE:
            target = target + self._rng.normal(0.0, self.noise, size=3)
        return np.concatenate([target, [grip]]).astype(np.float32)
