"""The command line and data paths as a user meets them: runs that travel, one spelling per setting, bad
data that costs no run, no silent data change, results never overwritten, conventions users know.

Each case runs the command as a user would -- ``ropekit.cli.main`` in a temporary working directory, and where the
working directory matters, again from another one (in-process and as a subprocess) -- on a tiny image folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from ropekit.cli import main
from ropekit.train import engine
from ropekit.classification import trainer
from ropekit.classification import evaluation

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model-opt", "embed_dim=16", "--model-opt", "depth=1", "--model-opt", "num_heads=1", "--epochs", "1",
        "--batch-size", "4", "--no-progress", "--no-tensorboard", "--threads", "1", "--device", "cpu"]


def make_folder(root: Path, classes=("a", "b"), n: int = 10, size=(32, 32), bad: dict = None) -> Path:
    """``root/<class>/<i>.png``: ``n`` random RGB images per class of ``size`` (H, W); ``bad``: class -> number of
    files that are not images (``x<i>.png``)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in classes:
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(root / c / f"{i}.png")
        for i in range((bad or {}).get(c, 0)):
            (root / c / f"x{i}.png").write_bytes(b"not an image")
    return root


def run_cli(capsys, *args):
    try:
        code = main(list(args))
    except SystemExit as e:  # (argparse's own exit: usage errors and --help)
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code, err, message, prog="ropekit train"):
    """Exit 2, one error line, the last on stderr, holding ``message``; no traceback."""
    lines = err.strip().splitlines()
    assert code == 2, err
    assert "Traceback" not in err and sum("error:" in line for line in lines) == 1, err
    assert lines[-1].startswith(f"{prog}: error: "), err
    assert message in lines[-1], lines[-1]
    return lines[-1]


def subprocess_cli(args, cwd):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "ropekit.cli", *args], cwd=cwd, capture_output=True, text=True,
                          env=env, timeout=300)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished one-epoch run on ``demo/`` (2 classes), started with relative paths in ``work/``."""
    base = tmp_path_factory.mktemp("paths")
    work = base / "work"
    make_folder(work / "demo")
    cwd = os.getcwd()
    os.chdir(work)
    try:
        assert main(["train", "--data", "imagefolder", "--data-root", "demo", *TINY, "--out", "run"]) == 0
    finally:
        os.chdir(cwd)
    return base


# ------------------------------------------------------------------------------------------------ 1. runs travel


def test_the_run_folder_records_the_absolute_data_path_and_evaluates_from_anywhere(trained, capsys, monkeypatch):
    run = trained / "work" / "run"
    config = json.loads((run / "config.json").read_text())
    assert config["train"]["data"]["data_root"] == str((trained / "work" / "demo").resolve())
    assert config["data"]["class_names"] == ["a", "b"]
    elsewhere = trained / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    monkeypatch.chdir(elsewhere)
    code, out, err = run_cli(capsys, "eval", "../work/run", "--json", "--device", "cpu")
    assert code == 0, err
    res = json.loads(out)
    assert res["num_examples"] == 4 and res["image_size"] == [32, 32]  # the run's test split, at the run's size
    proc = subprocess_cli(["eval", str(run), "--device", "cpu"], cwd=elsewhere)  # a fresh process elsewhere
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("test_acc ") and "4 examples" in proc.stdout


def test_eval_on_another_folder_and_mismatches_refused(trained, capsys, monkeypatch):
    run = trained / "work" / "run"
    monkeypatch.chdir(trained)
    held = make_folder(trained / "held", n=3, size=(48, 40))
    code, out, err = run_cli(capsys, "eval", str(run), "--data-root", "held", "--json", "--device", "cpu")
    assert code == 0, err
    res = json.loads(out)
    assert res["num_examples"] == 6 and res["data_root"] == str(held.resolve())  # every image of the folder
    assert res["image_size"] == [32, 32]  # the model's size, not the folder's
    make_folder(trained / "three", classes=("a", "b", "c"), n=2)
    code, _, err = run_cli(capsys, "eval", str(run), "--data-dir", "three", "--device", "cpu")
    one_line_error(code, err, "has 3 classes; the run's model was trained on 2", "ropekit eval")
    make_folder(trained / "renamed", classes=("a", "cat"), n=2)
    code, _, err = run_cli(capsys, "eval", str(run), "--data-root", "renamed", "--device", "cpu")
    one_line_error(code, err, "its classes differ from the run's ('cat' where the run had 'b')", "ropekit eval")
    from ropekit.data import DatasetInfo
    from ropekit.nn import ViTConfig

    with pytest.raises(ValueError, match="has 1-channel images; the run's model takes 3"):
        evaluation._check_same_task(DatasetInfo("x", 2, 1, (32, 32), "image"), ViTConfig(num_classes=2, in_chans=3),
                                 {}, trainer.TrainConfig.from_dict(dict(data="digits")))


def test_resume_names_a_folder_or_its_checkpoint_and_a_finished_run_says_so(trained, capsys, monkeypatch):
    run = trained / "work" / "run"
    before = (run / "checkpoint.pt").read_bytes()
    monkeypatch.chdir(trained)
    for target in (str(run), str(run / "checkpoint.pt"), "work/run/checkpoint.pt"):
        code, out, err = run_cli(capsys, "train", "--resume", target)
        assert code == 0, err
        assert "already finished (1 epoch of 1" in err and "--epochs 2 --allow-change epochs" in err, err
        assert "epoch 1/1" not in err  # nothing re-evaluated or re-run
    assert (run / "checkpoint.pt").read_bytes() == before
    assert not (run / ".lock").exists()
    code, _, err = run_cli(capsys, "train", "--resume", str(run / "config.json"))
    one_line_error(code, err, "a run continues from its folder's latest checkpoint.pt")
    code, _, err = run_cli(capsys, "eval", str(run / "config.json"))
    one_line_error(code, err, "is a file of the run, not a checkpoint: give the run folder", "ropekit eval")


def test_no_lock_is_left_on_any_exit(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_folder(tmp_path / "demo", n=4)
    assert main(["train", "--data", "imagefolder", "--data-root", "demo", *TINY, "--out", "ok"]) == 0
    assert not (tmp_path / "ok" / ".lock").exists()
    with engine.RunLock(tmp_path / "busy"):
        proc = subprocess_cli(["train", "--data", "imagefolder", "--data-root", "demo", *TINY, "--out", "busy"],
                              cwd=tmp_path)
        assert proc.returncode == 2 and "being written by another run" in proc.stderr
        assert (tmp_path / "busy" / ".lock").exists()  # (ours, still held)
    assert not (tmp_path / "busy" / ".lock").exists()


# ------------------------------------------------------------------------------------------------ 2. one spelling


@pytest.mark.parametrize("args, message", [
    (["--set", "lr=0.01", "--lr", "0.002"], "--set lr=0.01 conflicts with --lr 0.002; give lr once"),
    (["--lr", "0.002", "--set", "lr=0.01"], "--set lr=0.01 conflicts with --lr 0.002; give lr once"),
    (["--per-head", "--pe-opt", "per_head=false"], "--pe-opt per_head: per-head encoding parameters are asked "
                                                   "with --per-head"),
    (["--pe-sharing", "head", "--set", "per_head=false"], "--pe-sharing head means per-head parameters, but "
                                                          "--set per_head=false says not"),
    (["--model-opt", "pe_sharing=model"], "--model-opt pe_sharing: pe_sharing is set with --pe-sharing"),
    (["--set", "pe_options={block_size: 4}", "--pe-opt", "block_size=8"], "--pe-opt block_size=8 conflicts with "
                                                                          "--set pe_options="),
    (["--data", "imagefolder", "--data-opt", "mode=L"], "unknown option(s) mode of streamed data"),
])
def test_one_setting_two_values_is_refused_naming_both(args, message, capsys, tmp_path, no_data):
    make_folder(tmp_path / "demo", n=2)
    code, _, err = run_cli(capsys, "train", "--data-root", str(tmp_path / "demo"), *TINY, *args,
                           "--out", str(tmp_path / "x"))
    one_line_error(code, err, message)
    assert not (tmp_path / "x").exists()


def test_precedence_and_the_one_value_of_each_setting(tmp_path):
    from ropekit.cli import build_parser
    from ropekit.train.commands import config_from_args

    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("lr: 0.1\nweight_decay: 0.2\n")

    def resolve(*argv):
        return config_from_args(build_parser("train").parse_args(["train", *argv]))[0]

    cfg = resolve("--config", str(cfg_file), "--lr", "0.002", "--set", "lr=0.002")  # the same value twice: fine
    assert (cfg.optim.lr, cfg.optim.weight_decay) == (0.002,
                                                      0.2)  # command line over the file, the file over the defaults
    cfg = resolve("--pe-sharing", "head", "--per-head")  # the short form and the flag agree: accepted
    assert (cfg.model.vit().pe_sharing, cfg.model.vit().per_head) == ("head", True)
    cfg = resolve("--data", "folder-stream", "--data-dir", str(tmp_path), "--img-size", "48", "--output", "o")
    assert (cfg.data.name, cfg.data.data_root, cfg.data.image_size, cfg.run.out) == ("imagefolder",
                                                                                     str(tmp_path.resolve()), 48, "o")


def test_one_folder_reader_streams_with_one_image_size_policy(tmp_path):
    from ropekit.data.streaming import ImageFolderStream

    small = make_folder(tmp_path / "small", n=3, size=(64, 64))
    large = make_folder(tmp_path / "large", n=3, size=(250, 300))
    for name in ("imagefolder", "folder-stream"):
        cfg = trainer.TrainConfig.from_dict(dict(data=name, data_root=str(small)))
        assert cfg.data.name == "imagefolder"
        train_ds, test_ds, info = trainer.load_data(cfg)
        assert isinstance(train_ds, ImageFolderStream) and isinstance(test_ds, ImageFolderStream)  # not in memory
        assert tuple(info.image_size) == (64, 64)  # the first image's size
        x, _ = train_ds[0]
        assert x.shape == (3, 64, 64)
    assert trainer.default_image_size(trainer.TrainConfig.from_dict(dict(data="imagefolder",
                                                                         data_root=str(large)))) == (224, 224)
    cfg = trainer.TrainConfig.from_dict(dict(data="imagefolder", data_root=str(large), image_size=32,
                                             train_fraction=0.5))
    train_ds, _, info = trainer.load_data(cfg)
    assert tuple(info.image_size) == (32, 32) and len(train_ds) == 2  # half of each class's 2 training images


def test_help_says_what_the_code_does(capsys):
    from ropekit.classification.config import auto_patch_size

    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "a power of two, 16 from 112 px on the shorter side, 8 from 56, 4 from 16 (32 px -> 4, 64 -> 8, " \
           "224 -> 16)" in text
    for side in range(16, 1000):
        assert auto_patch_size((side, side)) == (16 if side >= 112 else 8 if side >= 56 else 4)
    assert "folder of user data (imagefolder, shards, cifar10" in text and "--data-dir" in text
    assert "--img-size" in text and "--output" in text and "--allow-data-change" in text


def test_the_start_line_states_the_model_and_data(trained):
    log = (trained / "work" / "run" / "config.json")  # (the line itself is checked in the skip test below)
    model = json.loads(log.read_text())["model"]
    assert model["patch_size"] == 4 and model["image_size"] == [32, 32]


# ------------------------------------------------------------------------------------------------ 3. bad data


def test_a_bad_image_is_one_line_naming_it_and_leaves_no_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_folder(tmp_path / "bad", bad={"b": 1})
    code, _, err = run_cli(capsys, "train", "--data", "imagefolder", "--data-root", "bad", *TINY, "--out", "r")
    line = one_line_error(code, err, str((tmp_path / "bad" / "b" / "x0.png").resolve()))
    assert "BytesIO" not in line and " object at 0x" not in line
    assert "--data-opt skip_corrupt=true" in line
    assert not (tmp_path / "r").exists()  # failed before its first checkpoint: nothing half-made


def test_skipped_files_are_counted_per_split(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # 2 x (9 images + 1 bad): the split puts 2 of each class in the test set, 16 in training = 4 full batches
    make_folder(tmp_path / "bad", n=9, bad={"a": 1, "b": 1})
    code, out, err = run_cli(capsys, "train", "--data", "imagefolder", "--data-root", "bad", *TINY, "--epochs", "2",
                             "--data-opt", "skip_corrupt=true", "--out", "r")
    assert code == 0, err
    start = err.splitlines()[0]
    assert "imagefolder " + str((tmp_path / "bad").resolve()) in start
    assert "32x32 px (default), patch 4, 64 tokens/image" in start and "pe=cayley (layer)" in start
    import csv

    with open(tmp_path / "r" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2
    for row in rows:  # every epoch reads every file once: both bad ones are counted, in the split that holds them
        assert int(row["train_skipped"]) + int(row["test_skipped"]) == 2
        assert row["train_skipped"] == rows[0]["train_skipped"]
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["skipped"] == {"train": 2 * int(rows[0]["train_skipped"]), "test": int(rows[-1]["test_skipped"])}
    lines = [x for x in err.splitlines() if x.startswith("epoch ")]
    if int(rows[0]["train_skipped"]):
        assert all(f"skipped unreadable: {rows[0]['train_skipped']} train" in x for x in lines), err
    assert "UserWarning" not in err


def _tamper_label(shards: Path, new: bytes) -> str:
    """Rewrite the first sample's ``.cls`` of the first training shard; returns ``<shard>[<key>]``."""
    tar = sorted(shards.glob("train-*.tar"))[0]
    with tarfile.open(tar) as t:
        members = [(m, t.extractfile(m).read()) for m in t.getmembers()]
    key = next(m.name for m, _ in members if m.name.endswith(".cls")).rsplit(".", 1)[0]
    with tarfile.open(tar, "w") as t:
        for m, data in members:
            if m.name == f"{key}.cls":
                data = new
                m.size = len(data)
            import io

            t.addfile(m, io.BytesIO(data))
    return f"{tar}[{key}]"


@pytest.mark.parametrize("label, message", [(b"99", "label 99 (.cls) is outside 0..1 (the manifest names 2 classes)"),
                                            (b"-1", "label -1 (.cls) is outside 0..1"),
                                            (b"cat", "label entry .cls is not an integer: b'cat'")])
def test_shard_labels_are_checked_by_data_check_and_the_reader(label, message, tmp_path, capsys):
    make_folder(tmp_path / "f", n=6)
    assert main(["data", "convert", str(tmp_path / "f"), str(tmp_path / "s"), "--shard-size", "100"]) == 0
    where = _tamper_label(tmp_path / "s", label)
    capsys.readouterr()
    code = main(["data", "check", str(tmp_path / "s"), "--json", "--no-progress"])
    rec = json.loads(capsys.readouterr().out)
    assert code == 1 and len(rec["bad"]) == 1 and rec["bad"][0].startswith(f"{where}: {message}")
    code, _, err = run_cli(capsys, "train", "--data", "shards", "--data-root", str(tmp_path / "s"), *TINY,
                           "--image-size", "32", "--batch-size", "2", "--out", str(tmp_path / "r"))
    one_line_error(code, err, f"{where}: {message}")
    assert not (tmp_path / "r").exists()


# ------------------------------------------------------------------------------------------------ 4. no silent change


def test_resume_refuses_changed_data_unless_told(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_folder(tmp_path / "d", n=10)
    assert main(["train", "--data", "imagefolder", "--data-root", "d", *TINY, "--out", "r"]) == 0
    config = json.loads((tmp_path / "r" / "config.json").read_text())
    fp = config["data"]["fingerprint"]
    assert len(fp) == 64 and (config["data"]["num_train"], config["data"]["num_test"]) == (16, 4)
    (tmp_path / "d" / "a" / "3.png").unlink()
    before = (tmp_path / "r" / "checkpoint.pt").read_bytes()
    more = ["--resume", "r", "--epochs", "2", "--allow-change", "epochs", "--no-progress"]
    code, _, err = run_cli(capsys, "train", *more)
    one_line_error(code, err, "the data changed since the run started (16 -> 15 training, 4 -> 4 test images)")
    assert "--allow-data-change" in err
    assert (tmp_path / "r" / "checkpoint.pt").read_bytes() == before
    code, _, err = run_cli(capsys, "train", *more, "--allow-data-change")
    assert code == 0, err
    config = json.loads((tmp_path / "r" / "config.json").read_text())
    changed = config["resumes"][-1]["data_changed"]
    assert changed["fingerprint"][0] == fp and changed["fingerprint"][1] != fp and changed["num_train"] == 15
    code, _, err = run_cli(capsys, "train", "--data", "imagefolder", "--data-root", "d", *TINY, "--out", "n",
                           "--allow-data-change")
    one_line_error(code, err, "--allow-data-change only applies with --resume")


def test_same_files_same_fingerprint_any_change_another(tmp_path):
    make_folder(tmp_path / "d", n=5)
    cfg = trainer.TrainConfig.from_dict(dict(data="imagefolder", data_root=str(tmp_path / "d")))
    fp = trainer.data_fingerprint(*trainer.load_data(cfg)[:2])
    assert fp == trainer.data_fingerprint(*trainer.load_data(cfg)[:2])
    assert fp != trainer.data_fingerprint(*trainer.load_data(cfg.replace(split_seed=1))[:2])  # another split
    with open(tmp_path / "d" / "a" / "0.png", "ab") as f:  # one file grows by a byte
        f.write(b"\0")
    assert fp != trainer.data_fingerprint(*trainer.load_data(cfg)[:2])
    a = trainer.load_data(trainer.TrainConfig.from_dict(dict(data="digits")))
    assert trainer.data_fingerprint(*a[:2]) == trainer.data_fingerprint(*trainer.load_data(
        trainer.TrainConfig.from_dict(dict(data="digits")))[:2])


def test_a_failed_write_of_any_kind_is_one_line_and_keeps_the_checkpoint(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_folder(tmp_path / "d", n=6)
    real, calls = engine.atomic_save, {"n": 0}

    def full_disk(obj, path):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 4352 vs 4240")
        return real(obj, path)

    monkeypatch.setattr(engine, "atomic_save", full_disk)
    code, _, err = run_cli(capsys, "train", "--data", "imagefolder", "--data-root", "d", *TINY, "--epochs", "2",
                           "--out", "r")
    one_line_error(code, err, "could not write the checkpoint r/checkpoint.pt: [enforce fail at "
                              "inline_container.cc:626] . unexpected pos 4352 vs 4240 (disk full?); the previous "
                              "checkpoint is intact")
    assert torch.load(tmp_path / "r" / "checkpoint.pt", weights_only=False)["epoch"] == 1


def test_stale_temporary_files_are_removed_on_the_next_start(trained, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained / "work" / "run", run)
    (run / ".checkpoint.pt.tmp-999999").write_bytes(b"\0" * 1000)  # what a killed save leaves
    code, _, err = run_cli(capsys, "train", "--resume", str(run), "--epochs", "2", "--allow-change", "epochs",
                           "--no-progress")
    assert code == 0, err
    assert not (run / ".checkpoint.pt.tmp-999999").exists()
    assert "removed 1 temporary file(s) a killed run left" in err


def test_distributed_timeout_and_a_lost_peer(monkeypatch, capsys):
    from datetime import timedelta

    import ropekit.train.commands as commands
    from ropekit.train import distributed

    monkeypatch.delenv("ROPEKIT_DIST_TIMEOUT", raising=False)
    assert distributed.dist_timeout() == timedelta(seconds=600)
    monkeypatch.setenv("ROPEKIT_DIST_TIMEOUT", "2.5")
    assert distributed.dist_timeout() == timedelta(seconds=2.5)
    for bad in ("0", "-3", "soon", "nan", "inf"):
        monkeypatch.setenv("ROPEKIT_DIST_TIMEOUT", bad)
        with pytest.raises(ValueError, match="ROPEKIT_DIST_TIMEOUT must be a positive number of seconds"):
            distributed.dist_timeout()
    monkeypatch.setenv("ROPEKIT_DIST_TIMEOUT", "7")
    seen = {}
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda **kw: seen.update(kw))
    monkeypatch.setattr(distributed.atexit, "register", lambda fn: None)
    monkeypatch.setenv("WORLD_SIZE", "2")
    distributed.init_distributed("cpu")
    assert seen["timeout"] == timedelta(seconds=7) and seen["backend"] == "gloo"
    monkeypatch.setenv("WORLD_SIZE", "1")

    def peer_gone(args):
        raise torch.distributed.DistBackendError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection "
                                                 "closed by peer [127.0.0.1]:29500\nmore lines")

    monkeypatch.setattr(commands, "run_train", peer_gone)
    code, _, err = run_cli(capsys, "train")
    one_line_error(code, err, "a peer process of the distributed run stopped or did not answer in time")
    assert "Connection closed by peer" in err and "more lines" not in err


# ------------------------------------------------------------------------------------------------ 5. experiments


def test_experiment_refuses_a_results_folder_and_misspelt_studies(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "res"
    out.mkdir()
    (out / "offset.csv").write_text("kept\n")
    code, _, err = run_cli(capsys, "experiment", "offset", "--quick", "--out", "res")
    one_line_error(code, err, "res already holds results (offset.csv); pass --overwrite to replace them",
                   "ropekit experiment")
    assert (out / "offset.csv").read_text() == "kept\n"
    code, _, err = run_cli(capsys, "experiment", "ofset")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "invalid choice: 'ofset'" in err and "did you mean 'offset'?" in err
    with pytest.raises(SystemExit):
        main(["experiment", "--help"])
    assert "under the current directory; the path is printed at the end" in " ".join(capsys.readouterr().out.split())


def test_experiment_quick_on_a_streamed_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_folder(tmp_path / "d", n=20, size=(16, 16))
    code, out, err = run_cli(capsys, "experiment", "classify", "--quick", "--pe", "none", "--data", "folder-stream",
                             "--data-root", "d", "--out", "res", "--no-progress", "--batch-size", "4")
    assert code == 0, err
    assert f"trained runs are cached in {(tmp_path / '.cache' / 'ropekit-experiments').resolve()}" in err
    assert any((tmp_path / ".cache" / "ropekit-experiments").iterdir())


def test_the_cache_line_names_only_caches_a_study_used(tmp_path, capsys, monkeypatch):
    """``trained runs are cached in ...`` is printed once per run cache the studies trained in or read back from,
    and not at all after studies that keep their runs under their own --out (retrieval, detect3d, owl, robot)."""
    from ropekit_studies import runner
    from ropekit_studies.common import StudyResult

    monkeypatch.chdir(tmp_path)
    used = {"retrieval": None, "classify": tmp_path / "c1", "offset": tmp_path / "c1", "shuffle": tmp_path / "c2"}
    monkeypatch.setattr(runner, "run_experiment", lambda name, out, **kw: StudyResult(name, out, [], "", {},
                                                                                       cache_dir=used[name]))
    code, _, err = run_cli(capsys, "experiment", "retrieval", "--out", "r")
    assert code == 0 and "cached in" not in err, err
    for name in ("classify", "offset", "shuffle"):
        code, _, err = run_cli(capsys, "experiment", name, "--out", name)
        assert code == 0 and err.count("trained runs are cached in") == 1 and str(used[name]) in err, err
    # every study at once: one line for the one cache they share
    monkeypatch.setattr(runner, "run_experiment", lambda name, out, **kw: StudyResult(
        name, out, [], "", {}, cache_dir=None if name in ("retrieval", "owl") else tmp_path / "c1"))
    code, _, err = run_cli(capsys, "experiment", "all", "--out", "every")
    assert code == 0 and err.count("trained runs are cached in") == 1, err


# ------------------------------------------------------------------------------------------------ 8. conventions


def test_unknown_options_get_one_line_with_a_suggestion(capsys):
    code, _, err = run_cli(capsys, "train", "--num-epochs", "3")
    line = one_line_error(code, err, "unrecognized arguments: --num-epochs 3; did you mean --epochs for --num-epochs?")
    assert len(err.strip().splitlines()) == 1 and line.endswith("(see ropekit train --help)")
    code, _, err = run_cli(capsys, "train", "--bogus")
    assert code == 2 and "did you mean" not in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli(capsys, "trian")
    assert code == 2 and "did you mean 'train'?" in err and len(err.strip().splitlines()) == 1


def test_one_epoch_is_singular(trained):
    proc = subprocess_cli(["train", "--data", "imagefolder", "--data-root", "demo", *TINY, "--out", "one"],
                          cwd=trained / "work")
    assert proc.returncode == 0, proc.stderr
    assert "after 1 epoch, " in proc.stdout and "1 epochs" not in proc.stdout + proc.stderr


# ------------------------------------------------------------------------------------------------ 7. docs


def test_readme_states_the_sharing_the_vit_builds():
    from ropekit.encodings.base import PositionEncoding
    from ropekit.nn import VisionTransformer, vit_config

    readme = (ROOT / "README.md").read_text()
    assert 'pe_sharing="auto": Cayley-STRING, as its paper, gets one encoding per layer' in readme
    assert "one encoding module shared by every layer by default" not in readme
    model = VisionTransformer(vit_config("tiny", num_classes=10, in_chans=1, image_size=(28, 28), pe="cayley"))
    encodings = [m for m in model.modules() if isinstance(m, PositionEncoding)]  # (modules() lists each once)
    assert len(encodings) == model.cfg.depth > 1


def test_docs_data_snippet_runs(tmp_path, monkeypatch):
    import re

    text = (ROOT / "docs" / "data.md").read_text()
    block = re.search(r"^```python\n(.*?)^```", text, re.S | re.M).group(1)
    make_folder(tmp_path / "imagenet", n=170, size=(20, 20))  # 2 x 136 training images: one batch of 256
    monkeypatch.chdir(tmp_path)
    import warnings

    ns: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the snippet's options are all current
        exec(compile(block, "docs/data.md", "exec"), ns)
    assert ns["images"].shape == (256, 3, 224, 224) and ns["labels"].dtype == torch.int64
    assert len(ns["val_loader"]) == 1


def test_progress_bar_shows_loss_and_accuracy(trained, capsys, monkeypatch):
    import tqdm

    monkeypatch.setattr(tqdm.tqdm, "__init__", _with_kw(tqdm.tqdm.__init__, mininterval=0, miniters=1))
    monkeypatch.chdir(trained / "work")
    tiny = [a for a in TINY if a != "--no-progress"]
    code, _, err = run_cli(capsys, "train", "--data", "imagefolder", "--data-root", "demo", *tiny, "--log-every", "1",
                           "--out", "bar")
    assert code == 0, err
    assert "loss=" in err and "acc=" in err, err


def _with_kw(init, **fixed):
    def wrapped(self, *a, **kw):
        init(self, *a, **{**kw, **fixed})

    return wrapped


def test_data_info_is_readable(trained, capsys):
    assert main(["data", "info", str(trained / "work" / "demo")]) == 0
    out = capsys.readouterr().out
    assert "all: samples 20, non image files 0, per class [10 10]" in out and "classes: a, b" in out
    assert "{" not in out and "['" not in out


def test_bench_refuses_an_unknown_row(capsys):
    code, _, err = run_cli(capsys, "bench", "--quick", "--rows", "cayley", "caylee")
    one_line_error(code, err, "--rows: unknown row 'caylee' (did you mean 'cayley'?)", "ropekit bench")


@pytest.mark.sim
def test_robot_help_has_no_pybullet_banner(tmp_path):
    pytest.importorskip("pybullet")
    proc = subprocess_cli(["robot", "--help"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "pybullet build time" not in proc.stdout + proc.stderr
    assert proc.stdout.startswith("usage: ropekit robot")


def test_bench_refuses_a_row_whose_forward_outlasts_forward_and_backward():
    from ropekit.bench.measure import impossible_timing

    assert impossible_timing([1.0, 1.1, 0.9], [3.0, 3.2, 2.9]) is None  # fwd about a third of fwd+bwd
    # the row: cayley fwd 58.96 ms, fwd+bwd 17.56 ms -- noise, not a measurement
    msg = impossible_timing([58.96, 60.0, 15.0, 57.0], [17.56, 18.0, 40.0, 17.0])
    assert msg.startswith("refused: forward alone took 3.") and "median of 4 interleaved rounds" in msg
    assert impossible_timing([2.0], [2.0]).startswith("refused: forward alone took 1.00x")  # a tie is impossible too
    assert impossible_timing([], []) is None


def test_native_output_of_the_profiler_goes_to_stderr(tmp_path):
    """What C code writes to fd 1 inside the block (as the profiler's start-up lines are) reaches stderr; stdout keeps
    only the report. Run in a subprocess: pytest's capture replaces the descriptors of this one."""
    code = ("import ctypes, sys\nfrom ropekit.bench.measure import native_output_to_stderr, peak_memory_mb\n"
            "import torch\nprint('before')\nwith native_output_to_stderr():\n"
            "    ctypes.CDLL(None).printf(b'native line\\n')\n"
            "print('after')\nprint(peak_memory_mb(lambda: torch.ones(1000)) >= 0)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["before", "after", "True"] and "native line" in proc.stderr
