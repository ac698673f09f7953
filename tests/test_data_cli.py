"""``ropekit data``: list, info, and one-line errors."""

import json

from ropekit.cli import main


def test_data_list_and_info(capsys):
    assert main(["data", "list"]) == 0
    names = capsys.readouterr().out.split()
    assert "mnist" in names and "rgbd-digits" in names
    assert main(["data", "info", "digits", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["num_classes"] == 10 and rec["sample_shape"] == [1, 8, 8]
    assert rec["train"] + rec["test"] == 1797


def test_data_errors_are_one_line(capsys):
    assert main(["data", "info", "no-such-set"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "known datasets" in err and "Traceback" not in err
    assert main(["data", "info", "imagefolder", "--root", "/definitely/missing"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_make_fake_convert_check_info(tmp_path, capsys):
    folder, shards = tmp_path / "f", tmp_path / "s"
    assert main(["data", "make-fake", str(folder), "--classes", "3", "--per-class", "5", "--size", "24",
                 "--no-progress"]) == 0
    assert sorted(p.name for p in folder.iterdir()) == ["class_0", "class_1", "class_2"]
    assert main(["data", "check", str(folder), "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["data", "convert", str(folder), str(shards), "--shard-size", "4", "--no-progress"]) == 0
    assert "train: 12 samples in 3 shards; val: 3 samples in 1 shards" in capsys.readouterr().out
    assert main(["data", "info", str(shards), "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["format"] == "shards" and rec["splits"]["train"]["per_class"] == [4, 4, 4]
    assert main(["data", "info", str(folder), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["splits"]["all"]["per_class"] == [5, 5, 5]
    assert main(["data", "check", str(shards), "--json", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["checked"] == 15


def test_convert_never_replaces_a_conversion_or_other_files_unasked(tmp_path, capsys):
    """A folder holding a complete conversion is replaced only with --overwrite (every earlier shard deleted, the
    new manifest written whole); one holding other files, or the converted folder itself, never; shards left
    without a manifest by a conversion cut short are replaced."""
    folder, shards = tmp_path / "f", tmp_path / "s"
    assert main(["data", "make-fake", str(folder), "--classes", "2", "--per-class", "6", "--size", "16",
                 "--no-progress"]) == 0
    assert main(["data", "convert", str(folder), str(shards), "--shard-size", "2", "--no-progress"]) == 0
    before = sorted(p.name for p in shards.iterdir())
    assert len(before) == 1 + 5 + 1  # the manifest, 10 training and 2 validation samples in shards of 2
    capsys.readouterr()
    assert main(["data", "convert", str(folder), str(shards), "--shard-size", "8", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "earlier conversion" in err and "--overwrite" in err
    assert sorted(p.name for p in shards.iterdir()) == before  # untouched
    assert main(["data", "convert", str(folder), str(shards), "--shard-size", "8", "--overwrite",
                 "--no-progress"]) == 0
    assert sorted(p.name for p in shards.iterdir()) == ["shards.json", "train-000000.tar", "train-000001.tar",
                                                        "val-000000.tar"]
    manifest = json.loads((shards / "shards.json").read_text())
    assert manifest["shard_size"] == 8 and manifest["splits"]["train"]["count"] == 10
    # a conversion cut short: shards without a manifest, nothing complete to lose
    (shards / "shards.json").unlink()
    assert main(["data", "convert", str(folder), str(shards), "--shard-size", "2", "--no-progress"]) == 0
    assert sorted(p.name for p in shards.iterdir()) == before
    other = tmp_path / "run"
    other.mkdir()
    (other / "checkpoint.pt").write_bytes(b"x")
    capsys.readouterr()
    for out, extra, words in [(other, [], "choose an empty folder"), (other, ["--overwrite"], "choose an empty"),
                              (folder, [], "the folder it converts"), (folder / "s", [], "or inside it")]:
        assert main(["data", "convert", str(folder), str(out), "--no-progress", *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and words in err
    assert (other / "checkpoint.pt").read_bytes() == b"x" and not (folder / "s").exists()
    assert main(["data", "info", str(folder), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["splits"]["all"]["per_class"] == [6, 6]  # nothing written into it


def test_check_names_bad_files_and_exits_non_zero(tmp_path, capsys):
    folder = tmp_path / "f"
    assert main(["data", "make-fake", str(folder), "--classes", "2", "--per-class", "3", "--size", "16",
                 "--no-progress"]) == 0
    (folder / "class_1" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    capsys.readouterr()
    assert main(["data", "check", str(folder), "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "broken.png: not a readable image" in out and "bad: 1" in out
    # convert stops at it in one line, or leaves it out when asked
    assert main(["data", "convert", str(folder), str(tmp_path / "s"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "broken.png" in err and "--skip-corrupt" in err
    assert main(["data", "convert", str(folder), str(tmp_path / "s"), "--skip-corrupt", "--no-progress"]) == 0
    assert "skipped 1 unreadable" in capsys.readouterr().out
    (folder / "class_2").mkdir()
    assert main(["data", "check", str(folder), "--no-progress"]) == 1
    assert "class_2: class folder without images" in capsys.readouterr().out
    assert main(["data", "check", str(tmp_path / "missing"), "--no-progress"]) == 2
