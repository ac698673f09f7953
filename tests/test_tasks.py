"""The task registry (:mod:`ropekit.train.tasks`): every task is listed without importing its module, builds its
``Task`` from a tiny configuration, and ``ropekit train --task`` reads it."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from ropekit.cli import main
from ropekit.train.distributed import DistContext
from ropekit.train.tasks import TASK_MODULES, TASKS, lookup_task, register_task, task_names

NAMES = ["classification", "native-resolution", "detection", "robot", "aloha", "retrieval", "owl"]
SMALL_POLICY = dict(vit_overrides={"depth": 1, "patch_size": 8, "embed_dim": 48, "num_heads": 1},
                    pe_options={"block_size": 8}, hidden_dim=64, cond_dim=64, num_blocks=1, num_inference_steps=2,
                    horizon=4, n_action_steps=2)


def test_listing_the_tasks_imports_none_of_their_modules():
    code = ("import sys; from ropekit.train.tasks import task_names; print(task_names()); "
            "print(sorted(m for m in sys.modules if m.startswith(('ropekit.detection', 'ropekit.robot', 'ropekit.multimodal'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == [repr(NAMES), "[]"]


def test_an_unknown_task_is_one_line_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"^unknown task 'nope'; known: classification, native-resolution, "
                                         r"detection, robot, aloha, retrieval, owl$"):
        lookup_task("nope")


def test_a_task_registered_from_outside_is_listed_and_found(monkeypatch):
    monkeypatch.setattr("ropekit.train.tasks.TASKS", dict(TASKS))
    import ropekit.train.tasks as tasks

    @register_task("toy", "a toy task", config=dict)
    def build_toy(cfg: dict) -> dict:
        return cfg

    assert tasks.task_names()[-1] == "toy"
    assert lookup_task("toy").build({"a": 1}) == {"a": 1}
    with pytest.raises(ValueError, match="already registered"):
        register_task("toy", "again", config=dict)(build_toy)


def _tiny_config(name: str, tmp_path):
    if name == "classification":
        from ropekit.train import TrainConfig

        return TrainConfig(data="digits", train_fraction=0.1, batch_size=8, threads=1, device="cpu",
                           model_options=dict(embed_dim=24, depth=1, num_heads=1, mlp_ratio=2.0))
    if name == "native-resolution":
        from ropekit.train import TrainConfig

        return TrainConfig(data="digits", train_fraction=0.1, native_resolution=True, patch_size=2, threads=1,
                           device="cpu", native_options={"seq_len": 48, "rows": 4, "min_tokens": 4, "max_tokens": 16},
                           model_options=dict(embed_dim=24, depth=1, num_heads=1, mlp_ratio=2.0))
    if name == "retrieval":
        from ropekit.multimodal import RetrievalConfig, RetrievalOptions
        from ropekit.train import TrainConfig

        return RetrievalConfig(TrainConfig(data="captioned-scenes", data_options={"num_train": 16, "num_test": 8},
                                           image_size=16, patch_size=4, batch_size=8, threads=1, device="cpu",
                                           model_options=dict(embed_dim=24, depth=1, num_heads=2)),
                               RetrievalOptions(embed_dim=16, text_width=16, text_depth=1))
    if name == "detection":
        from ropekit.detection.model import detector_config
        from ropekit.detection.train import DetTrainConfig, DetectionTaskConfig

        n, size, rng = 4, 32, np.random.default_rng(0)
        boxes = np.zeros((n, 2, 12), np.float32)
        boxes[:, 0] = [0.0, 0.0, 1.0, 1, 0, 0, 0, 1, 0, 0.2, 0.2, 0.2]
        K = np.tile(np.array([[30, 0, 15.5], [0, 30, 15.5], [0, 0, 1]], np.float32), (n, 1, 1))
        np.savez(tmp_path / "scenes.npz", rgb=rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8),
                 depth=rng.uniform(0.5, 2.0, (n, size, size)).astype(np.float32), K=K,
                 extrinsics=np.tile(np.eye(4, dtype=np.float32), (n, 1, 1)), boxes=boxes,
                 labels=np.array([[0, -1]] * n), valid=np.array([[True, False]] * n),
                 pixels=np.array([[10, 0]] * n, np.int32), instance=np.full((n, size, size), -1, np.int8))
        return DetectionTaskConfig(str(tmp_path / "scenes.npz"),
                                   detector_config("cayley", "rgbd", image_size=size, patch_size=8, depth=1),
                                   DetTrainConfig(steps=2, batch_size=2, log_every=1))
    if name == "owl":
        from ropekit.detection.owl_task import OwlDataConfig, OwlTaskConfig, OwlTrainConfig

        towers = {"vit": {"embed_dim": 24, "depth": 1, "num_heads": 2}, "image_size": 16, "embed_dim": 16,
                  "text": {"embed_dim": 16, "depth": 1, "num_heads": 2}}
        return OwlTaskConfig(towers=towers, data=OwlDataConfig(num_train=4, num_test=2, image_size=16),
                             train=OwlTrainConfig(steps=2, batch_size=2, log_every=1))
    from ropekit.robot.train import PolicyTrainConfig

    n, size, rng = 6, 32, np.random.default_rng(0)
    train = PolicyTrainConfig(steps=2, batch_size=2, log_every=1, noise_samples=1)
    if name == "robot":
        from ropekit.robot.env import PickConfig
        from ropekit.robot.policy import PolicyConfig
        from ropekit.robot.train import PolicyTaskConfig

        np.savez(tmp_path / "demos.npz", rgb=rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8),
                 depth=rng.uniform(0.6, 1.4, (n, size, size)).astype(np.float32),
                 state=rng.normal(size=(n, 11)).astype(np.float32), action=rng.normal(size=(n, 4)).astype(np.float32),
                 episode=np.zeros(n, int), step=np.arange(n), episode_length=np.array([n]),
                 episode_success=np.array([True]), config_json=json.dumps(dataclasses.asdict(PickConfig())),
                 expert_json="{}")
        return PolicyTaskConfig(str(tmp_path / "demos.npz"),
                                PolicyConfig(modality="rgbd", image_size=size, **SMALL_POLICY), train)
    from ropekit.robot.aloha.policy import AlohaPolicyConfig, AlohaTaskConfig

    np.savez(tmp_path / "aloha.npz", rgb=rng.integers(0, 256, (n, 24, size, 3), dtype=np.uint8),
             qpos=rng.normal(size=(n, 14)).astype(np.float32), action=rng.normal(size=(n, 14)).astype(np.float32),
             frame_row=np.arange(n), episode=np.zeros(n, int), step=np.arange(n), episode_length=np.array([n]))
    return AlohaTaskConfig(str(tmp_path / "aloha.npz"),
                           AlohaPolicyConfig(modality="image", pe="circulant", image_hw=(24, size), **SMALL_POLICY), train)


@pytest.mark.parametrize("name", NAMES)
def test_each_task_builds_from_a_tiny_config_and_its_model_trains_a_step(name, tmp_path):
    spec = lookup_task(name)
    assert spec.name == name and spec.help
    cfg = _tiny_config(name, tmp_path)
    assert isinstance(cfg, spec.config)
    task = spec.build(cfg)
    ctx = DistContext()
    epoch = task.epoch_batches(0, ctx)  # a sequence of batches, or a streamed epoch (packed batches)
    batch = next(epoch.iter_from(0)) if hasattr(epoch, "iter_from") else epoch[0]
    loss, sums = task.loss(task.model, batch, torch.device("cpu"))
    loss.backward()
    assert loss.ndim == 0 and torch.isfinite(loss) and sums
    grads = [p.grad for p in task.model.parameters() if p.requires_grad]
    assert grads and any(g is not None and g.abs().sum() > 0 for g in grads)


def test_every_task_module_registers_the_task_it_is_listed_under():
    assert list(TASK_MODULES) == NAMES
    for name in NAMES:
        assert lookup_task(name).build.__module__ == TASK_MODULES[name]


def test_ropekit_train_lists_the_tasks_and_points_to_the_command_of_the_others(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--task TASK" in help_text and "training task: classification, native-resolution, detection, robot, aloha, retrieval, owl" in \
        help_text
    for name in ("detection", "robot", "aloha"):
        assert main(["train", "--task", name]) == 2
        err = capsys.readouterr().err
        assert err.strip().endswith(f"task {name!r} is trained by `{lookup_task(name).command}`")
    assert main(["train", "--task", "nope"]) == 2
    assert "unknown task 'nope'" in capsys.readouterr().err
    assert lookup_task("classification").command is None
