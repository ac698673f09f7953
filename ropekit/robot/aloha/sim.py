"""A lean ALOHA bimanual simulation on top of gym-aloha's MuJoCo scenes.

gym-aloha ships the two standard tasks of the ALOHA / ACT papers (a pair of 6-DoF ViperX arms with parallel
grippers at 50 Hz) but its gym wrapper renders three cameras at 480x640 with shadows on every step (about
8 steps/s on a CPU). :class:`AlohaSim` drives the same scenes directly: it steps the physics, renders only
the cameras asked for, at the size asked for, without shadows (about 100 steps/s on one CPU core), and
gives depth in metres when asked.

Shape legend: ``A = 14`` joint action / proprioception dimension, ``Hi, Wi`` image pixels.

Action (joint mode, what the policies output): ``[left arm joints (6, rad), left gripper (1, 0 closed .. 1
open), right arm joints (6), right gripper (1)]`` -- absolute joint position targets. Proprioception
``qpos (A,)`` uses the same layout (the gripper's normalised finger position).

End-effector mode (used only by the scripted expert): the gripper links are welded to two mocap bodies; an
action is ``[left xyz (3), left quat wxyz (4), left gripper (1), right xyz, right quat, right gripper]``.

Success: the task's reward reaches 4 (transfer: the left gripper holds the cube off the table; insertion: the
peg touches the pin inside the socket), as in gym-aloha.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

__all__ = ["TASKS", "TaskSpec", "AlohaSim", "require_sim", "sample_object_pose", "object_targets", "ACTION_DIM",
           "INSTALL_HINT", "axis_angle_quat", "quat_mul"]

ACTION_DIM = 14
INSTALL_HINT = 'pip install "ropekit[aloha]"'
_DT = 0.02  # control period, seconds (50 Hz)


@dataclass(frozen=True)
class TaskSpec:
    """One ALOHA task: its gym id, the scene files (joint- and end-effector-controlled) and its episode length."""

    name: str
    gym_id: str
    joint_xml: str
    ee_xml: str
    episode_steps: int = 400


TASKS: Dict[str, TaskSpec] = {
    "transfer_cube": TaskSpec("transfer_cube", "AlohaTransferCube-v0", "bimanual_viperx_transfer_cube.xml",
                              "bimanual_viperx_end_effector_transfer_cube.xml"),
    "insertion": TaskSpec("insertion", "AlohaInsertion-v0", "bimanual_viperx_insertion.xml",
                          "bimanual_viperx_end_effector_insertion.xml"),
}
_ALIASES = {"transfer-cube": "transfer_cube", "transfercube": "transfer_cube", "alohatransfercube-v0": "transfer_cube",
            "alohainsertion-v0": "insertion"}


def task_spec(name: str) -> TaskSpec:
    """The :class:`TaskSpec` for ``name`` (``transfer_cube``/``transfer-cube``/``AlohaTransferCube-v0``, ...)."""
    key = name.lower()
    key = _ALIASES.get(key, key)
    if key not in TASKS:
        raise ValueError(f"unknown ALOHA task {name!r}; known: {', '.join(TASKS)}")
    return TASKS[key]


def sample_object_pose(task: str, seed: int) -> np.ndarray:
    """gym-aloha's seeded object pose of ``task``: ``(7,)`` cube or ``(14,)`` peg then socket (xyz, quat wxyz)."""
    from gym_aloha.utils import sample_box_pose, sample_insertion_pose

    if task_spec(task).name == "transfer_cube":
        return sample_box_pose(int(seed))
    return np.concatenate(sample_insertion_pose(int(seed)))


def object_targets(task: str, seed: int) -> np.ndarray:
    """Where each arm's object starts in ``task``'s episode of object-pose ``seed``: ``(6,)`` world positions
    (metres) of the right arm's object, then the left arm's -- the cube twice (the right arm lifts it, the left
    takes it over) or the peg (right) and the socket (left). What an ALOHA policy's auxiliary loss predicts."""
    return _arm_objects(task, sample_object_pose(task, seed))


def _arm_objects(task: str, poses: np.ndarray) -> np.ndarray:
    """The object poses ``(7,)`` or ``(14,)`` (free joints: xyz, quat) -> ``(6,)`` the right arm's object's
    position, then the left arm's (the cube twice; the peg, then the socket)."""
    if task_spec(task).name == "transfer_cube":
        return np.concatenate([poses[:3], poses[:3]])
    return np.concatenate([poses[:3], poses[7:10]])


def require_sim() -> Tuple[Any, Any]:
    """Import MuJoCo's dm_control bindings and gym-aloha, with ``MUJOCO_GL=egl`` when unset (headless).

    Returns:
        ``(dm_control.mujoco, gym_aloha module)``.

    Raises:
        ImportError: one line naming the fix when MuJoCo, dm_control or gym-aloha is missing.
    """
    os.environ.setdefault("MUJOCO_GL", "egl")
    try:  # Triton bundles its own LLVM; loaded after Mesa's software renderer (also LLVM) it segfaults, so
        import triton  # noqa: F401  load it first (torch imports it lazily, e.g. when building an optimiser)
    except Exception:  # absent or broken: nothing to order
        pass
    try:
        from dm_control import mujoco as dm_mujoco
        import gym_aloha  # noqa: F401  (the scenes and constants)
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError(f"the ALOHA simulation needs MuJoCo, dm_control and gym-aloha ({exc}); "
                          f"install them with `{INSTALL_HINT}`") from None
    return dm_mujoco, gym_aloha


def _render_error(exc: Exception) -> RuntimeError:
    backend = os.environ.get("MUJOCO_GL", "")
    fix = ("apt-get install libosmesa6 (or set MUJOCO_GL=egl)" if backend == "osmesa" else
           "set MUJOCO_GL=egl (Mesa's EGL renders headless on the CPU), or MUJOCO_GL=osmesa after "
           "apt-get install libosmesa6")
    return RuntimeError(f"MuJoCo could not render with MUJOCO_GL={backend or '(unset)'} ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''}); {fix}")


#: The object's centre relative to the midpoint of the right gripper's finger links, in the gripper link's
#: frame, when the scripted expert holds the cube (mean over object poses; see ``AlohaSim.reach_gap``).
_GRASP_POINT = np.array([0.0795, 0.0, -0.0068])


def quat_mul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Hamilton product of quaternions ``(4,)`` in ``(w, x, y, z)`` order."""
    aw, ax, ay, az = a
    bw, bx, by, bz = b
    return np.array([aw * bw - ax * bx - ay * by - az * bz, aw * bx + ax * bw + ay * bz - az * by,
                     aw * by - ax * bz + ay * bw + az * bx, aw * bz + ax * by - ay * bx + az * bw])


def axis_angle_quat(axis: Sequence[float], degrees: float) -> np.ndarray:
    """Unit quaternion ``(4,)`` (w, x, y, z) of a rotation by ``degrees`` about ``axis``."""
    axis = np.asarray(axis, dtype=np.float64)
    half = np.deg2rad(degrees) / 2
    return np.concatenate([[np.cos(half)], np.sin(half) * axis / np.linalg.norm(axis)])


class AlohaSim:
    """One ALOHA scene: reset to a seeded object pose, step 50 Hz actions, render chosen cameras.

    Args:
        task: ``"transfer_cube"`` or ``"insertion"`` (see :func:`task_spec` for the aliases).
        mode: ``"joint"`` (14-D joint targets, what policies and demos use) or ``"ee"`` (mocap end-effector
            targets, for the scripted expert; no rendering needed there).
        cameras: camera names to render (``top``, ``angle``, ``front_close``, ``left_pillar``, ``right_pillar``,
            ``left_wrist``, ``right_wrist``).
        image_hw: ``(Hi, Wi)`` of every rendered image.
        depth: also render depth (float32 metres) for each camera.
        fovy: vertical field of view (degrees) of the rendered cameras; ``None`` keeps the scene's (the top
            camera's is 78 degrees, most of the image then being floor; 50 still shows both grippers at their
            start and makes the cube about 1.7 times larger in pixels).

    Raises:
        ImportError: MuJoCo / gym-aloha missing (one line naming ``pip install "ropekit[aloha]"``).
        ValueError: unknown task, mode or camera.
    """

    def __init__(self, task: str = "transfer_cube", mode: str = "joint", cameras: Sequence[str] = ("top",),
                 image_hw: Tuple[int, int] = (48, 64), depth: bool = False,
                 fovy: Optional[float] = None) -> None:
        dm_mujoco, gym_aloha = require_sim()
        from gym_aloha import constants
        from gym_aloha.tasks.sim import InsertionTask, TransferCubeTask

        if mode not in ("joint", "ee"):
            raise ValueError(f"mode must be 'joint' or 'ee', got {mode!r}")
        self.spec = task_spec(task)
        self.mode = mode
        self.cameras = tuple(cameras)
        self.image_hw = (int(image_hw[0]), int(image_hw[1]))
        self.depth = bool(depth)
        self._c = constants
        xml = self.spec.ee_xml if mode == "ee" else self.spec.joint_xml
        self.physics = dm_mujoco.Physics.from_xml_path(str(constants.ASSETS_DIR / xml))
        model = self.physics.model
        known = {model.id2name(i, "camera") for i in range(model.ncam)}
        bad = [c for c in self.cameras if c not in known]
        if bad:
            raise ValueError(f"unknown camera(s) {bad}; known: {', '.join(sorted(known))}")
        self.fovy = None if fovy is None else float(fovy)
        if self.fovy is not None:
            if not 0 < self.fovy < 180:
                raise ValueError(f"fovy must be in (0, 180) degrees, got {fovy}")
            for cam in self.cameras:
                model.cam_fovy[model.name2id(cam, "camera")] = self.fovy
        model.light_castshadow[:] = 0  # shadows cost ~10x in software rendering and carry no task information
        if mode == "ee":
            # the mocap weld's torque scale (its 11th parameter): without it the weld does not hold the
            # gripper's orientation on MuJoCo 3.x and the scripted grasps miss
            model.eq_data[:, 10] = 10
        self._reward_task = TransferCubeTask() if self.spec.name == "transfer_cube" else InsertionTask()
        self._n_sub = max(1, int(round(_DT / model.opt.timestep)))
        self.object_pose: Optional[np.ndarray] = None
        self._cams: Dict[str, Any] = {}

    # ------------------------------------------------------------------ episode
    def sample_object_pose(self, seed: int) -> np.ndarray:
        """gym-aloha's seeded object pose: ``(7,)`` cube or ``(14,)`` peg then socket (xyz, quat wxyz)."""
        return sample_object_pose(self.spec.name, seed)

    def reset(self, seed: Optional[int] = None, object_pose: Optional[np.ndarray] = None,
              render: bool = True) -> Dict[str, Any]:
        """Start an episode with the object pose of ``seed`` (or ``object_pose``); return the observation."""
        if object_pose is None:
            if seed is None:
                raise ValueError("reset needs a seed or an object_pose")
            object_pose = self.sample_object_pose(seed)
        pose = np.asarray(object_pose, dtype=np.float64)
        c, p = self._c, self.physics
        with p.reset_context():
            p.named.data.qpos[:16] = c.START_ARM_POSE
            if self.mode == "joint":
                np.copyto(p.data.ctrl, c.START_ARM_POSE)
            else:
                np.copyto(p.data.mocap_pos[0], [-0.31718881, 0.5, 0.29525084])  # the gripper links' start poses
                np.copyto(p.data.mocap_quat[0], [1, 0, 0, 0])
                np.copyto(p.data.mocap_pos[1], [0.31718881, 0.49999888, 0.29525084])
                np.copyto(p.data.mocap_quat[1], [1, 0, 0, 0])
                g = c.PUPPET_GRIPPER_POSITION_CLOSE
                np.copyto(p.data.ctrl, [g, -g, g, -g])
            p.data.qpos[16:16 + len(pose)] = pose
        self.object_pose = pose.copy()
        return self.observe(render)

    def step(self, action: np.ndarray, render: bool = True) -> Tuple[Dict[str, Any], int]:
        """Apply one 50 Hz action (joint ``(14,)`` or end-effector ``(16,)``); return ``(obs, reward)``
        (``render=False``: the observation holds ``qpos`` only -- rendering is the expensive part)."""
        a = np.asarray(action, dtype=np.float64)
        c, p = self._c, self.physics
        if self.mode == "joint":
            if a.shape != (ACTION_DIM,):
                raise ValueError(f"joint action must have shape (14,), got {a.shape}")
            gl = c.unnormalize_puppet_gripper_position(a[6])
            gr = c.unnormalize_puppet_gripper_position(a[13])
            p.set_control(np.concatenate([a[:6], [gl, -gl], a[7:13], [gr, -gr]]))
        else:
            if a.shape != (16,):
                raise ValueError(f"end-effector action must have shape (16,), got {a.shape}")
            np.copyto(p.data.mocap_pos[0], a[:3])
            np.copyto(p.data.mocap_quat[0], a[3:7])
            np.copyto(p.data.mocap_pos[1], a[8:11])
            np.copyto(p.data.mocap_quat[1], a[11:15])
            gl = c.unnormalize_puppet_gripper_position(a[7])
            gr = c.unnormalize_puppet_gripper_position(a[15])
            np.copyto(p.data.ctrl, [gl, -gl, gr, -gr])
        p.step(self._n_sub)
        return self.observe(render), self.reward()

    def reward(self) -> int:
        """The task's staged reward (0..4; 4 is success)."""
        return int(self._reward_task.get_reward(self.physics))

    # ------------------------------------------------------------------ observation
    def qpos(self) -> np.ndarray:
        """Proprioception ``(14,)`` float32: arm joints (rad) and normalised gripper positions."""
        return self._reward_task.get_qpos(self.physics).astype(np.float32)

    def gripper_ctrl(self) -> np.ndarray:
        """Normalised gripper commands ``(2,)`` (left, right) currently applied (end-effector mode)."""
        ctrl = self.physics.data.ctrl
        f = self._c.normalize_puppet_gripper_position
        return np.array([f(ctrl[0]), f(ctrl[2])])

    def render(self, camera: str) -> Tuple[np.ndarray, Optional[np.ndarray]]:
        """``(rgb (Hi, Wi, 3) uint8, depth (Hi, Wi) float32 metres or None)`` from ``camera``.

        Raises:
            RuntimeError: no working OpenGL backend (one line naming ``MUJOCO_GL=egl`` / libosmesa6).
        """
        h, w = self.image_hw
        try:
            cam = self._cams.get(camera)
            if cam is None:  # building a camera costs about as much as a small render: keep one per name
                from dm_control.mujoco import Camera

                cam = self._cams[camera] = Camera(self.physics, height=h, width=w, camera_id=camera)
            rgb = cam.render()
            depth = cam.render(depth=True) if self.depth else None
        except Exception as exc:  # the GL backends raise many types (mujoco.FatalError, GLFW errors, ...)
            raise _render_error(exc) from None
        return np.ascontiguousarray(rgb), (None if depth is None else depth.astype(np.float32))

    def observe(self, render: bool = True) -> Dict[str, Any]:
        """``{"qpos": (14,), "images": {cam: (Hi, Wi, 3) uint8}, "depths": {cam: (Hi, Wi) float32}}``
        (no images in end-effector mode or with ``render=False``)."""
        obs: Dict[str, Any] = {"qpos": self.qpos(), "images": {}, "depths": {}}
        if self.mode == "joint" and render:
            for cam in self.cameras:
                rgb, depth = self.render(cam)
                obs["images"][cam] = rgb
                if depth is not None:
                    obs["depths"][cam] = depth
        return obs

    def reach_gap(self) -> float:
        """Distance (metres) from the right gripper's grasp point to the centre of the object the right arm
        grasps (the cube; the peg in insertion): how close a policy brought the gripper to it.

        The grasp point is where the scripted expert holds the cube: ``_GRASP_POINT`` in the gripper's frame
        from the midpoint of its two finger links (measured on expert grasps, within 2 mm across poses), so an
        expert episode comes within a few millimetres and a policy that misjudges where the object is does not.
        """
        x = self.physics.named.data
        fingers = 0.5 * (x.xpos["vx300s_right/left_finger_link"] + x.xpos["vx300s_right/right_finger_link"])
        grasp = fingers + x.xmat["vx300s_right/gripper_link"].reshape(3, 3) @ _GRASP_POINT
        return float(np.linalg.norm(grasp - self.physics.data.qpos[16:19]))

    def object_positions(self) -> np.ndarray:
        """Where each arm's object is now: ``(6,)`` world positions (metres) of the right arm's object, then the
        left arm's -- the cube twice, or the peg and the socket (the layout of :func:`object_targets`)."""
        return _arm_objects(self.spec.name, self.physics.data.qpos[16:])

    @property
    def object_state(self) -> np.ndarray:
        """Current free-joint poses of the task's objects ``(7,)`` or ``(14,)``."""
        return self.physics.data.qpos[16:].copy()
