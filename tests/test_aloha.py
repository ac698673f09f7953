"""ALOHA bimanual simulation: scripted experts, the demo cache, diffusion policies, headless rendering."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

pytestmark = pytest.mark.sim
pytest.importorskip("gym_aloha", reason='the ALOHA tests need pip install "ropekit[aloha]"')

from ropekit._io import TEMP_GLOB  # noqa: E402
from ropekit.robot.aloha.expert import (DemoConfig, collect_demos, expert_actions,  # noqa: E402
                                        expert_episode, load_or_collect)
from ropekit.robot.aloha.policy import (AlohaChunks, AlohaPolicy, AlohaPolicyConfig,  # noqa: E402
                                        evaluate_policy, load_aloha_policy, save_aloha_policy)
from ropekit.robot.aloha.sim import AlohaSim, axis_angle_quat, quat_mul, object_targets  # noqa: E402


@pytest.fixture(scope="module")
def demos(tmp_path_factory):
    """One transfer-cube demo with RGB-D frames every 50 steps, small images, through the cache."""
    cfg = DemoConfig(task="transfer_cube", episodes=1, seed=3, image_hw=(24, 32), depth=True, frame_stride=50)
    root = tmp_path_factory.mktemp("aloha-cache")
    data, path, cached = load_or_collect(cfg, root)
    return cfg, root, data, path, cached


@pytest.mark.parametrize("task,seed", [("transfer_cube", 0), ("transfer_cube", 1), ("insertion", 0)])
def test_scripted_expert_succeeds_on_replay(task, seed):
    ep = expert_episode(task, seed)
    assert ep["ee_success"] and ep["success"] and ep["max_reward"] == 4
    assert ep["action"].shape == (400, 14) and ep["qpos"].shape == (400, 14)
    # the recorded targets are what the replay followed: its joints end near the last target
    assert np.abs(ep["qpos"][-1, :6] - ep["action"][-2, :6]).max() < 0.1


def test_expert_waypoints_start_at_the_grippers_and_stay_normalised():
    acts = expert_actions("transfer_cube", np.array([0.1, 0.5, 0.05, 1, 0, 0, 0]), steps=400)
    assert acts.shape == (400, 16)
    np.testing.assert_allclose(acts[0, :3], [-0.31718881, 0.5, 0.29525084])
    np.testing.assert_allclose(np.linalg.norm(acts[:, 3:7], axis=1), 1.0, atol=1e-9)
    np.testing.assert_allclose(np.linalg.norm(acts[:, 11:15], axis=1), 1.0, atol=1e-9)
    # the right gripper is over the cube (8 cm above) at step 90
    np.testing.assert_allclose(acts[90, 8:11], [0.1, 0.5, 0.13], atol=1e-9)


def test_quaternion_helpers_match_scipy():
    from scipy.spatial.transform import Rotation

    a, b = axis_angle_quat([0, 1, 0], -60), axis_angle_quat([1, 2, 3], 37)
    ref = (Rotation.from_quat(np.roll(a, -1)) * Rotation.from_quat(np.roll(b, -1))).as_quat()  # x, y, z, w
    got = np.roll(quat_mul(a, b), -1)
    assert min(np.abs(got - ref).max(), np.abs(got + ref).max()) < 1e-12


def test_demo_set_round_trips_through_the_cache(demos):
    cfg, root, data, path, cached = demos
    assert not cached and path.exists() and path.parent == root and cfg.key() in path.name
    again, path2, cached2 = load_or_collect(cfg, root)
    assert cached2 and path2 == path
    for k in ("qpos", "action", "object_pos", "rgb", "depth", "frame_row", "episode_seed"):
        np.testing.assert_array_equal(again[k], data[k])
    assert data["rgb"].shape == (8, 24, 32, 3) and data["rgb"].dtype == np.uint8
    assert data["depth"].dtype == np.float32 and data["qpos"].shape == (400, 14)
    assert int(data["attempts"]) >= 1 and data["episode_success"].all()
    # depth is metric: the nearest table point is ~0.47 m from the top camera; the background is far away
    d = data["depth"][0]
    assert 0.3 < float(d.min()) < 1.0 and float(d.max()) > 10.0
    # another configuration is another file
    assert DemoConfig(task="transfer_cube", episodes=1, seed=4).key() != cfg.key()
    assert not list(root.glob("*.tmp")) and not list(root.glob(TEMP_GLOB))  # atomic write left no temporary behind


@pytest.mark.slow
def test_parallel_collection_gives_the_same_set():
    """Two processes simulate demos side by side; the kept seeds and every array are one process's."""
    cfg = DemoConfig(task="transfer_cube", episodes=2, seed=7, image_hw=(24, 32), frame_stride=100)
    one, two = collect_demos(cfg), collect_demos(cfg, workers=2)
    assert one["episode_seed"].tolist() == [7, 8]
    for k in one:
        if k != "seconds":
            np.testing.assert_array_equal(two[k], one[k], err_msg=k)
    with pytest.raises(ValueError, match="workers must be >= 1"):
        collect_demos(cfg, workers=0)


@pytest.mark.parametrize("pe,modality", [("cayley", "rgbd"), ("absolute", "image")])
def test_policy_trains_and_rolls_out(demos, pe, modality, tmp_path):
    from ropekit.robot.train import PolicyTrainConfig, train_policy

    torch.manual_seed(0)
    _, _, data, _, _ = demos
    cfg = AlohaPolicyConfig(pe=pe, modality=modality, image_hw=(24, 32), horizon=4, n_action_steps=2,
                            vit_overrides={"depth": 1, "patch_size": 8, "embed_dim": 32, "num_heads": 2},
                            cond_dim=32, hidden_dim=32, num_blocks=1, num_inference_steps=2)
    policy = AlohaPolicy(cfg)
    chunks = AlohaChunks(data, cfg)
    assert len(chunks) == 8 and chunks.actions.shape == (8, 4, 14)
    np.testing.assert_array_equal(chunks.actions[1, 0].numpy(), data["action"][50])  # frame 1 is step 50
    rows = train_policy(policy, chunks, PolicyTrainConfig(steps=3, batch_size=4, warmup_steps=1, log_every=1,
                                                          shift=1, noise_samples=1), progress=False)
    assert len(rows) == 3 and all(np.isfinite(r["loss"]) for r in rows)
    # predicted chunks stay within the demonstrations' range (the normaliser's [-1, 1] box)
    images, state, _ = chunks.batch(torch.arange(2))
    pred = policy.predict(images, state, torch.Generator().manual_seed(0))
    lo, hi = chunks.actions.amin((0, 1)), chunks.actions.amax((0, 1))
    assert pred.shape == (2, 4, 14) and bool(((pred >= lo - 1e-4) & (pred <= hi + 1e-4)).all())
    ev = evaluate_policy(policy, "transfer_cube", [7, 8], episode_steps=6, parallel=2)
    assert len(ev["success"]) == 2 and all(0 <= r <= 4 for r in ev["max_reward"])
    save_aloha_policy(policy, tmp_path / "checkpoint.pt")
    again = load_aloha_policy(tmp_path)
    assert again.config == policy.config
    for (n, a), (_, b) in zip(policy.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("task,seed", [("transfer_cube", 5), ("insertion", 5)])
def test_object_targets_are_where_the_simulator_places_each_arms_object(task, seed):
    sim = AlohaSim(task, cameras=())
    sim.reset(seed=seed, render=False)
    objects = sim.object_state  # (7,) cube or (14,) peg then socket, as placed in the scene
    got = object_targets(task, seed)
    np.testing.assert_allclose(got[:3], objects[:3], atol=1e-9)  # the right arm's: the cube / the peg
    np.testing.assert_allclose(got[3:], objects[:3] if task == "transfer_cube" else objects[7:10], atol=1e-9)
    if task == "insertion":  # the peg lies on the right arm's side (x > 0), the socket on the left's
        assert got[0] > 0 > got[3]


def test_aux_loss_predicts_the_objects_and_is_added_to_the_diffusion_loss(demos):
    """aux_weight > 0: a head on the conditioning is trained to output the objects' standardised starting
    positions; the loss is the diffusion loss plus aux_weight times that head's mean squared error."""
    from ropekit.robot.train import PolicyTrainConfig, train_policy

    _, _, data, _, _ = demos
    small = dict(image_hw=(24, 32), horizon=4, n_action_steps=2, cond_dim=32, hidden_dim=32, num_blocks=1,
                 vit_overrides={"depth": 1, "patch_size": 8, "embed_dim": 32, "num_heads": 2}, num_inference_steps=2)
    cfg = AlohaPolicyConfig(aux_weight=0.5, **small)
    chunks = AlohaChunks(data, cfg)
    # where the cube is in each frame (every 50th step): at its seeded pose first, lifted by the hand-over
    pos0 = object_targets("transfer_cube", 3)
    np.testing.assert_allclose(chunks.object_pos[0].numpy(), pos0, atol=1e-6)
    assert float(chunks.object_pos[6, 2]) > pos0[2] + 0.1  # step 300: held up between the grippers
    np.testing.assert_array_equal(chunks.object_pos[:, :3].numpy(), chunks.object_pos[:, 3:].numpy())
    torch.manual_seed(0)
    policy = AlohaPolicy(cfg)
    with pytest.raises(ValueError, match="object positions"):
        policy.fit_normalizers(chunks.actions, chunks.state)
    policy.fit_normalizers(chunks.actions, chunks.state, chunks.object_pos)
    images, state, actions = chunks.batch(torch.arange(4))
    pos = chunks.object_pos[:4]
    torch.testing.assert_close(policy.object_norm.unnormalize(policy.aux_target(pos, state)), pos)
    total = policy.loss(images, state, actions, generator=torch.Generator().manual_seed(1), object_pos=pos)
    head, policy.aux_head = policy.aux_head, None
    plain = policy.loss(images, state, actions, generator=torch.Generator().manual_seed(1))
    policy.aux_head = head
    cond, feats = policy.encode_parts(images, state)
    torch.testing.assert_close(cond, policy.encode(images, state))
    aux = nn.functional.mse_loss(head(feats), policy.aux_target(pos, state))
    torch.testing.assert_close(total, plain + 0.5 * aux)
    # the head reads the image alone: another joint state changes the conditioning, not the estimate
    other = state + 1.0
    torch.testing.assert_close(policy.aux_position(images, other), policy.aux_position(images, state))
    assert not torch.allclose(policy.encode(images, other), cond)
    with pytest.raises(ValueError, match="object_pos"):
        policy.loss(images, state, actions)
    # train_policy fits the object statistics and feeds the positions; the head's error falls
    before = float((policy.aux_position(images, state) - pos).abs().mean())
    train = PolicyTrainConfig(steps=80, batch_size=4, warmup_steps=1, lr=3e-3, ema_decay=0, shift=0, log_every=10,
                              noise_samples=1)  # (a 4-px shift on a 24x32 image would move the cube's pixels)
    rows = train_policy(policy, chunks, train, progress=False)
    assert all(np.isfinite(r["loss"]) for r in rows)
    torch.testing.assert_close(policy.object_norm.offset, chunks.object_pos.mean(0))
    after = float((policy.aux_position(images, state) - pos).abs().mean())
    assert after < 0.5 * before, (before, after)
    # a set cached before the positions were recorded: load_or_collect replays it once and keeps them beside it
    cfg_d, root, _, path, _ = demos
    from ropekit.robot.aloha.expert import load_demo_set, replay_object_positions, save_demo_set

    old = {k: v for k, v in load_demo_set(path).items() if k != "object_pos"}
    np.testing.assert_array_equal(replay_object_positions("transfer_cube", old), data["object_pos"])
    legacy = root / "legacy"
    save_demo_set(old, legacy / path.name, cfg_d)
    again, _, cached = load_or_collect(cfg_d, legacy)
    assert cached and (legacy / (path.name + ".objects.npy")).exists()
    np.testing.assert_array_equal(again["object_pos"], data["object_pos"])
    with pytest.raises(ValueError, match="no auxiliary head"):
        AlohaPolicy(AlohaPolicyConfig(**small)).aux_position(images, state)


def test_relative_targets_are_joint_targets_minus_the_current_position():
    cfg = AlohaPolicyConfig(action_mode="relative", image_hw=(24, 32), horizon=4, n_action_steps=2,
                            vit_overrides={"depth": 1, "patch_size": 8, "embed_dim": 32, "num_heads": 2},
                            cond_dim=32, hidden_dim=32, num_blocks=1, num_inference_steps=2)
    policy = AlohaPolicy(cfg)
    g = torch.Generator().manual_seed(0)
    state = torch.randn(6, 14, generator=g)
    actions = state.unsqueeze(1) + 0.1 * torch.randn(6, 4, 14, generator=g)  # (N, H, 14)
    rel = policy.chunk_targets(actions, state)
    torch.testing.assert_close(rel[:, 2], actions[:, 2] - state)
    torch.testing.assert_close(policy.chunk_to_env(rel, state), actions)
    policy.fit_normalizers(actions, state)  # the [-1, 1] box spans the offsets, not the absolute targets
    torch.testing.assert_close(policy.action_norm.normalize(rel).amax((0, 1)), torch.ones(14))
    # prediction returns absolute targets: offsets within the demos' range, added to the state
    images = torch.rand(2, 3, 24, 32, generator=g)
    pred = policy.predict(images, state[:2], torch.Generator().manual_seed(1)) - state[:2].unsqueeze(1)
    lo, hi = rel.amin((0, 1)), rel.amax((0, 1))
    assert bool(((pred >= lo - 1e-4) & (pred <= hi + 1e-4)).all())
    with pytest.raises(ValueError, match="action_mode"):
        AlohaPolicyConfig(action_mode="velocity")


def test_sim_renders_headless_and_steps_joint_targets():
    import ropekit.robot.aloha.sim as sim_module

    # the module needs only numpy and the simulator: load it by path so the child skips torch's import
    code = ("import os, sys, importlib.util, numpy as np\n"
            f"spec = importlib.util.spec_from_file_location('aloha_sim', {sim_module.__file__!r})\n"
            "m = importlib.util.module_from_spec(spec); sys.modules['aloha_sim'] = m; spec.loader.exec_module(m)\n"
            "AlohaSim = m.AlohaSim\n"
            "s = AlohaSim('insertion', cameras=('top',), image_hw=(24, 32), depth=True)\n"
            "obs = s.reset(seed=0)\n"
            "rgb, d = obs['images']['top'], obs['depths']['top']\n"
            "assert rgb.shape == (24, 32, 3) and rgb.std() > 5, rgb.std()\n"
            "assert d.shape == (24, 32) and d.dtype == np.float32 and d.min() > 0.1\n"
            "target = obs['qpos'].copy(); target[0] += 0.2\n"
            "for _ in range(50): obs, r = s.step(target, render=False)\n"
            "assert abs(obs['qpos'][0] - target[0]) < 0.05, obs['qpos'][0]\n"
            "print(os.environ['MUJOCO_GL'])\n")
    env = {k: v for k, v in os.environ.items() if k not in ("MUJOCO_GL", "DISPLAY", "PYOPENGL_PLATFORM")}
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "egl"


def test_narrower_field_of_view_magnifies_the_cube():
    def cube_pixels(fovy):
        s = AlohaSim("transfer_cube", cameras=("top",), image_hw=(96, 128), fovy=fovy)
        rgb = s.reset(seed=3)["images"]["top"].astype(int)
        return int(((rgb[..., 0] > 120) & (rgb[..., 1] < 60) & (rgb[..., 2] < 60)).sum())  # the red cube

    wide, narrow = cube_pixels(None), cube_pixels(50.0)
    # the pixel area grows with the square of tan(fovy/2): (tan 39 / tan 25)^2 = 3.0
    assert wide > 0 and 2.0 < narrow / wide < 4.5, (wide, narrow)
    with pytest.raises(ValueError, match="fovy"):
        AlohaSim("transfer_cube", cameras=("top",), fovy=0)
    # demo sets recorded with the scene's camera keep their cache key; another field of view gets its own
    assert DemoConfig(episodes=20, frame_stride=4, depth=True).key() == "e74ec830eda3c042"  # the CPU preset's set
    assert DemoConfig(fovy=None).key() != DemoConfig(fovy=50.0).key()


def test_missing_simulator_names_the_fix(monkeypatch):
    import ropekit.robot.aloha.sim as sim

    monkeypatch.setitem(sys.modules, "dm_control", None)
    with pytest.raises(ImportError, match=r'pip install "ropekit\[aloha\]"'):
        sim.require_sim()


def test_bad_inputs_are_one_line_errors():
    with pytest.raises(ValueError, match="unknown ALOHA task"):
        AlohaSim("stack_cubes")
    with pytest.raises(ValueError, match="unknown camera"):
        AlohaSim("transfer_cube", cameras=("nope",))
    s = AlohaSim("transfer_cube", cameras=())
    s.reset(seed=0, render=False)
    with pytest.raises(ValueError, match=r"shape \(14,\)"):
        s.step(np.zeros(16))


def test_presets_state_every_policy_and_training_field():
    from ropekit_studies.aloha import PRESETS, missing_fields

    for name, make in PRESETS.items():
        assert missing_fields(make()) == [], name
    cfg = PRESETS["cpu"]()
    cfg.train.pop("lr")
    del cfg.policy["vit_overrides"]["mlp_ratio"]
    assert missing_fields(cfg) == ["policy.vit_overrides.mlp_ratio", "train.lr"]


@pytest.mark.slow
def test_experiment_quick_writes_table_curves_and_plot(tmp_path, monkeypatch):
    from ropekit_studies import run_experiment

    monkeypatch.setenv("ROPEKIT_ALOHA_CACHE", str(tmp_path / "cache"))
    res = run_experiment("aloha", out=tmp_path / "out", quick=True)
    names = {p.name for p in res.files}
    assert {"config.json", "results.json", "curves.csv", "table.md", "success.png"} <= names
    assert "Cayley-STRING" in res.table and "ViT (learned APE)" in res.table
    rows = res.summary["rows"]
    assert len(rows) == 2 and all(r["expert"] == 1.0 for r in rows)
    # one schedule of 4 steps, evaluated half-way (curve seeds) and at the end (evaluation seeds)
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    for runs in doc["tasks"]["transfer_cube"]["policies"].values():
        assert [(c["step"], c["episodes"]) for c in runs[0]["curve"]] == [(2, 1), (4, 2)]
    # the same command again reads the finished policies back instead of training them again
    from ropekit_studies.aloha import PRESETS, run_experiment as run_aloha

    finished = sorted((tmp_path / "out" / "runs").glob("*/*/result.json"))
    assert len(finished) == 2 and not list((tmp_path / "out" / "runs").glob("*/*/train/train_state.pt"))
    stamps = [p.stat().st_mtime_ns for p in finished]
    again = run_aloha(PRESETS["quick"](), tmp_path / "out")
    assert [p.stat().st_mtime_ns for p in finished] == stamps
    assert again["tasks"]["transfer_cube"]["policies"] == doc["tasks"]["transfer_cube"]["policies"]
    other = PRESETS["quick"]()
    other.train["lr"] = 1e-4
    with pytest.raises(ValueError, match="other settings"):
        run_aloha(other, tmp_path / "out")
    # runs made apart pool into one table (here the same run twice: two "seeds" per encoder)
    from ropekit_studies.aloha import merge_results

    merged = merge_results([tmp_path / "out", tmp_path / "out"], tmp_path / "merged")
    assert all(len(runs) == 2 for runs in merged["tasks"]["transfer_cube"]["policies"].values())
    assert (tmp_path / "merged" / "table.md").exists() and (tmp_path / "merged" / "success.png").exists()
    # a merge takes a committed merge plus a run finished later: the same as merging the three parts at once
    flat = merge_results([tmp_path / "out"] * 3, tmp_path / "flat")
    nested = merge_results([tmp_path / "merged", tmp_path / "out"], tmp_path / "nested")
    for key in ("command", "merged_from", "tasks"):
        assert nested[key] == flat[key], key
    assert len(nested["command"]) == 3 and all(isinstance(c, str) for c in nested["command"])
    configs = [json.loads((tmp_path / d / "config.json").read_text()) for d in ("flat", "nested")]
    assert configs[0] == configs[1] and len(configs[0]["merged"]) == 3
    # the presets train with the object loss: its head and statistics are in every checkpoint
    assert json.loads((tmp_path / "out" / "config.json").read_text())["config"]["policy"]["aux_weight"] == 1.0
    ckpt = torch.load(next((tmp_path / "out" / "runs").glob("*/*/checkpoint.pt")), weights_only=True)
    assert ckpt["state_dict"]["aux_head.1.weight"].shape[0] == 6
    assert torch.isfinite(ckpt["state_dict"]["object_norm.offset"]).all()
    # --aux-weight 0 on the command line turns it off
    from ropekit.cli import main

    assert main(["robot", "aloha", "experiment", "--quick", "--pe", "absolute", "--aux-weight", "0",
                 "--out", str(tmp_path / "noaux")]) == 0
    assert json.loads((tmp_path / "noaux" / "config.json").read_text())["config"]["policy"]["aux_weight"] == 0.0
    ckpt = torch.load(next((tmp_path / "noaux" / "runs").glob("*/*/checkpoint.pt")), weights_only=True)
    assert not any(k.startswith(("aux_head", "object_norm")) for k in ckpt["state_dict"])


@pytest.mark.repro
@pytest.mark.parametrize("study,extra", [("cpu", ()), ("cpu-200", ()), ("cpu-noloss", ("--aux-weight", "0"))])
def test_committed_study_is_what_its_commands_train(study, extra):
    """Every committed ALOHA study (each part of a merge) records a command that resolves, at this version, to
    the configuration it ran with: a changed preset fails here until the study is regenerated. The study made
    before the object loss existed is checked with the ``--aux-weight 0`` its commands.sh states."""
    from ropekit_studies.recipes import compare_with_committed

    folder = Path(__file__).resolve().parent.parent / "docs" / "results" / "aloha" / study
    assert compare_with_committed(folder, extra) == []


def test_committed_study_check_sees_a_changed_recipe(tmp_path):
    from ropekit_studies.recipes import compare_with_committed

    src = Path(__file__).resolve().parent.parent / "docs" / "results" / "aloha" / "cpu-200" / "config.json"
    doc = json.loads(src.read_text())
    doc["merged"][0]["config"]["train"]["lr"] = 0.5
    doc["merged"][1]["command"] = "ropekit train"
    (tmp_path / "config.json").write_text(json.dumps(doc))
    diffs = compare_with_committed(tmp_path)
    assert any("part 0: train.lr: committed 0.5" in d for d in diffs)
    assert any("part 1: no parsable" in d for d in diffs)


@pytest.mark.repro
@pytest.mark.parametrize("study", ["cpu", "cpu-200", "cpu-noloss"])
def test_committed_table_is_what_the_report_writes_from_the_results(study):
    from ropekit_studies.aloha import _table

    folder = Path(__file__).resolve().parent.parent / "docs" / "results" / "aloha" / study
    assert (folder / "table.md").read_text() == _table(json.loads((folder / "results.json").read_text()))


def test_paired_differences_against_the_absolute_embedding():
    from ropekit_studies.aloha import _paired_lines
    from ropekit_studies.robot import pooled_z

    def runs(*rates):  # one run per seed with 10 episodes at the given success rate
        return [{"seed": s, "final": {"success": [i < round(10 * r) for i in range(10)]}} for s, r in enumerate(rates)]

    doc = {"tasks": {"insertion": {"policies": {"ViT (learned APE)": runs(0.5, 0.6, 0.4),
                                                "Cayley-STRING": runs(0.7, 0.6, 0.8),
                                                "RoPE (axial)": runs(0.5)}}}}
    lines = _paired_lines(doc)
    cayley = next(line for line in lines if "Cayley-STRING" in line)
    # per seed +20, +0, +40 points: mean 20, sample sd 20; pooled 21/30 against 15/30
    assert "| +20, +0, +40 | +20.0 ± 20.0 |" in cayley
    assert f"{pooled_z(21, 30, 15, 30):+.2f}" in cayley
    assert abs(pooled_z(21, 30, 15, 30) - 0.2 / np.sqrt(0.6 * 0.4 * (2 / 30))) < 1e-12
    axial = next(line for line in lines if "RoPE (axial)" in line)
    assert "| +0 | +0.0 ± - | +0.00 |" in axial  # one common seed: no spread
    assert _paired_lines({"tasks": {"insertion": {"policies": {"Cayley-STRING": runs(0.5)}}}}) == []
