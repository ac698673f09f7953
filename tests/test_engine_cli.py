"""``ropekit train`` with bad input and faults: one line on stderr, exit code 2, nothing lost."""

import errno
import json

import pytest
import torch

from ropekit.cli import main
from ropekit.train import load_checkpoint
from ropekit.classification import TrainConfig, evaluate_run
from ropekit.classification import config as config_module
from ropekit.train import upgrade as upgrade_module
from ropekit.train.upgrade import flatten
from ropekit.train import engine
from ropekit.classification import trainer

TINY = ["--data", "digits", "--train-fraction", "0.1", "--model-opt", "embed_dim=24", "--model-opt", "depth=1",
        "--model-opt", "num_heads=1", "--epochs", "1", "--batch-size", "32", "--no-progress", "--no-tensorboard",
        "--threads", "1", "--device", "cpu"]


def run_cli(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code, err, message):
    """Exit 2 and the error in one line, the last on stderr (after the run's own log lines, if it started)."""
    lines = err.strip().splitlines()
    assert code == 2, err
    assert "Traceback" not in err and sum("error:" in line for line in lines) == 1, err
    assert lines[-1].startswith("ropekit train: error: "), err
    assert message in lines[-1], lines[-1]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 2-epoch run."""
    out = tmp_path_factory.mktemp("engine-cli") / "run"
    assert main(["train", *TINY, "--epochs", "2", "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize("args, message", [
    (["--pe", "circulant", "--pe-opt", "block_size=abc"], "--pe-opt: block_size must be an integer or null, got 'abc'"),
    (["--model-opt", "embed_dim=abc"], "--model-opt: embed_dim must be an integer, got 'abc'"),
    (["--label-smoothing", "2"], "label_smoothing must be in [0, 1), got 2.0"),
    (["--lr", "inf"], "lr must be a positive finite number, got inf"),
    (["--weight-decay", "-1"], "weight_decay must be a finite number >= 0, got -1.0"),
    (["--warmup-epochs", "-3"], "warmup_epochs must be a finite number >= 0, got -3.0"),
    (["--grad-clip", "nan"], "grad_clip must be a finite number >= 0, got nan"),
    (["--image-size", "10", "--patch-size", "4"], "image size 10 is not a multiple of the patch size 4"),
    (["--image-size", "3", "--patch-size", "4"], "the last 3 pixels would be cut off): use --image-size 4, or a patch "
                                                "size that divides 3 (3)"),
    (["--set", "seed=two"], "seed must be an integer, got 'two'"),
    (["--precision", "bf16", "--compile", "maybe"], "unknown torch.compile backend 'maybe'; known:"),
    (["--set", "compile=3"], "compile must be true or false or a string, got 3"),
])
def test_bad_option_values_are_refused_before_data_loads(args, message, capsys, tmp_path, no_data):
    code, _, err = run_cli(capsys, "train", *TINY, *args, "--out", str(tmp_path / "x"))
    one_line_error(code, err, message)
    assert not (tmp_path / "x").exists()  # nothing left behind


def test_yaml_value_of_the_wrong_type(capsys, tmp_path, no_data):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("lr: fast\n")
    code, _, err = run_cli(capsys, "train", *TINY, "--config", str(cfg), "--out", str(tmp_path / "x"))
    one_line_error(code, err, "lr must be a number, got 'fast'")


def test_cuda_without_a_gpu(capsys, tmp_path, monkeypatch, no_data):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    code, _, err = run_cli(capsys, "train", *TINY, "--device", "cuda", "--out", str(tmp_path / "x"))
    one_line_error(code, err, "--device cuda: no CUDA GPU is available on this machine; use --device cpu")


def test_more_processes_than_gpus(monkeypatch):
    from ropekit.train.distributed import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"2 processes per machine but only 1 GPU\(s\).*--device cpu"):
        resolve_device("auto", world_size=2, local_rank=1)
    with pytest.raises(ValueError, match="this machine has 1 GPU"):
        resolve_device("cuda:3")
    assert resolve_device("cpu", world_size=2, local_rank=1) == torch.device("cpu")


def test_auto_patch_size_that_does_not_divide_warns():
    info = type("Info", (), dict(image_size=(30, 30), num_classes=10, in_chans=1, kind="image"))()
    with pytest.warns(UserWarning, match=r"not a multiple of the automatic patch size 4: the model uses the "
                                         r"top-left 28x28 pixels"):
        config_module.build_vit_config(TrainConfig(), info)
    with pytest.raises(ValueError, match="not a multiple of the patch size 7"):
        config_module.build_vit_config(TrainConfig.from_dict(dict(patch_size=7)), info)


# ------------------------------------------------------------------------------------------------ resume


def test_resume_with_other_options_is_refused_and_lists_them(finished, capsys):
    before = (finished / "checkpoint.pt").read_bytes()
    code, _, err = run_cli(capsys, "train", "--resume", str(finished), "--seed", "7", "--lr", "0.01")
    one_line_error(code, err, "options differ from the run's: lr 0.001 -> 0.01; seed 0 -> 7")
    assert "seed cannot change" in err or "lr, seed cannot change" in err
    code, _, err = run_cli(capsys, "train", "--resume", str(finished), "--lr", "0.01", "--allow-change", "lr")
    one_line_error(code, err, "--allow-change: lr cannot change when resuming")
    assert (finished / "checkpoint.pt").read_bytes() == before


def test_resume_a_finished_run_with_more_epochs(finished, capsys, tmp_path):
    import shutil

    run = tmp_path / "more"
    shutil.copytree(finished, run)
    code, _, err = run_cli(capsys, "train", "--resume", str(run), "--epochs", "3", "--no-progress")
    one_line_error(code, err, "epochs 2 -> 3")
    assert "--allow-change epochs" in err
    code, out, err = run_cli(capsys, "train", "--resume", str(run), "--epochs", "3", "--allow-change", "epochs",
                             "--no-progress")
    assert code == 0, err
    assert "cosine decay stretched from 10 to 15 steps" in err  # the schedule effect, said
    config = json.loads((run / "config.json").read_text())
    assert config["train"]["optim"]["epochs"] == 3  # what really ran
    assert config["resumes"][-1]["changed"] == {"epochs": [2, 3]} and config["resumes"][-1]["global_step"] == 10
    rows = (run / "metrics.csv").read_text().strip().splitlines()
    assert len(rows) == 4
    # epoch 3 restarts half-way down the stretched cosine, not at the floor the finished run had reached
    assert "the learning rate at step 11 is 0.000505 instead of 1e-05" in err
    assert rows[1:3] == (finished / "metrics.csv").read_text().strip().splitlines()[1:3]
    code, _, err = run_cli(capsys, "train", "--resume", str(run), "--epochs", "1", "--allow-change", "epochs")
    one_line_error(code, err, "--epochs 1: the run has already done 3 epochs")


# ------------------------------------------------------------------------------------------------ faults


def test_second_run_into_the_same_folder_refuses_at_once(capsys, tmp_path, no_data):
    run = tmp_path / "busy"
    with engine.RunLock(run):
        import subprocess
        import sys

        proc = subprocess.run([sys.executable, "-m", "ropekit.cli", "train", *TINY, "--out", str(run)],
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "is being written by another run" in lines[0], proc.stderr


def test_disk_full_or_read_only_is_one_line_and_keeps_the_checkpoint(capsys, tmp_path, monkeypatch):
    run = tmp_path / "full"
    assert main(["train", *TINY, "--out", str(run)]) == 0
    before = (run / "checkpoint.pt").read_bytes()

    def no_space(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(engine, "atomic_save", no_space)
    capsys.readouterr()
    code, _, err = run_cli(capsys, "train", "--resume", str(run), "--epochs", "2", "--allow-change", "epochs")
    one_line_error(code, err, "could not write the checkpoint")
    assert "No space left on device (disk full?); the previous checkpoint is intact" in err
    assert (run / "checkpoint.pt").read_bytes() == before
    assert load_checkpoint(run)["epoch"] == 1

    def read_only(*a, **k):
        raise PermissionError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(engine, "atomic_save", read_only)
    code, _, err = run_cli(capsys, "train", "--resume", str(run), "--epochs", "2", "--allow-change", "epochs")
    one_line_error(code, err, "Read-only file system; the previous checkpoint is intact")
    assert (run / "checkpoint.pt").read_bytes() == before


def test_non_finite_loss_from_the_command_line(capsys, tmp_path):
    code, _, err = run_cli(capsys, "train", *TINY, "--lr", "1e30", "--warmup-epochs", "0", "--out",
                           str(tmp_path / "nan"))
    one_line_error(code, err, "non-finite loss")
    assert "at step" in err


# ------------------------------------------------------------------------------------------------ run folders


def test_run_folder_records_versions(finished):
    config = json.loads((finished / "config.json").read_text())
    import ropekit

    assert config["versions"]["ropekit"] == ropekit.__version__ and config["versions"]["torch"] == torch.__version__
    assert "git" in config["versions"]
    assert config["engine"]["precision"] == "fp32"


def test_a_run_recorded_flat_resumes_and_is_rewritten_nested(finished, capsys, tmp_path):
    """A run folder of a version that recorded the flat ``TrainConfig`` fields (config.json and checkpoint, without
    the fields added since) resumes through the converter as the same run; the resumed run records the nested form."""
    import shutil

    from ropekit.train.upgrade import ADDED

    run = tmp_path / "flat"
    shutil.copytree(finished, run)
    config = json.loads((run / "config.json").read_text())
    flat = {k: v for k, v in flatten(config["train"]).items() if k not in ADDED}
    config["train"] = flat
    (run / "config.json").write_text(json.dumps(config))
    ckpt = torch.load(run / "checkpoint.pt", weights_only=True)
    ckpt["train_config"] = flat
    torch.save(ckpt, run / "checkpoint.pt")
    code, _, err = run_cli(capsys, "train", "--resume", str(run), "--epochs", "3", "--allow-change", "epochs",
                           "--no-progress")
    assert code == 0, err
    config = json.loads((run / "config.json").read_text())
    assert set(config["train"]) == {"model", "data", "optim", "run"}
    assert config["train"]["optim"]["epochs"] == 3 and config["resumes"][-1]["changed"] == {"epochs": [2, 3]}
    assert flatten(config["train"]) == {**flatten(TrainConfig.from_dict(flat, strict=False).to_nested()), "epochs": 3,
                                        "out": str(run)}


def test_unknown_keys_warn_and_renamed_keys_map(finished, tmp_path, monkeypatch):
    import shutil

    run = tmp_path / "old"
    shutil.copytree(finished, run)
    config = json.loads((run / "config.json").read_text())
    config["train"] = flatten(config["train"])  # a run of a version that wrote the flat form
    config["train"]["future_option"] = 3
    config["train"]["learning_rate"] = config["train"].pop("lr")  # as if lr had once been called learning_rate
    (run / "config.json").write_text(json.dumps(config))
    monkeypatch.setitem(upgrade_module.RENAMED, "learning_rate", "lr")  # (the one converter's table)
    with pytest.warns(UserWarning, match="ignoring unknown option.*future_option"):
        res = evaluate_run(run, device="cpu")
    assert 0.0 <= res["test_acc"] <= 1.0
    with pytest.warns(UserWarning, match="future_option"):
        cfg = TrainConfig.from_dict(config["train"], source="config.json", strict=False)
    assert cfg.optim.lr == 1e-3
    with pytest.raises(ValueError, match="unknown option.*future_option"):  # the user's own options stay strict
        TrainConfig.from_dict(config["train"], source="options")
