"""Tests of the diffusion policy, its training and the KUKA pick study."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from ropekit.robot.diffusion import DiffusionSchedule, add_noise, ddim_timesteps
from ropekit.robot.env import ACTION_DIM, STATE_DIM
from ropekit.robot.policy import DiffusionPolicy, Normalizer, PolicyConfig, images_from_obs, init_from_2d
from ropekit.robot.train import DemoChunks, load_policy, save_policy

SMALL = dict(vit_overrides={"depth": 1, "patch_size": 8, "embed_dim": 48, "num_heads": 1},
             pe_options={"block_size": 8}, image_size=32, hidden_dim=64, cond_dim=64, num_blocks=2,
             num_inference_steps=3, horizon=4, n_action_steps=2)
B = 3


@pytest.fixture(autouse=True)
def _seed_and_one_thread():
    # one thread: these models are tiny, and intra-op threads only add waiting on a shared machine
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(threads)


def _batch(b: int = B, size: int = 32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rgb = torch.randint(0, 256, (b, size, size, 3), generator=g, dtype=torch.uint8)
    depth = 0.8 + 0.6 * torch.rand(b, size, size, generator=g)
    state = torch.randn(b, STATE_DIM, generator=g)
    actions = torch.cat([0.1 * torch.randn(b, 4, 3, generator=g) + state[:, None, :3],
                         (torch.rand(b, 4, 1, generator=g) > 0.5).float()], dim=-1)  # (B, H, A)
    return rgb, depth, state, actions


def _policy(modality: str = "image", **kw) -> DiffusionPolicy:
    return DiffusionPolicy(PolicyConfig(modality=modality, **{**SMALL, **kw}))


@pytest.mark.parametrize("modality", ["image", "rgbd"])
def test_forward_backward_shapes(modality):
    policy = _policy(modality)
    rgb, depth, state, actions = _batch()
    images = images_from_obs(rgb, depth if modality == "rgbd" else None)
    assert images.shape == (B, 3 if modality == "image" else 4, 32, 32)
    policy.fit_normalizers(actions, state)
    t = torch.randint(0, 100, (B,))
    out = policy(images, state, torch.randn(B, 4, ACTION_DIM), t)
    assert out.shape == (B, 4, ACTION_DIM)
    # after one step every parameter is reached (the denoiser's output layers start at zero)
    opt = torch.optim.SGD(policy.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        loss = policy.loss(images, state, actions, noise_samples=2)
        loss.backward()
        opt.step()
    for name, p in policy.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        if not name.endswith("depth_lift.bias"):  # a common shift of every z changes nothing (commuting PE)
            assert p.grad.abs().sum() > 0, name
    chunk = policy.predict(images, state, torch.Generator().manual_seed(0))
    assert chunk.shape == (B, 4, ACTION_DIM) and torch.isfinite(chunk).all()
    assert set(chunk[..., 3].unique().tolist()) <= {0.0, 1.0}


def test_training_steps_lower_the_loss():
    policy = _policy("rgbd")
    rgb, depth, state, actions = _batch(8)
    images = images_from_obs(rgb, depth)
    policy.fit_normalizers(actions, state)

    def fixed_loss() -> float:  # same timesteps and noise every time
        with torch.no_grad():
            gen = torch.Generator().manual_seed(1)
            return policy.loss(images, state, actions, noise_samples=4, generator=gen).item()

    before = fixed_loss()
    opt = torch.optim.Adam(policy.parameters(), lr=2e-3)
    for i in range(5):
        opt.zero_grad()
        policy.loss(images, state, actions, noise_samples=4, generator=torch.Generator().manual_seed(1)).backward()
        opt.step()
    assert fixed_loss() < 0.8 * before


def test_3d_policy_from_2d_starts_equal():
    p2 = _policy("image")
    rgb, depth, state, actions = _batch()
    p2.fit_normalizers(actions, state)
    opt = torch.optim.Adam(p2.parameters(), lr=1e-2)  # move away from the zero-initialised output layers
    for _ in range(3):
        opt.zero_grad()
        p2.loss(images_from_obs(rgb), state, actions).backward()
        opt.step()
    p3 = _policy("rgbd", depth_scale_init=0.0)
    widened = init_from_2d(p3, p2.state_dict())
    assert widened and all("circ_params" in n for n in widened)
    assert p3.encoder.depth_lift.scale.item() == 0.0 and p3.encoder.depth_lift.bias.item() == 0.0
    x2, x3 = images_from_obs(rgb), images_from_obs(rgb, depth)
    noisy, t = torch.randn(B, 4, ACTION_DIM), torch.tensor([0, 50, 99])
    p2.eval(), p3.eval()
    torch.testing.assert_close(p3(x3, state, noisy, t), p2(x2, state, noisy, t), atol=1e-5, rtol=1e-5)
    a2 = p2.predict(x2, state, torch.Generator().manual_seed(3))
    a3 = p3.predict(x3, state, torch.Generator().manual_seed(3))
    torch.testing.assert_close(a3, a2, atol=1e-4, rtol=1e-4)
    # the depth lift can learn from zero: its scale gets a gradient
    p3.train()
    p3.loss(x3, state, actions).backward()
    assert p3.encoder.depth_lift.scale.grad.abs() > 0
    # a mismatching encoding is refused with a readable error
    with pytest.raises(ValueError, match="does not match|cannot widen"):
        init_from_2d(_policy("rgbd", pe="mixed", pe_options={}), p2.state_dict())


def test_normalizer_and_relative_actions_round_trip():
    policy = _policy("image")
    _, _, state, actions = _batch(16)
    policy.fit_normalizers(actions, state)
    targets = policy.chunk_targets(actions, state)
    torch.testing.assert_close(targets[..., :3], actions[..., :3] - state[:, None, :3])
    norm = policy.action_norm.normalize(targets)
    assert norm.min() >= -1 - 1e-6 and norm.max() <= 1 + 1e-6
    back = policy.chunk_to_env(policy.action_norm.unnormalize(norm), state)
    torch.testing.assert_close(back, actions, atol=1e-5, rtol=1e-5)
    n = Normalizer(2).fit_meanstd(torch.tensor([[1.0, 5.0], [3.0, 5.0]]))
    assert n.scale[1] > 0  # constant columns do not divide by zero


def test_ddim_recovers_x0_with_an_oracle_denoiser():
    x0 = torch.rand(2, 4, ACTION_DIM) * 1.6 - 0.8
    for prediction in ("epsilon", "sample"):
        sched = DiffusionSchedule(100, prediction)
        abar = sched.alphas_cumprod

        def oracle(x_t, t):
            if prediction == "sample":
                return x0
            a = abar[t].view(-1, 1, 1)
            return (x_t - a.sqrt() * x0) / (1 - a).sqrt()

        out = sched.sample(oracle, x0.shape, num_steps=5, generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(out, x0, atol=1e-4, rtol=1e-4)
    assert ddim_timesteps(100, 10) == [99, 89, 79, 69, 59, 49, 39, 29, 19, 9]
    noise = torch.randn_like(x0)
    t = torch.tensor([0, 99])
    xt = add_noise(x0, noise, t, sched.alphas_cumprod)
    assert torch.allclose(xt[0], x0[0], atol=0.1) and xt[1].sub(noise[1]).abs().max() < 0.1


def test_demo_chunks_pad_at_episode_end(tmp_path):
    n_ep, length, size = 2, 3, 32
    rows = n_ep * length
    demos = {
        "rgb": np.zeros((rows, size, size, 3), np.uint8), "depth": np.ones((rows, size, size), np.float32),
        "state": np.zeros((rows, STATE_DIM), np.float32),
        "action": np.arange(rows, dtype=np.float32)[:, None].repeat(ACTION_DIM, 1),
        "episode": np.repeat(np.arange(n_ep), length), "step": np.tile(np.arange(length), n_ep),
        "episode_length": np.full(n_ep, length), "episode_success": np.array([True, False]),
    }
    data = DemoChunks(demos, PolicyConfig(modality="rgbd", horizon=4))
    assert len(data) == length and data.depth is not None
    np.testing.assert_array_equal(data.actions[:, :, 0].numpy(), [[0, 1, 2, 2], [1, 2, 2, 2], [2, 2, 2, 2]])
    assert len(DemoChunks(demos, PolicyConfig(horizon=4), only_successful=False)) == rows
    # save / load round trip keeps the weights and statistics
    policy = _policy("image")
    policy.fit_normalizers(torch.randn(5, 4, ACTION_DIM), torch.randn(5, STATE_DIM))
    save_policy(policy, tmp_path / "p.pt")
    again = load_policy(tmp_path / "p.pt")
    for (k, v), (k2, v2) in zip(policy.state_dict().items(), again.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    pytest.importorskip("pybullet")
    from ropekit.cli import main

    out = tmp_path_factory.mktemp("robot") / "quick"
    assert main(["robot", "experiment", "--quick", "--out", str(out), "--no-progress"]) == 0
    return out


@pytest.mark.sim
@pytest.mark.slow
def test_quick_experiment_writes_its_files(quick_run):
    for name in ("config.json", "demos.npz", "tolerance.json", "robot.csv", "robot.json", "table.md", "robot.png",
                 "training.png", "rollouts.png", "rollout_2d.gif", "rollout_3d.gif", "rollout_2d_ft.gif",
                 "rollout_3d_scratch.gif"):
        assert (quick_run / name).is_file() and (quick_run / name).stat().st_size > 0, name
    doc = json.loads((quick_run / "robot.json").read_text())
    rows = doc["rows"]
    assert {r["policy"] for r in rows} == {"2d", "2d_ft", "3d", "3d_scratch"}
    assert {r["condition"] for r in rows} == {"in_distribution", "ood_table_height"}
    assert all(0.0 <= r["ci95_low"] <= r["success_rate"] <= r["ci95_high"] <= 1.0 for r in rows)
    assert all(len(r["grasp"]) == r["episodes"] for r in rows)
    for a in doc["summary"]["aggregate"]:  # failures by kind account for every failed episode
        assert a["fail_off_target"] + a["fail_too_high"] + a["fail_suction_off"] + a["fail_no_lift"] == \
            a["episodes"] - a["successes"]
    run3d = quick_run / "policies" / "s0" / "3d"
    assert load_policy(run3d).config.modality == "rgbd"
    assert json.loads((run3d / "config.json").read_text())["init_from"].endswith("2d")
    scratch = json.loads((quick_run / "policies" / "s0" / "3d_scratch" / "config.json").read_text())
    # from scratch for as many steps as the 3-D policy had in all (2-D training + fine-tuning)
    assert scratch["train"]["steps"] == 4 + 2 and scratch["init_from"] is None
    depth = {d["policy"]: d for d in doc["summary"]["depth_use"]}
    assert set(depth) == {"3d", "3d_scratch"}
    assert depth["3d"]["scale"] != 0.0  # the lift starts at the recipe's metric scale, not at zero


@pytest.mark.sim
@pytest.mark.slow
def test_quick_experiment_config_is_the_pinned_recipe(quick_run):
    from ropekit_studies.robot import compare_recipe as compare_with_committed  # the robot study's part of it

    doc = json.loads((quick_run / "config.json").read_text())
    assert doc["preset"] == "quick"
    assert compare_with_committed(doc) == []
    changed = dict(doc, recipe={**doc["recipe"], "depth_scale": 1.0})
    assert any("depth_scale" in line for line in compare_with_committed(changed))
    runs = [dict(r) for r in doc["runs"]]
    runs[0]["settings"] = {**runs[0]["settings"], "train": {**runs[0]["settings"]["train"], "lr": 1.0}}
    assert any("s0/2d train" in line for line in compare_with_committed(dict(doc, runs=runs)))
    assert any("missing" in line for line in compare_with_committed(dict(doc, runs=doc["runs"][1:])))
    # evaluation conditions do not change training: a folder that evaluated fewer of them still matches; one that
    # evaluated a condition the recipe does not list, or seeds outside it, does not
    fewer = dict(doc, recipe={**doc["recipe"], "conditions": doc["recipe"]["conditions"][:1]})
    assert compare_with_committed(fewer) == []
    more = dict(doc, recipe={**doc["recipe"], "conditions": doc["recipe"]["conditions"] + ["ood_light"]})
    assert any("conditions" in line for line in compare_with_committed(more))
    other_seed = dict(doc, recipe={**doc["recipe"], "seeds": [7]})
    assert any("seeds" in line for line in compare_with_committed(other_seed))


@pytest.mark.sim
@pytest.mark.slow
def test_cli_train_and_eval(quick_run, tmp_path):
    from ropekit.cli import main

    demos = str(quick_run / "demos.npz")
    run3d = tmp_path / "3d"
    args = ["robot", "train", "--demos", demos, "--out", str(run3d), "--modality", "rgbd", "--init-from",
            str(quick_run / "policies" / "s0" / "2d"), "--steps", "1", "--batch-size", "4", "--all-episodes",
            "--no-progress"]
    assert main(args) == 0  # (--all-episodes: the 6-step quick demos rarely succeed)
    out = tmp_path / "eval.json"
    assert main(["robot", "eval", str(run3d), "--conditions", "ood_light", "--episodes", "1", "--max-steps", "2",
                 "--workers", "1", "--out", str(out), "--no-progress"]) == 0
    (row,) = json.loads(out.read_text())
    assert row["condition"] == "ood_light" and row["episodes"] == 1


def test_auxiliary_loss_is_the_weighted_target_regression():
    policy = _policy(aux_weight=0.5)
    plain = _policy()
    plain.load_state_dict({k: v for k, v in policy.state_dict().items() if not k.startswith("aux_head")})
    rgb, _, state, actions = _batch()
    images = images_from_obs(rgb)
    policy.fit_normalizers(actions, state)
    plain.fit_normalizers(actions, state)
    pos = state[:, :3] + torch.tensor([0.1, -0.2, 0.05])  # (B, 3): the target relative to the tip is known
    with pytest.raises(ValueError, match="object_pos"):
        policy.loss(images, state, actions)
    total = policy.loss(images, state, actions, generator=torch.Generator().manual_seed(1), object_pos=pos)
    base = plain.loss(images, state, actions, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        pred = policy.aux_head(policy.encode(images, state))  # (B, 3), units of 10 cm
    aux = ((pred - torch.tensor([1.0, -2.0, 0.5])) ** 2).mean()
    torch.testing.assert_close(total, base + 0.5 * aux)
    # aux_position inverts the loss's target: at the head's own estimate the auxiliary term is zero
    with torch.no_grad():
        where = policy.aux_position(images, state)  # (B, 3) world metres
    at_estimate = policy.loss(images, state, actions, generator=torch.Generator().manual_seed(1), object_pos=where)
    torch.testing.assert_close(at_estimate, base)
    with pytest.raises(ValueError, match="no auxiliary head"):
        plain.aux_position(images, state)


def test_robot_commands_refuse_missing_and_foreign_files_in_one_line(tmp_path, capsys):
    """``ropekit robot train --demos`` with no file, a JSON, a single array or another archive, and ``ropekit robot
    eval`` of a folder without a policy: one line each, before any worker starts (no numpy words about pickles)."""
    from ropekit.cli import main

    np.save(tmp_path / "array.npy", np.zeros(3))
    np.savez(tmp_path / "other.npz", a=np.zeros(2))
    (tmp_path / "notes.json").write_text("{}")
    cases = [(tmp_path / "missing.npz", "no demonstrations at .*ropekit robot collect"),
             (tmp_path / "notes.json", "not a demonstrations file.*not an .npz archive"),
             (tmp_path / "array.npy", "not a demonstrations file.*a single .npy array"),
             (tmp_path / "other.npz", "not a demonstrations file of `ropekit robot collect`$")]
    for path, words in cases:
        assert main(["robot", "train", "--demos", str(path), "--out", str(tmp_path / "run")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and re.search(words, err) and "pickle" not in err, err
    assert not (tmp_path / "run").exists()
    assert main(["robot", "eval", str(tmp_path), "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert "no policy checkpoint at" in captured.err and "evaluate" not in captured.err.split("error:")[0]
