"""Tests of the simulated KUKA pick task, its scripted expert and demo collection."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

pytestmark = pytest.mark.sim
pytest.importorskip("pybullet")

from ropekit.robot import (  # noqa: E402
    ACTION_DIM,
    STATE_DIM,
    STATE_SLICES,
    PickConfig,
    PickEnv,
    ScriptedExpert,
    collect_demos,
    load_demos,
    rollout,
)
from ropekit.robot.env import gl_depth_to_metric  # noqa: E402


@pytest.fixture(scope="module")
def env():
    e = PickEnv(PickConfig.in_distribution())
    yield e
    e.close()


def _unproject(depth: np.ndarray, k: np.ndarray, cam_from_world: np.ndarray) -> np.ndarray:
    """Depth (H, W) -> world points (H, W, 3) with the pinhole model of the obs."""
    h, w = depth.shape
    v, u = np.meshgrid(np.arange(h) + 0.5, np.arange(w) + 0.5, indexing="ij")
    x = (u - k[0, 2]) / k[0, 0] * depth
    y = (v - k[1, 2]) / k[1, 1] * depth
    pts = np.stack([x, y, depth, np.ones_like(depth)], -1)  # (H, W, 4) camera frame
    world = pts @ np.linalg.inv(cam_from_world).T
    return world[..., :3]


def test_obs_shapes_dtypes(env):
    obs = env.reset(seed=0)
    s = env.config.image_size
    assert obs["rgb"].shape == (s, s, 3) and obs["rgb"].dtype == np.uint8
    assert obs["depth"].shape == (s, s) and obs["depth"].dtype == np.float32
    assert obs["state"].shape == (STATE_DIM,) and obs["state"].dtype == np.float32
    assert obs["intrinsics"].shape == (3, 3) and obs["extrinsics"].shape == (4, 4)
    assert obs["rgb"].std() > 10  # not a blank image
    np.testing.assert_allclose(obs["state"][STATE_SLICES["ee_pos"]], env.ee_position(), atol=1e-5)
    assert obs["state"][STATE_SLICES["gripper"]][0] == 0.0
    obs2, reward, done, info = env.step(np.array([0.6, 0.0, 0.5, 1.0]))
    assert set(obs2) == set(obs) and isinstance(reward, float) and not done
    assert obs2["state"][STATE_SLICES["gripper"]][0] == 1.0
    assert {"success", "holding", "t", "target_pos", "table_height"} <= set(info)


def test_second_view_and_sizes():
    with PickEnv(PickConfig(image_size=32, second_view=True)) as e:
        obs = e.reset(seed=1)
    assert obs["rgb"].shape == (32, 32, 3) and obs["rgb_side"].shape == (32, 32, 3)
    assert obs["depth_side"].shape == (32, 32) and obs["depth_side"].dtype == np.float32
    assert not np.array_equal(obs["rgb"], obs["rgb_side"])


def test_depth_positive_and_metric(env):
    obs = env.reset(seed=2)
    d, c = obs["depth"], env.config
    assert np.all(np.isfinite(d)) and np.all(d > 0)
    assert d.min() >= c.near - 1e-4 and d.max() <= c.far + 1e-3
    assert 0.3 < d.min() < 2.0  # the scene is roughly a metre from the camera
    # unprojected pixels land on real surfaces: a large part lies on the table top, and the floor is z=0
    pts = _unproject(d, obs["intrinsics"], obs["extrinsics"])
    on_table = np.abs(pts[..., 2] - env.table_height) < 0.01
    on_floor = np.abs(pts[..., 2]) < 0.01
    assert on_table.mean() > 0.15 and on_floor.mean() > 0.05
    # the target projects where the depth image sees its surface
    tgt = env.target_position()
    pc = obs["extrinsics"] @ np.r_[tgt, 1.0]
    u, v = (obs["intrinsics"] @ (pc[:3] / pc[2]))[:2]
    assert abs(d[int(v), int(u)] - pc[2]) < 0.05


def test_gl_depth_conversion():
    out = gl_depth_to_metric(np.array([0.0, 1.0]), near=0.1, far=3.0)
    np.testing.assert_allclose(out, [0.1, 3.0], rtol=1e-6)


def test_determinism_same_seed():
    def run(e: PickEnv, seed: int):
        expert = ScriptedExpert(e, noise=0.01, seed=3)
        obs = e.reset(seed)
        expert.reset()
        out = [obs]
        for _ in range(6):
            obs, *_ = e.step(expert(obs))
            out.append(obs)
        return out

    with PickEnv(PickConfig()) as e1, PickEnv(PickConfig()) as e2:
        a = run(e1, 11)
        run(e1, 12)  # a different episode in between must not leak state
        b = run(e1, 11)
        c = run(e2, 11)
        d = run(e2, 13)
    for other in (b, c):
        for o1, o2 in zip(a, other):
            for k in o1:
                np.testing.assert_array_equal(o1[k], o2[k], err_msg=k)
    assert not np.array_equal(a[0]["rgb"], d[0]["rgb"])


@pytest.mark.slow
def test_expert_succeeds_in_distribution():
    cfg = PickConfig.in_distribution(terminate_on_success=True)
    with PickEnv(cfg) as e:
        expert = ScriptedExpert(e, noise=0.003, seed=0)
        results = [rollout(e, expert, seed=s) for s in range(10)]
    n_ok = sum(r.success for r in results)
    assert n_ok >= 8, f"expert succeeded on {n_ok}/10"
    assert all(r.first_success_step is None or r.first_success_step <= cfg.max_steps for r in results)


def test_action_validation(env):
    env.reset(seed=0)
    with pytest.raises(ValueError):
        env.step(np.zeros(3))
    with pytest.raises(ValueError):
        env.step(np.array([0.5, 0.0, np.nan, 0.0]))
    with PickEnv(PickConfig()) as fresh, pytest.raises(RuntimeError):
        fresh.step(np.zeros(ACTION_DIM))


def test_episode_length_and_rollout_frames():
    with PickEnv(PickConfig(max_steps=5)) as e:
        res = rollout(e, lambda obs: np.r_[obs["state"][:3], 0.0], seed=0, record=True)
        assert res.num_steps == 5 and not res.success
        assert res.frames.shape == (6, 64, 64, 3) and res.frames.dtype == np.uint8
        assert res.depths.shape == (6, 64, 64)
        big = rollout(e, lambda obs: np.r_[obs["state"][:3], 0.0], seed=0, record=True, frame_size=96)
        assert big.frames.shape == (6, 96, 96, 3)


def test_presets():
    ind = PickConfig.in_distribution()
    (lo, hi), = ind.height_ranges()
    for side in ("low", "high", "both"):
        for a, b in PickConfig.ood_table_height(side).height_ranges():
            assert b < lo or a > hi  # disjoint from the training range
    assert PickConfig.ood_large_distractors().large_distractors
    assert PickConfig.ood_light().light_direction != ind.light_direction
    assert PickConfig.preset("ood_light") == PickConfig.ood_light()
    with pytest.raises(ValueError, match="in_distribution"):
        PickConfig.preset("nope")
    with pytest.raises(ValueError):
        PickConfig(target_shapes=("torus",))


def test_ood_table_height_changes_table():
    (lo, hi), = PickConfig.in_distribution().height_ranges()
    heights = {}
    for name, cfg in [("in", PickConfig.in_distribution()), ("ood", PickConfig.ood_table_height())]:
        with PickEnv(cfg) as e:
            hs = []
            for s in range(4):
                obs = e.reset(seed=s)
                hs.append(e.table_height)
                # the physical scene follows: the target rests on the table top
                assert abs(e.target_position()[2] - e.table_height - e.target_half_height()) < 0.01
                # and the camera sees it: the most common unprojected height (besides the floor) is the top
                pts = _unproject(obs["depth"], obs["intrinsics"], obs["extrinsics"])[..., 2].ravel()
                pts = pts[pts > 0.015]
                counts, edges = np.histogram(pts, bins=np.arange(0.0, 0.6, 0.01))
                assert abs(edges[counts.argmax()] + 0.005 - e.table_height) < 0.011
            heights[name] = np.array(hs)
    assert np.all((heights["in"] >= lo) & (heights["in"] <= hi))
    assert np.all((heights["ood"] < lo) | (heights["ood"] > hi))


def test_large_distractors_are_large():
    with PickEnv(PickConfig.ood_large_distractors()) as e:
        e.reset(seed=0)
        sizes = [d["size"] for d in e.scene["distractors"]]
    assert len(sizes) >= 1 and min(sizes) >= 0.09


@pytest.mark.slow
def test_collect_demos_file(tmp_path):
    cfg = PickConfig(max_steps=12)
    out = tmp_path / "sub" / "demos.npz"
    data = collect_demos(3, cfg, seed=5, workers=2, out=out, progress=False)
    assert out.exists() and os.listdir(out.parent) == ["demos.npz"]  # no temp file left behind
    d = load_demos(out)
    n = 3 * cfg.max_steps
    assert d["rgb"].shape == (n, 64, 64, 3) and d["rgb"].dtype == np.uint8
    assert d["depth"].shape == (n, 64, 64) and d["depth"].dtype == np.float32
    assert d["state"].shape == (n, STATE_DIM) and d["action"].shape == (n, ACTION_DIM)
    assert d["episode"].shape == (n,) and d["step"].shape == (n,) and d["step_success"].shape == (n,)
    np.testing.assert_array_equal(d["episode"], np.repeat(np.arange(3), cfg.max_steps))
    assert d["episode_success"].shape == (3,) and d["episode_success"].dtype == bool
    assert d["episode_length"].sum() == n
    assert d["config"] == cfg
    np.testing.assert_array_equal(d["rgb"], data["rgb"])
    # the recorded episode is reproducible from its seed
    with PickEnv(cfg) as e:
        obs0 = e.reset(int(d["episode_seed"][1]))
    np.testing.assert_array_equal(obs0["rgb"], d["rgb"][d["episode"] == 1][0])


def test_config_round_trip():
    cfg = PickConfig.ood_table_height("both", image_size=48)
    assert PickConfig(**dataclasses.asdict(cfg)).height_ranges() == cfg.height_ranges()


def test_clean_labels_record_the_noise_free_expert_action():
    # The expert moves at most max_step (5 cm) from the current tip; noise of 5 cm pushes executed actions past
    # that bound, while DART labels (the expert's own action before its noise) never leave it.
    cfg = PickConfig.in_distribution(terminate_on_success=True, max_steps=12)
    noisy = collect_demos(2, cfg, seed=1, workers=1, progress=False, noise=0.05)
    clean = collect_demos(2, cfg, seed=1, workers=1, progress=False, noise=0.05, clean_labels=True)
    step = {name: np.linalg.norm(d["action"][:, :3] - d["state"][:, :3], axis=1) for name, d in
            (("noisy", noisy), ("clean", clean))}
    assert step["noisy"].max() > 0.06
    assert step["clean"].max() <= 0.05 + 1e-5
    np.testing.assert_array_equal(noisy["rgb"], clean["rgb"])  # same episodes executed: only the labels differ
    assert json.loads(str(clean["expert_json"]))["clean_labels"] is True
