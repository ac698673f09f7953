"""Tests of the robot failure diagnostics (`ropekit robot diagnose`)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ropekit.robot.policy import DiffusionPolicy, PolicyConfig
from test_robot_policy import _seed_and_one_thread  # noqa: F401  (seed 0 and one torch thread here too)

pytestmark = pytest.mark.sim
pytest.importorskip("pybullet")

from ropekit.robot.diagnose import (  # noqa: E402  (after the pybullet check)
    chunk_tracking,
    depth_shuffle_effect,
    expert_tolerance,
    grasp_errors,
    summarize_grasp_errors,
)

SMALL = dict(vit_overrides={"depth": 1, "patch_size": 8, "embed_dim": 48, "num_heads": 1},
             pe_options={"block_size": 8}, image_size=32, hidden_dim=64, cond_dim=64, num_blocks=1,
             num_inference_steps=2, horizon=4, n_action_steps=2)


def test_expert_tolerance_fails_when_the_target_is_believed_too_high():
    # 4 cm of belief error upwards puts the pressing tip 2 cm above the top face, out of the 12 mm suction range
    rows = expert_tolerance([0.0, 0.06], axis="z", episodes=2)
    assert [r["offset_m"] for r in rows] == [0.0, 0.06]
    assert rows[0]["success_rate"] == 1.0
    assert rows[1]["success_rate"] == 0.0 and rows[1]["mean_steps"] == 40


@pytest.mark.slow
def test_pressing_with_suction_on_tolerates_what_closing_on_the_top_face_does_not():
    on_top = expert_tolerance([0.02], axis="z", episodes=3, expert_kwargs={"press_depth": 0.0, "suction_height": 0.0})
    pressing = expert_tolerance([0.02], axis="z", episodes=3)
    assert on_top[0]["success_rate"] == 0.0
    assert pressing[0]["success_rate"] == 1.0


def test_expert_tolerance_rejects_an_unknown_axis():
    with pytest.raises(ValueError, match="axis"):
        expert_tolerance([0.0], axis="w")


def test_summary_counts_each_failure_kind():
    def row(success, gap, dxy, in_range_on=False):
        return {"success": success, "gap_m": gap, "dxy_m": dxy, "dz_m": 0.0, "suction_on": in_range_on,
                "in_range_suction_on": in_range_on}

    rows = [
        row(True, 0.0, 0.02, True),
        row(False, 0.10, 0.09),  # never in range, 9 cm off horizontally
        row(False, 0.05, 0.02),  # never in range, horizontally fine: too high
        row(False, 0.008, 0.02),  # in range, suction off there
        row(False, 0.004, 0.01, True),  # in range with suction on, no lift
    ]
    s = summarize_grasp_errors(rows)
    assert (s["episodes"], s["successes"]) == (5, 1)
    assert (s["fail_off_target"], s["fail_too_high"], s["fail_suction_off"], s["fail_no_lift"]) == (1, 1, 1, 1)
    assert s["median_gap_mm_fail"] == pytest.approx(29.0)  # median of 100, 50, 8, 4 mm


def test_grasp_errors_rows_of_an_untrained_policy():
    policy = DiffusionPolicy(PolicyConfig(**SMALL))
    rows = grasp_errors(policy, episodes=2)
    assert len(rows) == 2
    for r in rows:
        assert set(r) == {"episode", "success", "steps", "table_height_m", "gap_m", "dxy_m", "dz_m", "suction_on",
                          "in_range_suction_on"}
        assert 0.1 <= r["table_height_m"] <= 0.2  # the in-distribution table
        assert r["gap_m"] is None or 0.0 <= r["gap_m"] <= 0.5
    json.dumps(rows)  # plain types only


def test_suction_gap_closes_as_the_expert_descends():
    from ropekit.robot.env import PickConfig, PickEnv
    from ropekit.robot.expert import ScriptedExpert

    with PickEnv(PickConfig(terminate_on_success=True)) as env:
        obs = env.reset(3)
        expert = ScriptedExpert(env)
        expert.reset()
        gaps, done = [env.suction_gap()], False
        while not done and not env.holding_target:
            obs, _, done, _ = env.step(expert(obs))
            gaps.append(env.suction_gap())
    assert gaps[0] > 0.1  # starts well above the target
    assert min(gaps) <= env.config.suction_range  # within the suction range when it attached


def _demos(n: int = 6, size: int = 32):
    rng = np.random.default_rng(0)
    state = rng.normal(size=(n, 11)).astype(np.float32)
    action = np.concatenate([state[:, :3] + 0.02, (rng.random((n, 1)) > 0.5)], axis=1).astype(np.float32)
    return {"rgb": rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8),
            "depth": (0.6 + 0.8 * rng.random((n, size, size))).astype(np.float32),
            "state": state, "action": action, "episode": np.zeros(n, int), "step": np.arange(n),
            "episode_length": np.array([n]), "episode_success": np.array([True])}


def _rgbd_policy(scale: float) -> DiffusionPolicy:
    policy = DiffusionPolicy(PolicyConfig(modality="rgbd", depth_scale_init=scale, **SMALL))
    demos = _demos()
    policy.fit_normalizers(torch.from_numpy(demos["action"])[:, None].expand(-1, 4, -1),
                           torch.from_numpy(demos["state"]))
    for m in policy.denoiser.modules():  # the output layers start at zero; give the conditioning a path
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.normal_(m.weight, std=0.2)
    return policy


def test_depth_shuffle_moves_a_policy_that_reads_depth_and_not_one_whose_lift_is_zero():
    demos = _demos()
    reads = depth_shuffle_effect(_rgbd_policy(5.0), demos, every=1)
    blind = depth_shuffle_effect(_rgbd_policy(0.0), demos, every=1)
    assert reads["observations"] == 6
    assert reads["shuffle_diff_mm_mean"] > 1e-3
    assert blind["shuffle_diff_mm_max"] == pytest.approx(0.0, abs=1e-6)


def test_depth_shuffle_needs_an_rgbd_policy():
    with pytest.raises(ValueError, match="RGB-D"):
        depth_shuffle_effect(DiffusionPolicy(PolicyConfig(**SMALL)), _demos())


def test_chunk_tracking_rows_and_the_auxiliary_localisation():
    from ropekit.robot.demos import collect_demos
    from ropekit.robot.env import PickConfig
    from ropekit.robot.train import DemoChunks

    demos = collect_demos(4, PickConfig.in_distribution(terminate_on_success=True, image_size=32, max_steps=6),
                          seed=2, workers=1, progress=False, noise=0.01)
    demos["episode_success"][:] = True  # (6-step episodes rarely succeed; every episode counts here)
    policy = DiffusionPolicy(PolicyConfig(aux_weight=1.0, **SMALL))
    data = DemoChunks(demos, policy.config)
    policy.fit_normalizers(data.actions, data.state)
    rows = chunk_tracking(policy, demos, steps=[0, 2, 40])
    assert [r["step"] for r in rows] == [0, 2]  # no episode reaches step 40
    for r in rows:
        assert r["observations"] == 4 and r["err_mm"] > 0
        assert -1.0 <= r["corr_x"] <= 1.0 and r["aux_err_mm"] > 0


def test_cli_train_takes_policy_and_training_fields(tmp_path, capsys):
    from ropekit.cli import main
    from ropekit.robot.demos import collect_demos
    from ropekit.robot.env import PickConfig
    from ropekit.robot.train import load_policy

    out = tmp_path / "demos.npz"
    collect_demos(2, PickConfig.in_distribution(terminate_on_success=True, image_size=32, max_steps=6), seed=0,
                  workers=1, progress=False, out=out)
    run = tmp_path / "run"
    args = ["robot", "train", "--demos", str(out), "--out", str(run), "--steps", "1", "--batch-size", "4",
            "--all-episodes", "--no-progress", "--set", "keypoints=true", "--set", "aux_weight=0.5",
            "--set", 'vit_overrides={"depth": 1, "patch_size": 8, "embed_dim": 48, "num_heads": 1}',
            "--train-set", "shift=0"]
    assert main(args) == 0
    cfg = load_policy(run).config
    assert cfg.keypoints is True and cfg.aux_weight == 0.5
    assert json.loads((run / "config.json").read_text())["train"]["shift"] == 0
    assert main(args[:-2] + ["--train-set", "not_a_field=1"]) != 0
    assert "unknown PolicyTrainConfig field(s) in --train-set: not_a_field" in capsys.readouterr().err
