"""The shared training engine: mixed precision, compile, exact resume and DDP for all three tasks, the guards."""

import errno
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from ropekit.detection.model import Detector3D, detector_config
from ropekit.detection.train import DetectionTask, DetTrainConfig, mean_box, train_detector
from ropekit.robot.policy import DiffusionPolicy, PolicyConfig, images_from_obs
from ropekit.robot.train import TRAIN_STATE, PolicyTrainConfig, load_policy, train_policy
from ropekit.train import engine, load_checkpoint
from ropekit.classification import train
from ropekit.train.checkpoint import CheckpointError
from ropekit.train.engine import EngineOptions, FitOptions, NonFiniteLossError, SaveError, Schedule, fit

sys.path.insert(0, str(Path(__file__).parent))
from test_train import tiny_cfg  # noqa: E402

CPU = EngineOptions(device="cpu", progress=False, tensorboard=False, plots=False)


pytestmark = pytest.mark.usefixtures("one_thread")


def _same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------------------ tiny tasks


def tiny_scenes(n: int = 6, size: int = 32, seed: int = 0):
    from test_detection_model import _toy_scenes

    return _toy_scenes(n, size, seed)


def tiny_detector(scenes) -> Detector3D:
    torch.manual_seed(0)
    model = Detector3D(detector_config("cayley", "rgbd", image_size=32, patch_size=8, depth=1, embed_dim=24))
    model.init_box_prior(mean_box(scenes))
    return model


def tiny_policy() -> DiffusionPolicy:
    return DiffusionPolicy(PolicyConfig(
        modality="rgbd", pe="circulant", pe_options={"block_size": 8}, image_size=32, horizon=4, n_action_steps=2,
        vit_overrides={"depth": 1, "patch_size": 8, "embed_dim": 32, "num_heads": 1}, num_queries=2, hidden_dim=32,
        num_blocks=1, cond_dim=32, num_train_timesteps=20))


class TinyDemos:
    """A stand-in for ``DemoChunks``: 12 random examples of 32-pixel RGB-D images, states and action chunks."""

    def __init__(self, n: int = 12, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.rgb = torch.randint(0, 256, (n, 32, 32, 3), generator=g, dtype=torch.uint8)
        self.depth = 0.8 + 0.6 * torch.rand(n, 32, 32, generator=g)
        self.state = torch.randn(n, 11, generator=g)
        self.actions = torch.cat([0.1 * torch.randn(n, 4, 3, generator=g) + self.state[:, None, :3],
                                  (torch.rand(n, 4, 1, generator=g) > 0.5).float()], dim=-1)  # (N, H, A)
        self.episodes = np.arange(1)

    def __len__(self) -> int:
        return len(self.state)

    def batch(self, index):
        return images_from_obs(self.rgb[index], self.depth[index]), self.state[index], self.actions[index]


# ------------------------------------------------------------------------------------------------ precision


def test_bf16_autocast_training_on_cpu_lowers_the_loss(tmp_path):
    kw = dict(augment_shift=0, lr=1e-2, warmup_epochs=0.0, train_fraction=0.3)  # 21 steps: enough to learn
    res = train(tiny_cfg(tmp_path / "bf16", epochs=3, precision="bf16", **kw), quiet=True)
    losses = [r["train_loss"] for r in res.history]
    assert losses[2] < losses[1] < losses[0] and losses[-1] < 0.95 * losses[0], losses
    fp32 = train(tiny_cfg(tmp_path / "fp32", epochs=3, **kw), quiet=True)
    # autocast really ran: bf16 rounding makes the first epoch differ from fp32, but only slightly
    assert res.history[0]["train_loss"] != fp32.history[0]["train_loss"]
    assert res.history[0]["train_loss"] == pytest.approx(fp32.history[0]["train_loss"], rel=0.05)
    assert load_checkpoint(tmp_path / "bf16")["precision"] == "bf16"


class _Quadratic:
    """A task with a closed form: fit ``w`` to ``target`` under MSE; batches are fixed index lists."""

    name = "quadratic"

    def __init__(self, dim: int = 8) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(dim, dim), nn.Linear(dim, 1))
        self.x = torch.randn(32, dim)
        self.y = self.x.sum(-1, keepdim=True)

    def epoch_batches(self, epoch, ctx):
        return [list(range(i, i + 8)) for i in range(0, 32, 8)]

    def loss(self, model, batch, device):
        out = model(self.x[batch].to(device))
        loss = nn.functional.mse_loss(out.float(), self.y[batch].to(device))
        return loss, {"loss": loss.item(), "count": 1.0}

    def epoch_row(self, epoch, sums, info, ctx):
        return {"epoch": epoch + 1, "loss": sums["loss"] / sums["count"], "lr": info["lr"]}


def test_fp16_uses_a_gradient_scaler_and_trains(tmp_path):
    task = _Quadratic()
    res = fit(task, FitOptions(Schedule(lr=3e-2, total_steps=40), 10,
                               execution=EngineOptions(device="cpu", precision="fp16", progress=False, plots=False),
                               run_dir=tmp_path / "fp16"))
    assert res.history[-1]["loss"] < 0.2 * res.history[0]["loss"]
    scaler = load_checkpoint(tmp_path / "fp16")["scaler"]
    assert scaler is not None and scaler["scale"] > 0


def test_compile_a_tiny_model(tmp_path):
    """torch.compile (the cheap 'eager' backend: graph capture without code generation) trains to the same loss."""
    plain = fit(_Quadratic(), FitOptions(Schedule(lr=1e-2, total_steps=8), 2, execution=CPU))
    task = _Quadratic()
    eager = EngineOptions(device="cpu", compile="eager", progress=False, plots=False)
    compiled = fit(task, FitOptions(Schedule(lr=1e-2, total_steps=8), 2, execution=eager))
    assert task.model._compiled_call_impl is not None  # compiled in place: the state_dict keeps its names
    assert list(task.model.state_dict()) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    for a, b in zip(plain.history, compiled.history):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)


# ------------------------------------------------------------------------------------------------ exact resume


def test_detection_resume_is_bit_exact(tmp_path):
    scenes = tiny_scenes()
    cfg = DetTrainConfig(steps=6, batch_size=4, warmup_steps=1, log_every=2, max_train_objects=2)
    full = tiny_detector(scenes)
    rows = train_detector(full, scenes, cfg, out_dir=tmp_path / "full")
    assert [r["step"] for r in rows] == [2, 4, 6]

    part = tiny_detector(scenes)
    task = DetectionTask(part, scenes, cfg)
    sch = Schedule(lr=cfg.lr, total_steps=cfg.steps, warmup_steps=cfg.warmup_steps, min_lr=cfg.min_lr,
                   weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip)
    stopped = fit(task, FitOptions(sch, task.epochs, execution=CPU, run_dir=tmp_path / "part",
                                   on_step=lambda s: s == 3))
    assert stopped.interrupted and len(stopped.history) == 1  # stopped mid-epoch 2
    again = tiny_detector(scenes)  # a new process: fresh weights, the checkpoint restores everything
    torch.manual_seed(123)  # (the global RNG too)
    rows2 = train_detector(again, scenes, cfg, out_dir=tmp_path / "part", resume=True)
    assert _same_state(full.state_dict(), again.state_dict())
    assert rows2 == [{**r, "seconds": r2["seconds"]} for r, r2 in zip(rows, rows2)]


class _StopAfter(TinyDemos):
    """Demos that press Ctrl-C (SIGINT) when the ``n``-th batch is drawn."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.calls = n, 0

    def batch(self, index):
        self.calls += 1
        if self.calls == self.n:
            os.kill(os.getpid(), __import__("signal").SIGINT)
        return super().batch(index)


def test_policy_resume_after_ctrl_c_is_bit_exact(tmp_path, ctrl_c_delivered):
    cfg = PolicyTrainConfig(steps=5, batch_size=4, warmup_steps=1, log_every=2, ema_decay=0.9, shift=2)
    torch.manual_seed(0)
    full = tiny_policy()
    rows = train_policy(full, TinyDemos(), cfg, tmp_path / "full", progress=False)
    assert [r["step"] for r in rows] == [2, 4, 5]

    torch.manual_seed(0)
    part = tiny_policy()
    with pytest.raises(KeyboardInterrupt):
        train_policy(part, _StopAfter(3), cfg, tmp_path / "part", progress=False)
    assert load_checkpoint(tmp_path / "part" / TRAIN_STATE)["global_step"] == 3
    assert not (tmp_path / "part" / "checkpoint.pt").exists()
    torch.manual_seed(0)
    again = tiny_policy()  # (normalisers come from the training state: not refitted on resume)
    rows2 = train_policy(again, TinyDemos(), cfg, tmp_path / "part", progress=False)  # resumes by itself
    assert _same_state(full.state_dict(), again.state_dict())  # EMA weights included
    assert [r["loss"] for r in rows2] == [r["loss"] for r in rows]
    assert _same_state(load_policy(tmp_path / "full").state_dict(), load_policy(tmp_path / "part").state_dict())
    # a folder holding another run's training state is not silently continued
    with pytest.raises(ValueError, match="steps 5 -> 6"):
        train_policy(tiny_policy(), TinyDemos(), PolicyTrainConfig(**{**cfg.to_dict(), "steps": 6}),
                     tmp_path / "part", progress=False)


def test_policy_snapshots_hold_the_ema_weights_and_leave_training_alone():
    """``on_snapshot`` sees the policy as it would be saved at that step; training goes on unchanged."""
    cfg = PolicyTrainConfig(steps=5, batch_size=4, warmup_steps=1, log_every=2, ema_decay=0.9, shift=2)
    torch.manual_seed(0)
    plain = tiny_policy()
    train_policy(plain, TinyDemos(), cfg, progress=False)
    seen = {}

    def grab(step, snap):
        assert not snap.training and not any(p.requires_grad for p in snap.parameters())
        seen[step] = {k: v.clone() for k, v in snap.state_dict().items()}
        for p in snap.parameters():  # scribbling on the copy must not reach the policy being trained
            p.data.fill_(7.0)

    torch.manual_seed(0)
    watched = tiny_policy()
    train_policy(watched, TinyDemos(), cfg, progress=False, snapshot_at=[2, 5], on_snapshot=grab)
    assert sorted(seen) == [2, 5]
    assert _same_state(watched.state_dict(), plain.state_dict())  # same training, same (EMA) result
    assert _same_state(seen[5], plain.state_dict())  # the last snapshot is the saved policy
    assert not _same_state(seen[2], seen[5])


# ------------------------------------------------------------------------------------------------ DDP


@pytest.mark.slow
def test_ddp_two_processes_detection_and_policy(tmp_path, torchrun):
    """torchrun, 2 gloo processes: every rank ends with the same weights (gradients were averaged)."""
    torchrun("engine_ddp_worker.py", tmp_path)
    scenes = tiny_scenes(8)
    init = tiny_detector(scenes).state_dict()
    for name in ("det", "policy"):
        r0, r1 = (torch.load(tmp_path / f"{name}-rank{r}.pt", weights_only=True) for r in (0, 1))
        assert _same_state(r0["state"], r1["state"]), name
        assert r0["rows"] == r1["rows"] or all(a["loss"] == b["loss"] for a, b in zip(r0["rows"], r1["rows"]))
        assert load_checkpoint(tmp_path / name / ("checkpoint.pt" if name == "det" else TRAIN_STATE))["world_size"] == 2
    # (and training moved the detector)
    r0 = torch.load(tmp_path / "det-rank0.pt", weights_only=True)["state"]
    assert any(not torch.equal(r0[k], v) for k, v in init.items() if k in r0 and r0[k].shape == v.shape)


# ------------------------------------------------------------------------------------------------ guards


def test_non_finite_loss_stops_naming_the_step_and_keeps_the_checkpoint(tmp_path, monkeypatch):
    from ropekit.classification.trainer import ClassificationTask

    loss = ClassificationTask.loss
    calls = {"n": 0}

    def poisoned(self, model, batch, device):
        value, sums = loss(self, model, batch, device)
        calls["n"] += 1
        return (value * float("nan"), sums) if calls["n"] == 7 else (value, sums)

    monkeypatch.setattr(ClassificationTask, "loss", poisoned)
    with pytest.raises(NonFiniteLossError, match=r"non-finite loss \(nan\) at step 7 \(epoch 2, batch 2\).*intact"):
        train(tiny_cfg(tmp_path / "nan"), quiet=True)
    ckpt = load_checkpoint(tmp_path / "nan")
    assert (ckpt["epoch"], ckpt["step_in_epoch"], ckpt["global_step"]) == (1, 0, 5)  # the end of epoch 1
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values())


def test_disk_full_while_saving_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    saves = {"n": 0}
    real = engine.atomic_save

    def full_disk(obj, path):
        saves["n"] += 1
        if saves["n"] == 2:
            tmp = Path(path).with_name(".checkpoint.pt.tmp-x")
            tmp.write_bytes(b"half")
            tmp.unlink()  # (atomic_save cleans its temporary file up; the engine must report the error)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, path)

    monkeypatch.setattr(engine, "atomic_save", full_disk)
    with pytest.raises(SaveError, match=r"could not write the checkpoint .*No space left on device.*intact") as e:
        train(tiny_cfg(tmp_path / "full"), quiet=True)
    assert "\n" not in str(e.value)
    ckpt = load_checkpoint(tmp_path / "full")
    assert ckpt["epoch"] == 1  # the first epoch's checkpoint
    assert sorted(p.name for p in (tmp_path / "full").iterdir() if p.name.startswith(".checkpoint")) == []


def test_the_run_folder_is_locked_while_a_run_writes_it(tmp_path):
    run = tmp_path / "locked"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from ropekit.train.engine import RunLock; "
                               f"RunLock({str(run)!r}).acquire(); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1])))
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(engine.RunLockedError, match=rf"being written by another run \(pid {holder.pid}\)"):
            train(tiny_cfg(run), quiet=True)
    finally:
        holder.kill()
        holder.wait()
    res = train(tiny_cfg(run, epochs=1), quiet=True)  # the lock died with its process
    assert len(res.history) == 1


def test_one_training_loop_in_the_code_base():
    """Every optimiser step of ropekit goes through the engine: ``.backward()`` appears there only."""
    root = Path(__file__).parents[1] / "ropekit"
    hits = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                  if re.search(r"\.step\(\)|scaler\.step\(", p.read_text()) and "backward()" in p.read_text())
    # (bench/training_step.py times one forward + backward + step of a model for the speed tables: no loop over data)
    assert hits == ["bench/training_step.py", "train/engine.py"], hits


def test_checkpoint_of_another_size_is_refused(tmp_path):
    task = _Quadratic()
    fit(task, FitOptions(Schedule(lr=1e-2, total_steps=4), 1, execution=CPU, run_dir=tmp_path / "q"))
    other = _Quadratic(dim=4)
    with pytest.raises(CheckpointError, match="does not match the model"):
        fit(other, FitOptions(Schedule(lr=1e-2, total_steps=4), 1, execution=CPU, run_dir=tmp_path / "q", resume=True))


def test_train_package_exports_its_public_names_only():
    """``ropekit.train``'s namespace is the engine's API, and ``ropekit.classification``'s the task's; helpers live in
    the submodules. (The 24 names ``ropekit.train`` had before classification became a package of its own were its
    16 engine names, still here, and classification's 8 lazily imported ones, now ``ropekit.classification``'s.)"""
    import types

    import ropekit.classification as task
    import ropekit.train as package
    from ropekit.classification import config, evaluation, trainer

    for pkg in (package, task):
        names = {n for n, v in vars(pkg).items() if not n.startswith("_") and not isinstance(v, types.ModuleType)}
        assert names == set(pkg.__all__), pkg.__name__
    assert len(package.__all__) == 16 and len(task.__all__) == 12  # (with the 4 sections of TrainConfig)
    assert not set(package.__all__) & set(task.__all__)
    home = {n: m for m in (config, evaluation, trainer) for n in m.__all__}
    assert all(getattr(task, n) is getattr(home[n], n) for n in task.__all__)
    assert task.TrainConfig is config.TrainConfig and task.train is trainer.train
    assert package.build_optimizer is engine.build_optimizer
