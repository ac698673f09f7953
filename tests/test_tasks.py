"""The task registry (:mod:`ropekit.train.tasks`): every task is listed without importing its module, builds its
``Task`` from a tiny configuration, and ``ropekit train --task`` trains it -- ropekit's own tasks and a task of
another package, found through the ``ropekit.tasks`` entry points."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import json
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ropekit.cli import main
from ropekit.train.distributed import DistContext
from ropekit.train import tasks as registry
from ropekit.train.tasks import BUILTIN_ENTRY_POINTS, TASKS, lookup_task, register_task, task_entry_points, \
    task_names

NAMES = ["classification", "native-resolution", "detection", "robot", "aloha", "retrieval", "owl"]
SMALL_POLICY = dict(vit_overrides={"depth": 1, "patch_size": 8, "embed_dim": 48, "num_heads": 1},
                    pe_options={"block_size": 8}, hidden_dim=64, cond_dim=64, num_blocks=1, num_inference_steps=2,
                    horizon=4, n_action_steps=2)


def test_listing_the_tasks_imports_none_of_their_modules():
    code = ("import sys; from ropekit.train.tasks import task_names; print(task_names()); "
            "print(sorted(m for m in sys.modules if m.startswith(('ropekit.detection', 'ropekit.robot', 'ropekit.multimodal', "
            "'ropekit.tasks', 'ropekit.classification'))))")
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
        from ropekit.classification import TrainConfig

        return TrainConfig.from_dict(dict(data="digits", train_fraction=0.1, batch_size=8, threads=1, device="cpu",
                           model_options=dict(embed_dim=24, depth=1, num_heads=1, mlp_ratio=2.0)))
    if name == "native-resolution":
        from ropekit.classification import TrainConfig

        return TrainConfig.from_dict(dict(data="digits", train_fraction=0.1, native_resolution=True, patch_size=2,
                                          threads=1,
                           device="cpu", native_options={"seq_len": 48, "rows": 4, "min_tokens": 4, "max_tokens": 16},
                           model_options=dict(embed_dim=24, depth=1, num_heads=1, mlp_ratio=2.0)))
    if name == "retrieval":
        from ropekit.multimodal import RetrievalConfig, RetrievalOptions
        from ropekit.classification import TrainConfig

        return RetrievalConfig(TrainConfig.from_dict(dict(data="captioned-scenes", data_options={"num_train": 16,
                                                                                                 "num_test": 8},
                                           image_size=16, patch_size=4, batch_size=8, threads=1, device="cpu",
                                           model_options=dict(embed_dim=24, depth=1, num_heads=2))),
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
                           AlohaPolicyConfig(modality="image", pe="circulant", image_hw=(24, size),
                                             **SMALL_POLICY), train)


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


def test_importing_the_engine_imports_no_task_and_classification_is_a_task_package():
    # (until classification moved to ropekit.classification, ropekit.train's facade imported it on first use of its
    # names; the engine now names no task at all, and the task's names are importable from its own package)
    code = ("import sys, ropekit.train, ropekit.train.engine; "
            "print(sorted(m for m in sys.modules if m.startswith(('ropekit.detection', 'ropekit.robot', "
            "'ropekit.multimodal', 'ropekit.tasks', 'ropekit.classification')))); "
            "print(hasattr(ropekit.train, 'TrainConfig'), hasattr(ropekit.train, 'train')); "
            "from ropekit.classification import train, ClassificationTask, evaluate_run, TrainConfig; "
            "print(train.__module__, TrainConfig.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == ["[]", "False False", "ropekit.classification.trainer ropekit.classification.config"]
    import ropekit.train

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        ropekit.train.nope


def test_every_entry_point_names_the_builder_of_its_task():
    assert list(task_entry_points()) == NAMES
    for name, target in task_entry_points().items():
        module, attr = target.split(":")
        assert getattr(importlib.import_module(module), attr) is lookup_task(name).build


def test_pyproject_declares_the_builtin_entry_points():
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert pyproject["project"]["entry-points"]["ropekit.tasks"] == BUILTIN_ENTRY_POINTS


_INSTALLED_ENTRY_POINTS = importlib.metadata.entry_points


def _entry_points(monkeypatch, *extra: SimpleNamespace, installed: bool = True) -> None:
    """``importlib.metadata.entry_points`` as the registry sees it: the installed ones of the group (unless
    ``installed=False``: an install whose metadata lacks them), then ``extra``."""
    def entry_points(**select):
        if set(select) != {"group"}:  # another library's question (e.g. Triton's backends): the installed answer
            return _INSTALLED_ENTRY_POINTS(**select)
        return [*(_INSTALLED_ENTRY_POINTS(**select) if installed else []),
                *[ep for ep in extra if ep.group == select["group"]]]

    monkeypatch.setattr(registry.metadata, "entry_points", entry_points)


def test_ropekit_metadata_replaces_the_builtin_table_and_other_packages_add_to_it(monkeypatch):
    ours = SimpleNamespace(name="classification", value="ropekit.classification.trainer:build_classification_task",
                           group="ropekit.tasks", dist=SimpleNamespace(name="ropekit"))
    theirs = SimpleNamespace(name="theirs", value="their_package:build", group="ropekit.tasks",
                             dist=SimpleNamespace(name="their-package"))
    clash = SimpleNamespace(name="robot", value="their_package:robot", group="ropekit.tasks",
                            dist=SimpleNamespace(name="their-package"))
    _entry_points(monkeypatch, theirs, clash, installed=False)  # ropekit's metadata without the group: the table
    table = task_entry_points()
    assert table == {**BUILTIN_ENTRY_POINTS, "theirs": "their_package:build"}  # the builtin robot wins
    _entry_points(monkeypatch, ours, theirs, installed=False)
    assert task_entry_points() == {"classification": ours.value, "theirs": theirs.value}


USER_TASK = textwrap.dedent('''
    """A task of another package: least squares y = X w of a fixed random problem, in epochs of 4 batches."""
    import torch
    from ropekit.classification import TrainConfig
    from ropekit.train.tasks import register_task

    g = torch.Generator().manual_seed(0)
    X = torch.randn(64, 3, generator=g, dtype=torch.float64).float()
    Y = X @ torch.tensor([[1.0], [-2.0], [0.5]])


    class LeastSquares:
        name = "least-squares"

        def __init__(self, cfg):
            torch.manual_seed(cfg.run.seed)
            self.model = torch.nn.Linear(3, 1, bias=False)

        def epoch_batches(self, epoch, ctx):
            return [list(range(i, 64, 4)) for i in range(4)]

        def loss(self, model, batch, device):
            err = model(X[batch].to(device)) - Y[batch].to(device)
            loss = (err ** 2).mean()
            return loss, {"loss": loss.detach() * len(batch), "count": float(len(batch))}

        def epoch_row(self, epoch, sums, info, ctx):
            return {"epoch": epoch + 1, "loss": float(sums["loss"]) / sums["count"], "lr": info["lr"]}


    @register_task("mytask", "least squares (a user task)", config=TrainConfig)
    def build(cfg):
        return LeastSquares(cfg)
''')


def test_a_task_of_another_package_trains_through_ropekit_train(monkeypatch, tmp_path, capsys):
    (tmp_path / "my_tasks.py").write_text(USER_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "TASKS", dict(TASKS))
    monkeypatch.delitem(sys.modules, "my_tasks", raising=False)
    _entry_points(monkeypatch, SimpleNamespace(name="mytask", value="my_tasks:build", group="ropekit.tasks",
                                               dist=SimpleNamespace(name="my-package")))
    assert task_names() == [*NAMES, "mytask"] and "my_tasks" not in sys.modules
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "owl, mytask" in " ".join(capsys.readouterr().out.split())
    out = tmp_path / "run"
    argv = ["train", "--task", "mytask", "--epochs", "4", "--lr", "0.1", "--warmup-epochs", "0", "--weight-decay", "0",
            "--out", str(out), "--device", "cpu", "--threads", "1", "--no-progress", "--no-tensorboard"]
    assert main(argv) == 0, capsys.readouterr().err
    assert "task mytask: " in capsys.readouterr().out
    import my_tasks

    rows = [line.split(",") for line in (out / "metrics.csv").read_text().splitlines()]
    loss = [float(r[rows[0].index("loss")]) for r in rows[1:]]
    assert len(loss) == 4 and all(b < a for a, b in zip(loss, loss[1:]))
    # the checkpoint holds the trained weights: their loss on the whole problem, computed here in float64, is below
    # the first epoch's mean and below that of the initial weights (the task's seeded initialisation, rebuilt here)
    def mse(w: torch.Tensor) -> float:
        return float(((my_tasks.X.double() @ w.double().T - my_tasks.Y.double()) ** 2).mean())

    torch.manual_seed(0)
    initial = mse(torch.nn.Linear(3, 1, bias=False).weight.detach())
    final = mse(torch.load(out / "checkpoint.pt", weights_only=False)["model"]["weight"])
    assert final < loss[0] < initial * 1.5 and final < initial / 2
    assert json.loads((out / "config.json").read_text())["task"] == "mytask"
    assert main(argv[:3] + ["--task-opt", "a=1"]) == 2
    assert "task 'mytask' takes no --task-opt" in capsys.readouterr().err


def test_an_entry_point_that_registers_nothing_is_one_line(monkeypatch):
    _entry_points(monkeypatch, SimpleNamespace(name="ghost", value="json:dumps", group="ropekit.tasks",
                                               dist=SimpleNamespace(name="x")))
    with pytest.raises(ValueError, match=r"^the entry point ghost = 'json:dumps' of ropekit.tasks registers no task "
                                         r"named 'ghost' \(decorate"):
        lookup_task("ghost")


def test_ropekit_train_lists_the_tasks_and_refuses_what_a_task_does_not_read(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--task TASK" in help_text and "training task: classification, native-resolution, detection, robot, aloha, retrieval, owl" in \
        help_text
    for name in ("detection", "robot", "aloha"):
        assert lookup_task(name).command is None and lookup_task(name).train is not None
        cases = {("--mixup", "0.2"): f"--mixup does not apply to the {name} task; it reads ",
                 ("--epochs", "3"): f"--epochs does not apply to the {name} task (it trains for a number of steps: "
                                    f"--task-opt steps=N)",
                 ("--set", "label_smoothing=0.1"): f"--set label_smoothing does not apply to the {name} task",
                 ("--preset", "deit-b16"): f"--preset (the recipes are classification's) does not apply to the "
                                           f"{name} task",
                 ("--resume", "--allow-change", "epochs"): f"--allow-change does not apply to the {name} task",
                 ("--task-opt", "bogus=1"): f"unknown --task-opt bogus for the {name} task; known: "}
        for extra, message in cases.items():
            assert main(["train", "--task", name, *extra]) == 2
            err = capsys.readouterr().err.strip()
            assert len(err.splitlines()) == 1 and message in err, err
    assert main(["train", "--task", "robot", "--task-opt", "lr=0.1"]) == 2
    assert "--task-opt lr: the robot task takes it from --lr (one spelling per setting)" in capsys.readouterr().err
    assert main(["train", "--task", "nope"]) == 2
    assert "unknown task 'nope'" in capsys.readouterr().err
    assert lookup_task("classification").command is None
    native = lookup_task("native-resolution")  # `--task native-resolution` is `--native-resolution`
    assert native.command is None and native.defaults == {"native_resolution": True}
    assert native.train == lookup_task("classification").train == "ropekit.train.commands:train_classification"


# ropekit train --task NAME of the step-counted tasks, on the tiny data of _tiny_config
_TINY_RUN = ["--task-opt", "steps=2", "--batch-size", "2", "--log-every", "1", "--device", "cpu", "--threads", "1",
             "--no-progress", "--no-tensorboard"]
_TINY_POLICY = ["--task-opt", "noise_samples=1", "--model-opt", "depth=1", "--model-opt", "embed_dim=48",
                "--model-opt", "num_heads=1", "--task-opt", "hidden_dim=64", "--task-opt", "cond_dim=64",
                "--task-opt", "num_blocks=1", "--task-opt", "horizon=4", "--task-opt", "n_action_steps=2",
                "--pe-opt", "block_size=8"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["detection", "robot", "aloha"])
def test_ropekit_train_trains_the_step_counted_tasks_and_resumes_them(name, tmp_path, capsys):
    _tiny_config(name, tmp_path)
    out = tmp_path / "run"
    data = {"detection": ["--task-opt", f"scenes={tmp_path / 'scenes.npz'}", "--task-opt",
                          f"test_scenes={tmp_path / 'scenes.npz'}", "--model-opt", "depth=1", "--task-opt",
                          "iou_samples=64"],
            "robot": ["--task-opt", f"demos={tmp_path / 'demos.npz'}", "--image-size", "32", *_TINY_POLICY],
            "aloha": ["--task-opt", f"demos={tmp_path / 'aloha.npz'}", "--pe", "circulant", *_TINY_POLICY]}[name]
    argv = ["train", "--task", name, *data, *_TINY_RUN, "--out", str(out), "--lr", "0.002", "--seed", "3"]
    assert main(argv) == 0, capsys.readouterr().err
    assert f"run folder {out}" in capsys.readouterr().out or (out / "checkpoint.pt").is_file()
    config = json.loads((out / "config.json").read_text())
    assert config["train"]["steps"] == 2 and config["train"]["lr"] == 0.002 and config["train"]["seed"] == 3
    rows = (out / "metrics.csv").read_text().splitlines()
    assert len(rows) == 3  # a header and one row per --log-every 1 step
    if name == "detection":
        assert config["model"]["vit"]["depth"] == 1 and "mean_iou" in json.loads((out / "metrics.json").read_text())
    else:
        assert config["policy"]["vit_overrides"] == {"depth": 1, "patch_size": 8, "embed_dim": 48, "num_heads": 1}
        assert config["policy"]["pe_options"] == {"block_size": 8} and config["policy"]["horizon"] == 4
    # a fresh run refuses the folder; --resume continues it (finished: nothing left to train, same files)
    assert main(argv) == 2
    assert "already holds" in capsys.readouterr().err
    assert main([*argv[:-6], *argv[-4:], "--resume", str(out)]) == 0, capsys.readouterr().err
    assert (out / "metrics.csv").read_text().splitlines() == rows
    if name == "robot":  # the 2-D policy into RGB-D: its head and chunking, the depth lift at 0 (starts equal)
        from ropekit.robot.train import load_policy

        rgbd = tmp_path / "rgbd"
        argv3d = ["train", "--task", "robot", "--task-opt", f"demos={tmp_path / 'demos.npz'}", "--task-opt",
                  "modality=rgbd", "--init-from", str(out), "--pe", "circulant", *_TINY_RUN, "--out", str(rgbd)]
        assert main(argv3d) == 0, capsys.readouterr().err
        base, policy = load_policy(out), load_policy(rgbd)
        assert (policy.config.modality, policy.config.pe, policy.config.depth_scale_init) == ("rgbd", "circulant", 0.0)
        assert policy.config.horizon == base.config.horizon == 4
        assert main([*argv3d[:-1], str(tmp_path / "x"), "--task-opt", "horizon=3"]) == 2
        assert "with init_from the policy is the base run's" in capsys.readouterr().err
