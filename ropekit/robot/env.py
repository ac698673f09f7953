"""A headless pybullet pick task seen by a fixed RGB-D camera.

A KUKA iiwa (``kuka_iiwa/model.urdf`` from ``pybullet_data``, fixed base at the world origin) stands in
front of a table whose height is drawn per episode. One *target* object (cube, cylinder or sphere, in a
saturated colour) lies at a random position on the table, optionally with *distractors* (neutral
colours: grey, white, brown, black; optionally large). The task is to lift the target.

Gripper
-------
The gripper is a **suction cup**: a fixed constraint between the last arm link (``lbr_iiwa_link_7``) and
the nearest movable object, created while the gripper is commanded closed and the link is within
``PickConfig.suction_range`` of an object, released as soon as the command opens. This was preferred to
the two-finger ``kuka_with_gripper2.sdf``: finger contacts on small primitives are fragile in pybullet
(slip, tunnelling, sensitivity to the substep count), whereas the suction constraint makes the scripted
expert succeed on nearly every in-distribution seed, which is what imitation learning needs. The tool
point ("tip") is ``PickConfig.tip_offset`` below the link-7 frame along its z axis, i.e. the flange face.
The orientation of the end effector is fixed, pointing straight down.

Action space
------------
``action``: float array, shape ``(4,)`` = ``[x, y, z, g]``

* ``x, y, z`` — **absolute** target position of the tip in the **world frame**, metres. It is clipped to
  the workspace box ``PickConfig.workspace_low/high`` and to a safety floor ``PickConfig.floor_clearance``
  above the table top. The env solves inverse kinematics (orientation: pointing down) and drives the
  joints there with position control over ``PickConfig.substeps`` simulation substeps (1/240 s each); a
  far target is therefore approached only partially within one step (joint speed is limited).
* ``g`` — gripper command, *closed* (suction on) if ``g > 0.5``, open otherwise.

Observation
-----------
``obs`` is a dict (``H = W = PickConfig.image_size``):

* ``rgb``: uint8 ``(H, W, 3)`` from the front camera.
* ``depth``: float32 ``(H, W)``, metric depth along the camera's optical axis (z in the camera frame),
  metres, from the OpenGL depth buffer ``d`` as ``near * far / (far - (far - near) * d)``; always in
  ``[near, far]`` (the floor fills the background, so there are no invalid pixels).
* ``state``: float32 ``(STATE_DIM,) = (11,)``: tip position (3, world frame), gripper command state
  (1, 1.0 = closed), arm joint positions (7, rad). See ``STATE_SLICES``.
* ``intrinsics``: float32 ``(3, 3)`` pinhole matrix K (OpenCV convention, pixels; pixel (u, v) has its
  centre at ``u + 0.5, v + 0.5``).
* ``extrinsics``: float32 ``(4, 4)`` camera-from-world transform, OpenCV camera axes (x right, y down,
  z forward): ``p_cam = extrinsics @ [p_world, 1]``.
* with ``PickConfig.second_view``: also ``rgb_side``, ``depth_side``, ``intrinsics_side``,
  ``extrinsics_side`` from a camera on the side of the table.

Episodes have a fixed length ``PickConfig.max_steps`` (``done`` is ``True`` at the last step, or at the
first success if ``PickConfig.terminate_on_success``). ``reward`` is 1.0 while the target is lifted by more
than ``PickConfig.success_height`` above its resting height, else 0.0; ``info["success"]`` is the same as a
bool. Everything is deterministic given the seed passed to :meth:`PickEnv.reset`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from .._optional import require

def _import_quietly(name: str) -> Any:
    """Import ``name`` with the process's standard error sent to ``/dev/null`` meanwhile: pybullet's C code writes a
    "pybullet build time: ..." banner there when it loads, which would open every ``ropekit robot`` output
    (``--help`` included). Python-level errors of the import still propagate as exceptions."""
    import importlib
    import os

    try:
        saved = os.dup(2)
    except OSError:  # (no file descriptor 2)
        return importlib.import_module(name)
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, 2)
        finally:
            os.close(null)
        return importlib.import_module(name)
    finally:
        os.dup2(saved, 2)
        os.close(saved)


try:  # pybullet is an optional dependency (extra "sim")
    p = _import_quietly("pybullet")
    import pybullet_data
except ImportError:  # pragma: no cover - exercised only without pybullet
    p = None
    pybullet_data = None


def require_pybullet() -> None:
    """Raise :class:`~ropekit._optional.MissingDependency` (one line naming the extra) if pybullet is absent."""
    if p is None:
        require("pybullet", "sim", "the robot pick task (PickEnv)")


__all__ = [
    "PickConfig",
    "PickEnv",
    "env_config",
    "CameraParams",
    "STATE_DIM",
    "ACTION_DIM",
    "STATE_SLICES",
    "SHAPES",
]

STATE_DIM = 11
ACTION_DIM = 4

#: Slices of ``obs["state"]``.
STATE_SLICES = {"ee_pos": slice(0, 3), "gripper": slice(3, 4), "joints": slice(4, 11)}
SHAPES = ("cube", "cylinder", "sphere")

#: Saturated colours for the target; distractors use the neutral ones, so the target is identifiable.
TARGET_COLORS: Dict[str, Tuple[float, float, float, float]] = {
    "red": (0.85, 0.1, 0.1, 1.0),
    "green": (0.1, 0.7, 0.15, 1.0),
    "blue": (0.1, 0.25, 0.9, 1.0),
    "yellow": (0.95, 0.8, 0.05, 1.0),
}
DISTRACTOR_COLORS: Dict[str, Tuple[float, float, float, float]] = {
    "grey": (0.5, 0.5, 0.5, 1.0),
    "white": (0.92, 0.92, 0.92, 1.0),
    "brown": (0.45, 0.3, 0.15, 1.0),
    "black": (0.08, 0.08, 0.08, 1.0),
}

_EE_LINK = 6  # lbr_iiwa_link_7
_NUM_ARM_JOINTS = 7
_DOWN = (0.0, 1.0, 0.0, 0.0)  # quaternion (x, y, z, w) of Euler (0, -pi, 0): tool z axis points down
_HOME_JOINTS = (0.0, 0.35, 0.0, -1.6, 0.0, 1.2, 0.0)  # elbow up, wrist down; IK rest pose

Range = Tuple[float, float]


@dataclass
class PickConfig:
    """Configuration of :class:`PickEnv`. Lengths in metres, angles in radians, world frame z up.

    ``table_height_range`` is either one ``(low, high)`` range or a sequence of ranges (one is picked
    uniformly per episode, then a height uniformly inside it), which lets an OOD preset cover heights
    both below and above the training range.
    """

    # scene
    table_height_range: Union[Range, Sequence[Range]] = (0.10, 0.20)
    table_center_xy: Tuple[float, float] = (0.62, 0.0)
    table_half_extents_xy: Tuple[float, float] = (0.25, 0.30)
    target_shapes: Tuple[str, ...] = SHAPES
    target_colors: Tuple[str, ...] = tuple(TARGET_COLORS)
    object_size_range: Range = (0.04, 0.06)  # edge / diameter of the target and small distractors
    target_region_x: Range = (0.48, 0.72)
    target_region_y: Range = (-0.16, 0.16)
    num_distractors: int = 1
    large_distractors: bool = False
    large_distractor_size_range: Range = (0.09, 0.13)
    distractor_region_x: Range = (0.42, 0.82)
    distractor_region_y: Range = (-0.24, 0.24)
    # camera and light
    image_size: int = 64
    second_view: bool = False
    camera_eye: Tuple[float, float, float] = (1.1, 0.0, 0.85)
    camera_target: Tuple[float, float, float] = (0.56, 0.0, 0.27)
    side_camera_eye: Tuple[float, float, float] = (0.62, 0.9, 0.72)
    side_camera_target: Tuple[float, float, float] = (0.6, 0.0, 0.12)
    fov_deg: float = 60.0
    near: float = 0.05
    far: float = 4.0
    light_direction: Tuple[float, float, float] = (0.4, -0.3, 1.0)
    light_color: Tuple[float, float, float] = (1.0, 1.0, 1.0)
    light_ambient: float = 0.6
    light_diffuse: float = 0.35
    shadows: bool = True
    # control
    max_steps: int = 40
    substeps: int = 20
    timestep: float = 1.0 / 240.0
    max_joint_velocity: float = 3.0
    joint_force: float = 300.0
    tip_offset: float = 0.045
    home_tip: Tuple[float, float, float] = (0.5, 0.0, 0.62)
    home_noise: float = 0.0  # std of a random offset of the start tip position
    workspace_low: Tuple[float, float, float] = (0.25, -0.45, 0.0)
    workspace_high: Tuple[float, float, float] = (0.95, 0.45, 0.95)
    floor_clearance: float = 0.005
    suction_range: float = 0.012
    suction_max_force: float = 100.0
    success_height: float = 0.08
    terminate_on_success: bool = False

    def __post_init__(self) -> None:
        if self.image_size < 8:
            raise ValueError(f"image_size must be >= 8, got {self.image_size}")
        if self.num_distractors < 0:
            raise ValueError(f"num_distractors must be >= 0, got {self.num_distractors}")
        for s in self.target_shapes:
            if s not in SHAPES:
                raise ValueError(f"unknown shape {s!r}; known: {SHAPES}")
        for c in self.target_colors:
            if c not in TARGET_COLORS:
                raise ValueError(f"unknown target colour {c!r}; known: {tuple(TARGET_COLORS)}")
        self.height_ranges()  # validates

    def height_ranges(self) -> List[Range]:
        """``table_height_range`` as a list of ``(low, high)`` ranges."""
        r = self.table_height_range
        if len(r) == 2 and all(isinstance(v, (int, float)) for v in r):
            ranges = [(float(r[0]), float(r[1]))]
        else:
            ranges = [(float(a), float(b)) for a, b in r]  # type: ignore[misc]
        for lo, hi in ranges:
            if not 0.0 < lo <= hi:
                raise ValueError(f"table height range must satisfy 0 < low <= high, got {(lo, hi)}")
        return ranges

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    # ---- named presets -------------------------------------------------------------------------------
    @classmethod
    def in_distribution(cls, **overrides: Any) -> "PickConfig":
        """Training distribution: table top in [0.10, 0.20] m, one small distractor, default light."""
        return cls(**overrides)

    @classmethod
    def ood_table_height(cls, side: str = "both", **overrides: Any) -> "PickConfig":
        """Table heights never seen in training: ``"low"`` [0.03, 0.06], ``"high"`` [0.25, 0.30],
        or ``"both"`` (either, with equal probability)."""
        ranges = {"low": [(0.03, 0.06)], "high": [(0.25, 0.30)], "both": [(0.03, 0.06), (0.25, 0.30)]}
        if side not in ranges:
            raise ValueError(f"side must be one of {tuple(ranges)}, got {side!r}")
        return cls(**{"table_height_range": tuple(ranges[side]), **overrides})

    @classmethod
    def ood_large_distractors(cls, **overrides: Any) -> "PickConfig":
        """Two large (9–13 cm) distractors instead of one small one."""
        return cls(**{"num_distractors": 2, "large_distractors": True, **overrides})

    @classmethod
    def ood_light(cls, **overrides: Any) -> "PickConfig":
        """Light from a low grazing angle on the other side, warm colour, weaker ambient term."""
        return cls(
            **{
                "light_direction": (-0.8, 0.9, 0.35),
                "light_color": (1.0, 0.75, 0.5),
                "light_ambient": 0.3,
                "light_diffuse": 0.7,
                **overrides,
            }
        )

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "PickConfig":
        """Preset by name: ``in_distribution``, ``ood_table_height``, ``ood_large_distractors``, ``ood_light``."""
        presets = {
            "in_distribution": cls.in_distribution,
            "ood_table_height": cls.ood_table_height,
            "ood_large_distractors": cls.ood_large_distractors,
            "ood_light": cls.ood_light,
        }
        if name not in presets:
            raise ValueError(f"unknown preset {name!r}; known: {tuple(presets)}")
        return presets[name](**overrides)


@dataclass
class CameraParams:
    """A fixed pinhole camera.

    ``intrinsics`` (3, 3) K in pixels; ``extrinsics`` (4, 4) camera-from-world (OpenCV axes: x right,
    y down, z forward); ``view_matrix``/``projection_matrix`` are pybullet's flat OpenGL matrices.
    """

    width: int
    height: int
    near: float
    far: float
    intrinsics: np.ndarray
    extrinsics: np.ndarray
    view_matrix: Tuple[float, ...] = field(repr=False)
    projection_matrix: Tuple[float, ...] = field(repr=False)

    @classmethod
    def look_at(
        cls,
        eye: Sequence[float],
        target: Sequence[float],
        size: int,
        fov_deg: float,
        near: float,
        far: float,
    ) -> "CameraParams":
        view = p.computeViewMatrix(cameraEyePosition=list(eye), cameraTargetPosition=list(target),
                                   cameraUpVector=[0, 0, 1])
        proj = p.computeProjectionMatrixFOV(fov=fov_deg, aspect=1.0, nearVal=near, farVal=far)
        # pybullet matrices are column-major; transpose to row-major: p_gl = V @ p_world
        gl_from_world = np.asarray(view, dtype=np.float64).reshape(4, 4).T
        cv_from_gl = np.diag([1.0, -1.0, -1.0, 1.0])  # OpenGL (y up, -z forward) -> OpenCV
        extr = cv_from_gl @ gl_from_world
        f = 0.5 * size / math.tan(math.radians(fov_deg) / 2.0)  # fov is vertical; aspect 1
        k = np.array([[f, 0.0, size / 2.0], [0.0, f, size / 2.0], [0.0, 0.0, 1.0]])
        return cls(size, size, near, far, k.astype(np.float32), extr.astype(np.float32),
                   tuple(view), tuple(proj))


def gl_depth_to_metric(buffer: np.ndarray, near: float, far: float) -> np.ndarray:
    """OpenGL depth buffer values in [0, 1] (any shape) -> metric z depth (same shape), float32."""
    d = np.asarray(buffer, dtype=np.float64)
    return (near * far / (far - (far - near) * d)).astype(np.float32)


class PickEnv:
    """The pick task; see the module docstring for the action and observation spaces.

    Example::

        env = PickEnv(PickConfig.in_distribution())
        obs = env.reset(seed=0)
        obs, reward, done, info = env.step(np.array([0.6, 0.0, 0.4, 0.0]))
        env.close()
    """

    def __init__(self, config: Optional[PickConfig] = None) -> None:
        require_pybullet()
        self.config = config if config is not None else PickConfig()
        self._client = p.connect(p.DIRECT)
        c = self.config
        self.cameras: Dict[str, CameraParams] = {
            "front": CameraParams.look_at(c.camera_eye, c.camera_target, c.image_size, c.fov_deg, c.near, c.far)
        }
        if c.second_view:
            self.cameras["side"] = CameraParams.look_at(
                c.side_camera_eye, c.side_camera_target, c.image_size, c.fov_deg, c.near, c.far
            )
        self._rng = np.random.default_rng()
        self._scene: Dict[str, Any] = {}
        self._robot = -1
        self._target = -1
        self._objects: List[int] = []
        self._grip_closed = False
        self._grasp_cid: Optional[int] = None
        self._held: Optional[int] = None
        self._t = 0
        self._target_rest_z = 0.0
        self._needs_reset = True

    # ---- public API --------------------------------------------------------------------------------
    def reset(self, seed: Optional[int] = None) -> Dict[str, np.ndarray]:
        """Build a new scene from ``seed`` (a fresh random one if ``None``) and return the first obs."""
        if seed is None:
            seed = int(self._rng.integers(0, 2**31 - 1))
        rng = np.random.default_rng(seed)
        self._rng = np.random.default_rng(rng.integers(0, 2**31 - 1))  # for later seed=None resets
        self._build_scene(rng)
        self._t = 0
        self._needs_reset = False
        return self._obs()

    def step(self, action: Sequence[float]) -> Tuple[Dict[str, np.ndarray], float, bool, Dict[str, Any]]:
        """Apply ``action`` (4,) = tip target xyz (world, m) + gripper (closed if > 0.5).

        Returns ``(obs, reward, done, info)``; ``info`` has ``success`` (bool), ``holding`` (bool, target
        attached), ``t`` (steps taken), ``target_pos`` (3,), ``table_height`` and ``clipped_target`` (3,).
        """
        if self._needs_reset:
            raise RuntimeError("call reset() before step() (and after an episode ends)")
        a = np.asarray(action, dtype=np.float64).reshape(-1)
        if a.shape != (ACTION_DIM,) or not np.all(np.isfinite(a)):
            raise ValueError(f"action must be a finite array of shape ({ACTION_DIM},), got {a}")
        c = self.config
        target = self._clip_target(a[:3])
        self._set_gripper(bool(a[3] > 0.5))
        q_goal = self._ik(target)
        cid = self._client
        joints = list(range(_NUM_ARM_JOINTS))
        q0 = np.array([s[0] for s in p.getJointStates(self._robot, joints, physicsClientId=cid)])
        # a joint-space ramp from the current to the IK solution, at most max_joint_velocity rad/s,
        # tracked by position control: smooth, and no overshoot into the table
        max_delta = c.max_joint_velocity * c.timestep
        for k in range(c.substeps):
            q_ref = q0 + np.clip(q_goal - q0, -max_delta * (k + 1), max_delta * (k + 1))
            p.setJointMotorControlArray(
                self._robot, joints, p.POSITION_CONTROL,
                targetPositions=q_ref.tolist(), targetVelocities=[0.0] * _NUM_ARM_JOINTS,
                forces=[c.joint_force] * _NUM_ARM_JOINTS, positionGains=[0.3] * _NUM_ARM_JOINTS,
                velocityGains=[1.0] * _NUM_ARM_JOINTS, physicsClientId=cid,
            )
            p.stepSimulation(physicsClientId=cid)
            if self._grip_closed and self._held is None:
                self._try_attach()
        self._t += 1
        success = self._is_success()
        done = self._t >= c.max_steps or (c.terminate_on_success and success)
        if done:
            self._needs_reset = True
        info = {
            "success": success,
            "holding": self.holding_target,
            "t": self._t,
            "target_pos": self.target_position(),
            "table_height": self._scene["table_height"],
            "clipped_target": target,
        }
        return self._obs(), float(success), done, info

    def close(self) -> None:
        """Disconnect the pybullet client (idempotent)."""
        if self._client is not None and self._client >= 0:
            try:
                p.disconnect(physicsClientId=self._client)
            except Exception:  # already disconnected
                pass
            self._client = -1

    def __enter__(self) -> "PickEnv":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass

    # ---- privileged information (for the scripted expert and for tests) ----------------------------
    @property
    def scene(self) -> Dict[str, Any]:
        """Privileged scene description of the current episode (table height, object specs)."""
        return self._scene

    @property
    def table_height(self) -> float:
        """Height of the table top above the floor, metres."""
        return float(self._scene["table_height"])

    @property
    def t(self) -> int:
        """Number of steps taken in the current episode."""
        return self._t

    @property
    def holding_target(self) -> bool:
        """Whether the suction gripper currently holds the target object."""
        return self._held is not None and self._held == self._target

    def target_position(self) -> np.ndarray:
        """Centre of the target object, world frame, (3,) float64."""
        pos, _ = p.getBasePositionAndOrientation(self._target, physicsClientId=self._client)
        return np.asarray(pos, dtype=np.float64)

    def target_half_height(self) -> float:
        """Half the vertical extent of the target at rest (its top is ``position z + this``)."""
        return float(self._scene["target"]["half_height"])

    def suction_gap(self, max_distance: float = 0.5) -> float:
        """Closest distance (m) between the suction link and the target (``max_distance`` if farther): the
        suction attaches when it is within ``PickConfig.suction_range`` while the command is closed."""
        pts = p.getClosestPoints(self._robot, self._target, max_distance, linkIndexA=_EE_LINK,
                                 physicsClientId=self._client)
        return float(min((pt[8] for pt in pts), default=max_distance))

    def ee_position(self) -> np.ndarray:
        """Tip position, world frame, (3,) float64."""
        st = p.getLinkState(self._robot, _EE_LINK, computeForwardKinematics=True, physicsClientId=self._client)
        pos = np.asarray(st[4], dtype=np.float64)
        rot = np.asarray(p.getMatrixFromQuaternion(st[5]), dtype=np.float64).reshape(3, 3)
        return pos + rot[:, 2] * self.config.tip_offset

    def render(self, view: str = "front", size: Optional[int] = None) -> np.ndarray:
        """RGB image (size, size, 3) uint8 of the current scene (e.g. larger frames for GIFs)."""
        cam = self.cameras[view]
        if size is not None and size != cam.width:
            c = self.config
            eye, tgt = (c.camera_eye, c.camera_target) if view == "front" else (c.side_camera_eye, c.side_camera_target)
            cam = CameraParams.look_at(eye, tgt, size, c.fov_deg, c.near, c.far)
        return self._render(cam)[0]

    # ---- internals ---------------------------------------------------------------------------------
    def _build_scene(self, rng: np.random.Generator) -> None:
        c, cid = self.config, self._client
        p.resetSimulation(physicsClientId=cid)
        p.setPhysicsEngineParameter(fixedTimeStep=c.timestep, numSolverIterations=50,
                                    deterministicOverlappingPairs=1, physicsClientId=cid)
        p.setGravity(0, 0, -9.81, physicsClientId=cid)
        data = pybullet_data.getDataPath()
        self._grasp_cid, self._held, self._grip_closed = None, None, False

        # floor and table (a solid block from the floor to the top, so its height is unambiguous)
        p.loadURDF(f"{data}/plane.urdf", [0, 0, 0], useFixedBase=True, physicsClientId=cid)
        ranges = c.height_ranges()
        lo, hi = ranges[int(rng.integers(len(ranges)))] if len(ranges) > 1 else ranges[0]
        h = float(rng.uniform(lo, hi))
        hx, hy = c.table_half_extents_xy
        tcol = p.createCollisionShape(p.GEOM_BOX, halfExtents=[hx, hy, h / 2], physicsClientId=cid)
        tvis = p.createVisualShape(p.GEOM_BOX, halfExtents=[hx, hy, h / 2], rgbaColor=[0.72, 0.58, 0.42, 1],
                                   physicsClientId=cid)
        table = p.createMultiBody(0, tcol, tvis, [c.table_center_xy[0], c.table_center_xy[1], h / 2],
                                  physicsClientId=cid)
        p.changeDynamics(table, -1, lateralFriction=0.8, physicsClientId=cid)

        # robot, placed at the (optionally perturbed) home pose
        self._robot = p.loadURDF(f"{data}/kuka_iiwa/model.urdf", [0, 0, 0], useFixedBase=True, physicsClientId=cid)
        for j in range(_NUM_ARM_JOINTS):
            p.resetJointState(self._robot, j, _HOME_JOINTS[j], physicsClientId=cid)
        home = np.asarray(c.home_tip, dtype=np.float64)
        if c.home_noise > 0:
            home = home + rng.normal(0.0, c.home_noise, size=3)
        q = self._ik(home, iterations=3)
        for j in range(_NUM_ARM_JOINTS):
            p.resetJointState(self._robot, j, q[j], physicsClientId=cid)
        p.setJointMotorControlArray(self._robot, list(range(_NUM_ARM_JOINTS)), p.POSITION_CONTROL,
                                    targetPositions=list(q), forces=[c.joint_force] * _NUM_ARM_JOINTS,
                                    physicsClientId=cid)

        # objects: target first, then distractors at non-overlapping positions
        placed: List[Tuple[float, float, float]] = []  # (x, y, footprint radius)
        tshape = str(rng.choice(list(c.target_shapes)))
        tcolor = str(rng.choice(list(c.target_colors)))
        tsize = float(rng.uniform(*c.object_size_range))
        tx, ty = float(rng.uniform(*c.target_region_x)), float(rng.uniform(*c.target_region_y))
        target_spec = self._spawn(tshape, TARGET_COLORS[tcolor], tsize, tx, ty, h, float(rng.uniform(0, np.pi)))
        target_spec.update(color=tcolor)
        self._target = target_spec["body"]
        placed.append((tx, ty, tsize / 2 * math.sqrt(2)))
        distractors = []
        dsizes = c.large_distractor_size_range if c.large_distractors else c.object_size_range
        for _ in range(c.num_distractors):
            shape = str(rng.choice(list(SHAPES)))
            color = str(rng.choice(list(DISTRACTOR_COLORS)))
            size = float(rng.uniform(*dsizes))
            radius = size / 2 * math.sqrt(2)
            yaw = float(rng.uniform(0, np.pi))
            for _try in range(200):
                x = float(rng.uniform(*c.distractor_region_x))
                y = float(rng.uniform(*c.distractor_region_y))
                # keep the wrist (radius ~7 cm) clear of a tall distractor while it descends on the target
                ok = all(
                    math.hypot(x - px, y - py) > radius + pr + (0.09 if i == 0 else 0.02)
                    for i, (px, py, pr) in enumerate(placed)
                )
                if ok:
                    break
            else:
                continue  # no room: skip this distractor (recorded via the distractor count)
            spec = self._spawn(shape, DISTRACTOR_COLORS[color], size, x, y, h, yaw)
            spec.update(color=color)
            distractors.append(spec)
            placed.append((x, y, radius))
        self._objects = [target_spec["body"]] + [d["body"] for d in distractors]

        for _ in range(10):  # let contacts settle
            p.stepSimulation(physicsClientId=cid)
        self._target_rest_z = float(self.target_position()[2])
        self._scene = {
            "table_height": h,
            "target": target_spec,
            "distractors": distractors,
            "target_rest_z": self._target_rest_z,
        }

    def _spawn(self, shape: str, rgba: Sequence[float], size: float, x: float, y: float, table_h: float,
               yaw: float) -> Dict[str, Any]:
        cid = self._client
        if shape == "cube":
            he = [size / 2] * 3
            col = p.createCollisionShape(p.GEOM_BOX, halfExtents=he, physicsClientId=cid)
            vis = p.createVisualShape(p.GEOM_BOX, halfExtents=he, rgbaColor=list(rgba), physicsClientId=cid)
        elif shape == "cylinder":
            col = p.createCollisionShape(p.GEOM_CYLINDER, radius=size / 2, height=size, physicsClientId=cid)
            vis = p.createVisualShape(p.GEOM_CYLINDER, radius=size / 2, length=size, rgbaColor=list(rgba),
                                      physicsClientId=cid)
        elif shape == "sphere":
            col = p.createCollisionShape(p.GEOM_SPHERE, radius=size / 2, physicsClientId=cid)
            vis = p.createVisualShape(p.GEOM_SPHERE, radius=size / 2, rgbaColor=list(rgba), physicsClientId=cid)
        else:  # pragma: no cover - validated in PickConfig
            raise ValueError(shape)
        mass = 0.08 * (size / 0.045) ** 3
        orn = p.getQuaternionFromEuler([0, 0, yaw])
        body = p.createMultiBody(mass, col, vis, [x, y, table_h + size / 2], orn, physicsClientId=cid)
        # high rolling/spinning friction keeps the sphere from rolling away ("sphere-ish")
        p.changeDynamics(body, -1, lateralFriction=0.9, rollingFriction=0.01, spinningFriction=0.01,
                         physicsClientId=cid)
        return {"body": body, "shape": shape, "size": size, "half_height": size / 2, "xy": (x, y), "yaw": yaw}

    def _clip_target(self, xyz: np.ndarray) -> np.ndarray:
        c = self.config
        lo = np.asarray(c.workspace_low, dtype=np.float64).copy()
        lo[2] = max(lo[2], self._scene["table_height"] + c.floor_clearance)
        return np.clip(xyz, lo, np.asarray(c.workspace_high, dtype=np.float64))

    def _ik(self, tip: np.ndarray, iterations: int = 2) -> np.ndarray:
        """Joint angles (7,) putting the tip at ``tip`` (world) with the tool pointing down."""
        c, cid = self.config, self._client
        link_target = np.asarray(tip, dtype=np.float64) + np.array([0.0, 0.0, c.tip_offset])
        lower = [-2.96, -2.09, -2.96, -2.09, -2.96, -2.09, -3.05]
        upper = [2.96, 2.09, 2.96, 2.09, 2.96, 2.09, 3.05]
        ranges = [u - l for l, u in zip(lower, upper)]
        q = p.calculateInverseKinematics(
            self._robot, _EE_LINK, link_target.tolist(), _DOWN,
            lowerLimits=lower, upperLimits=upper, jointRanges=ranges, restPoses=list(_HOME_JOINTS),
            maxNumIterations=100 * iterations, residualThreshold=1e-5, physicsClientId=cid,
        )
        return np.asarray(q[:_NUM_ARM_JOINTS], dtype=np.float64)

    def _set_gripper(self, closed: bool) -> None:
        self._grip_closed = closed
        if not closed and self._grasp_cid is not None:
            p.removeConstraint(self._grasp_cid, physicsClientId=self._client)
            self._grasp_cid, self._held = None, None

    def _try_attach(self) -> None:
        cid = self._client
        best, best_d = None, self.config.suction_range
        for body in self._objects:
            pts = p.getClosestPoints(self._robot, body, self.config.suction_range, linkIndexA=_EE_LINK,
                                     physicsClientId=cid)
            for pt in pts:
                if pt[8] <= best_d:
                    best, best_d = body, pt[8]
        if best is None:
            return
        # createConstraint's parent frame is the link's centre-of-mass frame (getLinkState [0:2])
        ee = p.getLinkState(self._robot, _EE_LINK, computeForwardKinematics=True, physicsClientId=cid)
        opos, oorn = p.getBasePositionAndOrientation(best, physicsClientId=cid)
        inv_pos, inv_orn = p.invertTransform(ee[0], ee[1])
        rel_pos, rel_orn = p.multiplyTransforms(inv_pos, inv_orn, opos, oorn)
        self._grasp_cid = p.createConstraint(
            self._robot, _EE_LINK, best, -1, p.JOINT_FIXED, [0, 0, 0],
            parentFramePosition=list(rel_pos), childFramePosition=[0, 0, 0],
            parentFrameOrientation=rel_orn, childFrameOrientation=[0, 0, 0, 1], physicsClientId=cid,
        )
        p.changeConstraint(self._grasp_cid, maxForce=self.config.suction_max_force, physicsClientId=cid)
        self._held = best

    def _is_success(self) -> bool:
        return bool(self.target_position()[2] - self._target_rest_z > self.config.success_height)

    def _render(self, cam: CameraParams) -> Tuple[np.ndarray, np.ndarray]:
        c = self.config
        _, _, rgba, depth_buf, _ = p.getCameraImage(
            cam.width, cam.height, viewMatrix=list(cam.view_matrix), projectionMatrix=list(cam.projection_matrix),
            renderer=p.ER_TINY_RENDERER, lightDirection=list(c.light_direction), lightColor=list(c.light_color),
            lightAmbientCoeff=c.light_ambient, lightDiffuseCoeff=c.light_diffuse, lightSpecularCoeff=0.05,
            shadow=int(c.shadows), flags=p.ER_NO_SEGMENTATION_MASK, physicsClientId=self._client,
        )
        rgb = np.asarray(rgba, dtype=np.uint8).reshape(cam.height, cam.width, 4)[..., :3].copy()
        depth = gl_depth_to_metric(np.asarray(depth_buf, dtype=np.float32).reshape(cam.height, cam.width),
                                   cam.near, cam.far)
        return rgb, depth

    def _state(self) -> np.ndarray:
        joints = [s[0] for s in p.getJointStates(self._robot, list(range(_NUM_ARM_JOINTS)),
                                                 physicsClientId=self._client)]
        return np.concatenate([self.ee_position(), [1.0 if self._grip_closed else 0.0], joints]).astype(np.float32)

    def _obs(self) -> Dict[str, np.ndarray]:
        obs: Dict[str, np.ndarray] = {}
        for name, cam in self.cameras.items():
            sfx = "" if name == "front" else f"_{name}"
            rgb, depth = self._render(cam)
            obs["rgb" + sfx], obs["depth" + sfx] = rgb, depth
            obs["intrinsics" + sfx], obs["extrinsics" + sfx] = cam.intrinsics.copy(), cam.extrinsics.copy()
        obs["state"] = self._state()
        return obs


def env_config(condition: str, image_size: int, overrides: Optional[Mapping[str, Any]] = None) -> PickConfig:
    """The :class:`PickConfig` of a condition as evaluated: stop at the first success, the policy's image size."""
    return PickConfig.preset(condition, **{"terminate_on_success": True, **(overrides or {}),
                                           "image_size": image_size})
