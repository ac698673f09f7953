"""The ``ropekit`` command line: train / eval end to end, config precedence, one-line errors."""

import json
import subprocess
import sys

import pytest
import torch

from ropekit.cli import SUBCOMMANDS, available_subcommands, main, register_subcommand

TINY = ["--data", "digits", "--train-fraction", "0.1", "--model-opt", "embed_dim=24", "--model-opt", "depth=1",
        "--model-opt", "num_heads=1", "--epochs", "1", "--batch-size", "32", "--no-progress", "--no-tensorboard",
        "--threads", "1"]


def run_cli(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "run"
    assert main(["train", *TINY, "--pe", "mixed", "--out", str(out)]) == 0
    return out


def test_train_reports_accuracy_and_eval_prints_json(run_dir, capsys):
    capsys.readouterr()
    code, out, err = run_cli(capsys, "eval", str(run_dir), "--json")
    assert code == 0, err
    res = json.loads(out)
    assert 0.0 <= res["test_acc"] <= 1.0 and res["test_loss"] > 0 and res["pe"] == "mixed"
    code, out, _ = run_cli(capsys, "eval", str(run_dir), "--image-size", "12", "--offset-std", "2", "--json")
    res2 = json.loads(out)
    assert code == 0 and res2["image_size"] == [12, 12] and res2["offset_std"] == 2.0
    code, out, _ = run_cli(capsys, "eval", str(run_dir))
    assert code == 0 and out.startswith("test_acc ")


def test_config_file_then_command_line_overrides(tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("pe: axial\nepochs: 1\nlr: 0.004\npe_options: {base: 100.0}\n")
    out = tmp_path / "r"
    code, stdout, err = run_cli(capsys, "train", *TINY, "--config", str(cfg), "--lr", "0.002", "--out", str(out))
    assert code == 0, err
    assert "test accuracy" in stdout
    resolved = json.loads((out / "config.json").read_text())
    assert resolved["train"]["model"]["pe"] == "axial" and resolved["train"]["optim"]["lr"] == 0.002  # the command line wins
    assert resolved["model"]["pe_options"] == {"base": 100.0}
    # resume: the run folder's config is the base; more epochs continue the same run
    code, _, err = run_cli(capsys, "train", "--resume", str(out), "--epochs", "2", "--allow-change", "epochs",
                           "--no-progress")
    assert code == 0, err
    assert len((out / "metrics.csv").read_text().strip().splitlines()) == 3  # header + 2 epochs


@pytest.mark.parametrize("args, message", [
    (["train", "--pe", "rope9000"], "unknown position encoding 'rope9000'; known: none, axial"),
    (["train", "--data", "imagenet-21k"], "unknown dataset 'imagenet-21k'; known:"),
    (["train", "--data", "imagefolder", "--data-root", "/no/such/folder"], "not found: /no/such/folder"),
    (["train", "--config", "/no/such/config.yaml"], "config file not found"),
    (["train", *TINY, "--pe", "circulant", "--pe-opt", "block_size=5"], "block_size must divide head_dim=24"),
    (["train", *TINY, "--pe", "comrope-ap", "--pe-opt", "block_size=8"], "multiple of coord_dim"),
    (["train", *TINY, "--pe", "cayley", "--pe-opt", "wobble=1"], "unknown option(s) wobble"),
    (["train", *TINY, "--pe-opt", "block_size"], "expects KEY=VALUE"),
    (["train", *TINY, "--model", "huge"], "unknown model size 'huge'"),
    (["train", *TINY, "--set", "learning_rate=1"], "unknown option(s) learning_rate"),
    (["eval", "/no/such/run"], "run folder not found"),
    (["train", "--resume", "/no/such/run"], "run folder not found"),
])
def test_bad_input_gets_a_one_line_error(args, message, capsys, tmp_path):
    if "--resume" not in args and args[0] == "train":
        args = [*args, "--out", str(tmp_path / "x")]
    code, out, err = run_cli(capsys, *args)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ropekit {args[0]}: error: "), err
    assert message in lines[0]
    assert "Traceback" not in err


def test_corrupt_and_mismatched_checkpoints_get_one_line_errors(run_dir, tmp_path, capsys):
    import shutil

    corrupt = tmp_path / "corrupt"
    shutil.copytree(run_dir, corrupt)
    (corrupt / "checkpoint.pt").write_bytes(b"\x80\x02 this is not a checkpoint")
    code, _, err = run_cli(capsys, "eval", str(corrupt))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "corrupt" in err

    mismatched = tmp_path / "mismatched"
    shutil.copytree(run_dir, mismatched)
    ckpt = torch.load(mismatched / "checkpoint.pt", weights_only=True)
    ckpt["model"]["head.weight"] = torch.zeros(3, 7)
    torch.save(ckpt, mismatched / "checkpoint.pt")
    code, _, err = run_cli(capsys, "eval", str(mismatched))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "does not match the model" in err
    code, _, err = run_cli(capsys, "train", "--resume", str(mismatched), "--epochs", "2", "--allow-change", "epochs",
                           "--no-progress")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "does not match the model" in err

    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run_cli(capsys, "train", "--resume", str(empty))
    assert code == 2 and "no checkpoint" in err

    code, _, err = run_cli(capsys, "train", *TINY, "--out", str(run_dir))  # would overwrite a run
    assert code == 2 and "--resume" in err


@pytest.mark.slow
def test_console_script_error_has_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "ropekit.cli", "train", "--pe", "nope"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        proc.stderr.strip().splitlines()[0]] and "unknown position encoding 'nope'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_subcommand_registry_is_lazy_and_extensible(capsys):
    assert {"train", "eval"} <= set(available_subcommands())
    assert isinstance(SUBCOMMANDS["train"].run, str)  # "module:function", imported only when used
    seen = {}

    def add(p):
        p.add_argument("--n", type=int, default=1)

    def run(args):
        seen["n"] = args.n
        return 0

    register_subcommand("hello-test", add, run, help="a test subcommand")
    try:
        assert main(["hello-test", "--n", "3"]) == 0 and seen["n"] == 3
        assert "hello-test" in available_subcommands()
    finally:
        SUBCOMMANDS.pop("hello-test")
    assert main([]) == 2  # no subcommand: help on stderr
    assert "train" in capsys.readouterr().err
