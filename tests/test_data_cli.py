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
