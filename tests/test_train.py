"""ropekit.train: run folder outputs, exact resume, atomic checkpoints, DDP, evaluation."""

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from ropekit.nn import VisionTransformer, vit_config
from ropekit.train import CheckpointError, build_optimizer, load_checkpoint
from ropekit.classification import TrainConfig, evaluate_run, train
from ropekit.train.augment import random_shift
from ropekit.train.checkpoint import atomic_save, load_model_state

TINY = dict(embed_dim=24, depth=1, num_heads=1, mlp_ratio=2.0)


def tiny_cfg(out, **kw) -> TrainConfig:
    """digits (8x8), 10% of the training set (144 images, 5 steps of 32), a one-block width-24 ViT."""
    base = dict(data="digits", train_fraction=0.1, model_options=dict(TINY), batch_size=32, epochs=2, lr=3e-3,
                eval_batch_size=400, progress=False, tensorboard=False, threads=1, out=str(out), device="cpu")
    base.update(kw)
    return TrainConfig.from_dict(base)


def _state_equal(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


# ------------------------------------------------------------------------------------------------ a run folder


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "digits"
    result = train(tiny_cfg(out, tensorboard=True), quiet=True)
    assert not result.interrupted
    return out


def test_run_folder_holds_config_metrics_plot_and_checkpoint(run_dir):
    rows = _rows(run_dir / "metrics.csv")
    assert len(rows) == 2 and {"epoch", "train_loss", "test_loss", "test_acc"} <= set(rows[0])
    assert all(0.0 <= float(r["test_acc"]) <= 1.0 for r in rows)
    config = json.loads((run_dir / "config.json").read_text())
    assert config["train"]["data"]["name"] == "digits" and config["model"]["pe"] == "cayley"
    assert config["model"]["embed_dim"] == 24 and config["model"]["patch_size"] == 2
    assert (run_dir / "curves.png").stat().st_size > 1000
    assert any(p.name.startswith("events.out.tfevents") for p in (run_dir / "tb").iterdir())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["device"] == "cpu"  # where it trained: the studies' time columns name it
    # what decides its rounding (results differ across CPUs with other vector instruction sets)
    assert summary["machine"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert summary["machine"]["torch"] == torch.__version__ and summary["machine"]["threads"] >= 1
    assert summary["epochs_done"] == 2 and summary["test_acc"] == pytest.approx(float(rows[-1]["test_acc"]), abs=1e-6)
    ckpt = load_checkpoint(run_dir)
    assert ckpt["epoch"] == 2 and ckpt["step_in_epoch"] == 0 and len(ckpt["history"]) == 2
    assert not any(k.startswith("_") or "cache" in k for k in ckpt["model"])  # learnable state only


def test_existing_run_is_not_overwritten_without_resume(run_dir):
    with pytest.raises(ValueError, match="--resume"):
        train(tiny_cfg(run_dir), quiet=True)


def test_evaluate_run_offsets_and_resolution(run_dir):
    plain = evaluate_run(run_dir)
    shifted = evaluate_run(run_dir, offset_std=5.0, seed=3)  # mean pooling + Cayley-STRING: invariant
    assert shifted["test_acc"] == plain["test_acc"]
    assert shifted["test_loss"] == pytest.approx(plain["test_loss"], abs=1e-5)
    bigger = evaluate_run(run_dir, image_size=12)
    assert bigger["image_size"] == [12, 12] and 0.0 <= bigger["test_acc"] <= 1.0
    # a size the model's patches do not tile is refused as training refuses it (patches of 2 px here)
    with pytest.raises(ValueError, match=r"image size 13 is not a multiple of the model's patch size 2 .* use "
                                         r"--image-size 12 or 14$"):
        evaluate_run(run_dir, image_size=13)
    with pytest.raises(ValueError, match=r"the last 1 pixels would be cut off\): use --image-size 2$"):
        evaluate_run(run_dir, image_size=1)


def test_evaluate_run_with_resolution_scaling_equals_the_rescaled_spectrum(tmp_path):
    """`ropekit eval --image-size 16 --scaling pi` on a run trained at 8 px (4x4 patches): position interpolation with
    s = 2 is the model whose learned Cayley frequencies are halved, evaluated at 16 px as it is (the reference
    rescales the checkpoint's parameter; nothing of the scaling module is used)."""
    run_dir = tmp_path / "run"
    train(tiny_cfg(run_dir, train_fraction=0.5, epochs=3), quiet=True)  # a model whose logits depend on positions
    scaled = evaluate_run(run_dir, image_size=16, scaling="pi")
    assert scaled["scaling"] == "pi" and scaled["scale"] == [2.0, 2.0] and scaled["train_extent"] == [4.0, 4.0]
    ckpt = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    keys = [k for k in ckpt["model"] if k.endswith("freq_param")]
    assert keys
    for k in keys:
        ckpt["model"][k] = ckpt["model"][k] * 0.5
    torch.save(ckpt, tmp_path / "checkpoint.pt")
    ref = evaluate_run(tmp_path / "checkpoint.pt", image_size=16)
    assert scaled["test_acc"] == pytest.approx(ref["test_acc"], abs=1.0 / scaled["num_examples"])
    # halving a frequency is exact in floating point, so only the order of the angle products could differ
    assert scaled["test_loss"] == pytest.approx(ref["test_loss"], rel=1e-6)
    plain = evaluate_run(run_dir, image_size=16)  # without the scaling: a different model, by far more than 1e-6
    assert plain["scaling"] == "none" and abs(plain["test_loss"] - ref["test_loss"]) > 1e-4 * ref["test_loss"]
    # at or below the training size every method is the identity (s = max(1, g / L) = 1)
    same = evaluate_run(run_dir, scaling="yarn")
    assert same["scale"] == [1.0, 1.0] and same["test_loss"] == pytest.approx(evaluate_run(run_dir)["test_loss"],
                                                                              rel=1e-6)


def test_resolution_scaling_refuses_what_it_cannot_scale(tmp_path):
    from ropekit.classification.trainer import eval_scaling, training_extent
    from ropekit.nn import ViTConfig

    with pytest.raises(ValueError, match="unknown scaling method 'bogus'"):
        eval_scaling("bogus", ViTConfig(image_size=(8, 8), patch_size=2), tiny_cfg(tmp_path), 16)
    with pytest.raises(ValueError, match="normalized coordinates"):
        eval_scaling("pi", ViTConfig(coords="normalized"), tiny_cfg(tmp_path), 16)
    # a native-resolution run's extent: the side of a square at its largest token budget
    native = tiny_cfg(tmp_path, native_resolution=True, native_options={"seq_len": 100, "max_tokens": 64})
    assert training_extent(ViTConfig(patch_size=2), native) == (8.0, 8.0)
    rgbd = eval_scaling("yarn", ViTConfig(modality="rgbd", in_chans=4, pe="cayley", image_size=(8, 12), patch_size=2),
                        tiny_cfg(tmp_path), (16, 12))
    assert rgbd.scale == [2.0, 1.0, 1.0] and rgbd.train_extent == [4.0, 6.0, 1.0]  # (y, x, z): depth left as it is
    ape = tmp_path / "ape"
    train(tiny_cfg(ape, pe="absolute", epochs=1), quiet=True)
    with pytest.raises(ValueError, match=r"encoding \(absolute\) has none"):
        evaluate_run(ape, image_size=16, scaling="pi")
    with pytest.raises(ValueError, match=r"--offset-std shifts the coordinates .* \(pe absolute\) has none"):
        evaluate_run(ape, offset_std=2.0)  # (it reads no coordinates: the offset would be reported, not applied)


# ------------------------------------------------------------------------------------------------ resume


def test_resume_after_ctrl_c_equals_an_uninterrupted_run(tmp_path, ctrl_c_delivered):
    """Ctrl-C mid-epoch saves a checkpoint; --resume continues to bit-identical weights and metrics."""
    kw = dict(jitter=0.5, augment_shift=1, model_options=dict(TINY, drop_path_rate=0.2))  # every RNG consumer
    full = train(tiny_cfg(tmp_path / "full", **kw), quiet=True)

    def ctrl_c(step):
        if step == 3:  # mid-epoch 1 (5 steps per epoch)
            os.kill(os.getpid(), signal.SIGINT)

    part = train(tiny_cfg(tmp_path / "part", **kw), on_step=ctrl_c, quiet=True)
    assert part.interrupted and part.history == []
    ckpt = load_checkpoint(tmp_path / "part")
    assert (ckpt["epoch"], ckpt["step_in_epoch"]) == (0, 3)
    again = train(tiny_cfg(tmp_path / "part", **kw), on_step=lambda s: s == 7, resume=True, quiet=True)
    assert again.interrupted and len(again.history) == 1  # a second interruption, in epoch 2
    done = train(tiny_cfg(tmp_path / "part", **kw), resume=True, quiet=True)
    assert not done.interrupted
    assert _state_equal(full.model, done.model)
    a, b = _rows(tmp_path / "full" / "metrics.csv"), _rows(tmp_path / "part" / "metrics.csv")
    assert len(a) == len(b) == 2
    for ra, rb in zip(a, b):
        for k in ("epoch", "train_loss", "train_acc", "test_loss", "test_acc", "lr"):
            assert ra[k] == rb[k], k


def test_resume_with_more_epochs_continues_from_the_checkpoint(tmp_path):
    first = train(tiny_cfg(tmp_path / "r", epochs=1), quiet=True)
    with pytest.raises(ValueError, match=r"epochs 1 -> 2.*--allow-change epochs"):
        train(tiny_cfg(tmp_path / "r", epochs=2), resume=True, quiet=True)
    more = train(tiny_cfg(tmp_path / "r", epochs=2), resume=True, quiet=True, allow_change=("epochs",))
    assert [r["epoch"] for r in more.history] == [1, 2]
    assert more.history[0] == first.history[0]
    config = json.loads((tmp_path / "r" / "config.json").read_text())
    assert config["train"]["optim"]["epochs"] == 2 and config["resumes"][0]["changed"] == {"epochs": [1, 2]}
    assert "stretched" in config["resumes"][0]["schedule"]


# ------------------------------------------------------------------------------------------------ checkpoints


def _ckpt(value):
    return {"format": "ropekit-checkpoint", "version": 1, "model": {"w": torch.full((4,), float(value))}}


def test_crash_while_writing_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    atomic_save(_ckpt(1), path)

    def crashing_save(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError("simulated crash mid-write")

    monkeypatch.setattr(torch, "save", crashing_save)
    with pytest.raises(OSError, match="mid-write"):
        atomic_save(_ckpt(2), path)
    monkeypatch.undo()
    assert torch.equal(load_checkpoint(path)["model"]["w"], torch.ones(4))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]  # temp file cleaned up


@pytest.mark.slow
def test_process_killed_while_writing_keeps_the_previous_checkpoint(tmp_path):
    """A process that dies mid-write (no cleanup at all) leaves the old checkpoint intact and loadable."""
    path = tmp_path / "checkpoint.pt"
    atomic_save(_ckpt(1), path)
    script = textwrap.dedent(f"""
        import os, torch
        from ropekit.train.checkpoint import atomic_save
        def dying_save(obj, f, *a, **k):
            f.write(b"PK\\x03\\x04 partial")
            f.flush()
            os._exit(9)
        torch.save = dying_save
        atomic_save({{"format": "ropekit-checkpoint", "version": 1, "model": {{}}}}, {str(path)!r})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True)
    assert proc.returncode == 9
    assert any(p.name.startswith(".checkpoint.pt.tmp") for p in tmp_path.iterdir())  # the torn temp file
    assert torch.equal(load_checkpoint(path)["model"]["w"], torch.ones(4))
    atomic_save(_ckpt(3), path)  # and the next save still works
    assert torch.equal(load_checkpoint(path)["model"]["w"], torch.full((4,), 3.0))


def test_corrupt_truncated_and_mismatched_checkpoints_raise_one_line_errors(tmp_path, run_dir):
    bad = tmp_path / "garbage.pt"
    bad.write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(bad)
    data = (run_dir / "checkpoint.pt").read_bytes()
    cut = tmp_path / "cut.pt"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt") as e:
        load_checkpoint(cut)
    assert "\n" not in str(e.value)
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_checkpoint(tmp_path / "missing")
    other = VisionTransformer(vit_config("tiny", embed_dim=48, depth=1, num_heads=1, image_size=(8, 8)))
    with pytest.raises(CheckpointError, match="does not match the model") as e:
        load_model_state(other, load_checkpoint(run_dir)["model"])
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------------ optimisation


def test_optimizer_excludes_encodings_norms_and_biases_from_weight_decay():
    model = VisionTransformer(vit_config("tiny", pe="cayley", depth=2, cls="centroid", ape="learned"))
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.1)
    decay, no_decay = ({id(p) for p in g["params"]} for g in opt.param_groups)
    assert opt.param_groups[0]["weight_decay"] == 0.1 and opt.param_groups[1]["weight_decay"] == 0.0
    pe = model.encodings[0]
    assert {id(pe.freq_param), id(pe.cayley_params), id(model.cls_token), id(model.ape.table)} <= no_decay
    assert id(model.blocks[0].norm1.weight) in no_decay and id(model.blocks[0].attn.qkv.bias) in no_decay
    assert id(model.blocks[0].attn.qkv.weight) in decay
    assert len(decay) + len(no_decay) == len(list(model.parameters()))  # the shared encoding counted once


def test_random_shift_moves_whole_images_and_clips():
    torch.manual_seed(0)
    x = torch.zeros(16, 1, 6, 6)
    x[:, :, 2:4, 2:4] = 1
    y = random_shift(x, 2)
    assert y.shape == x.shape and torch.all(y.sum(dim=(1, 2, 3)) == 4)
    v = torch.rand(2, 1, 3, 6, 6)
    assert random_shift(v, 1).shape == v.shape and random_shift(v, 0) is v


# ------------------------------------------------------------------------------------------------ DDP


@pytest.mark.slow
def test_ddp_two_processes_match_one_process(tmp_path):
    """torchrun --nproc_per_node 2 (gloo): same files, and the same weights as one process with the same global
    batch (no augmentation, so both see the same batches)."""
    if not torch.distributed.is_available() or shutil.which("torchrun") is None:
        pytest.skip("torch.distributed / torchrun not available")
    args = ["--data", "digits", "--train-fraction", "0.1", "--model-opt", "embed_dim=24", "--model-opt", "depth=1",
            "--model-opt", "num_heads=1", "--batch-size", "32", "--lr", "1e-3", "--epochs", "1", "--augment-shift", "0",
            "--no-progress", "--no-tensorboard"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(["torchrun", "--standalone", "--nproc_per_node", "2", "-m", "ropekit.cli", "train", *args,
                           "--device", "cpu",
                           "--out", str(tmp_path / "ddp")], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("test accuracy") == 1  # rank 0 reports
    config = json.loads((tmp_path / "ddp" / "config.json").read_text())
    assert config["world_size"] == 2
    assert len(_rows(tmp_path / "ddp" / "metrics.csv")) == 1
    ddp = load_checkpoint(tmp_path / "ddp")
    assert len(ddp["rng"]) == 2  # every rank's RNG state, for an exact resume
    single = train(tiny_cfg(tmp_path / "one", epochs=1, augment_shift=0, lr=1e-3), quiet=True)
    # Gradients agree to rounding; Adam turns rounding in near-zero gradients into sign flips of one step (lr).
    for k, v in single.model.state_dict().items():
        assert torch.allclose(ddp["model"][k], v, atol=2e-3), k
    for k in ("train_loss", "test_loss"):
        assert ddp["history"][0][k] == pytest.approx(single.history[0][k], abs=1e-3), k
