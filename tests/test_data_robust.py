"""Bad data on disk fails in one line that names the file, and never runs code: CIFAR pickles, image folders,
IDX files, 16-bit images, one-class folders, unknown dataset options."""

from __future__ import annotations

import ast
import gzip
import io
import os
import pickle
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from ropekit.cli import main as cli_main
from ropekit.data import DataFileError, load_dataset, read_cifar_batch, read_idx, read_image

ROOT = Path(__file__).resolve().parents[1]


def _one_line(e: BaseException) -> str:
    msg = str(e)
    assert "\n" not in msg, msg
    return msg


# ---------------------------------------------------------------------------------------------------------
# CIFAR pickles
# ---------------------------------------------------------------------------------------------------------


class _RunsCommand:
    """Unpickling this calls ``os.system(command)``: what a crafted CIFAR batch would do."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


class _CallsEval:
    def __reduce__(self):
        return eval, ("__import__('pathlib').Path('EVAL_MARKER').touch()",)


def _cifar_batch(n: int, seed: int = 0) -> dict:
    """A batch in the layout of the real CIFAR-10 files (bytes keys, uint8 data, list labels, filenames)."""
    rng = np.random.default_rng(seed)
    return {b"batch_label": b"training batch 1 of 5", b"labels": [int(v) for v in rng.integers(0, 10, n)],
            b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            b"filenames": [f"img_{i}.png".encode() for i in range(n)]}


def _write_cifar10(d: Path, batch: object, test: object = None, protocol: int = 2) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "data_batch_1").write_bytes(pickle.dumps(batch, protocol=protocol))
    (d / "test_batch").write_bytes(pickle.dumps(_cifar_batch(3, 1) if test is None else test, protocol=protocol))


@pytest.mark.parametrize("payload", ["system", "eval"])
def test_crafted_cifar_pickle_is_refused_and_runs_nothing(tmp_path: Path, payload: str, monkeypatch):
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "pwned"
    evil = _RunsCommand(f"touch {marker}") if payload == "system" else _CallsEval()
    _write_cifar10(tmp_path / "cifar", {b"data": evil, b"labels": [0]})
    with pytest.raises(DataFileError) as exc:
        load_dataset("cifar10", root=tmp_path / "cifar")
    msg = _one_line(exc.value)
    assert str(tmp_path / "cifar" / "data_batch_1") in msg
    assert ("system" in msg) if payload == "system" else ("eval" in msg)
    assert not marker.exists() and not (tmp_path / "EVAL_MARKER").exists()
    # the same payload, unpickled without the restriction, really would have run: the test is not vacuous
    pickle.loads(pickle.dumps(_RunsCommand(f"touch {marker}")))
    assert marker.exists()


def test_crafted_pickle_in_meta_file_is_refused(tmp_path: Path):
    d = tmp_path / "cifar-10-batches-py"
    _write_cifar10(d, _cifar_batch(4))
    (d / "batches.meta").write_bytes(pickle.dumps({b"label_names": _RunsCommand(f"touch {tmp_path / 'x'}")}))
    with pytest.raises(DataFileError, match="batches.meta"):
        load_dataset("cifar10", root=tmp_path)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("content", [b"\x00garbage" * 50, b"", b"\x80\x02}q\x00(X\x04\x00\x00\x00data"])
def test_garbage_cifar_file_is_one_line(tmp_path: Path, content: bytes):
    d = tmp_path / "cifar"
    d.mkdir()
    (d / "data_batch_1").write_bytes(content)
    (d / "test_batch").write_bytes(content)
    with pytest.raises(DataFileError) as exc:
        load_dataset("cifar10", root=d)
    assert not isinstance(exc.value, pickle.UnpicklingError)
    msg = _one_line(exc.value)
    assert msg.startswith(str(d / "data_batch_1")) and "not a CIFAR python batch" in msg


def test_cifar_pickle_of_the_wrong_shape(tmp_path: Path):
    (tmp_path / "list").write_bytes(pickle.dumps([1, 2, 3]))
    with pytest.raises(DataFileError, match="holds a list"):
        read_cifar_batch(tmp_path / "list")
    (tmp_path / "strs").write_bytes(pickle.dumps({b"data": ["a", "b"], b"labels": [0, 1]}))
    with pytest.raises(DataFileError, match="not numeric"):
        read_cifar_batch(tmp_path / "strs")
    (tmp_path / "short").write_bytes(pickle.dumps({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}))
    with pytest.raises(DataFileError, match=r"expected data \(N, 3072\)"):
        read_cifar_batch(tmp_path / "short")


@pytest.mark.parametrize("protocol", [0, 2, 4, 5])
def test_real_format_cifar_batch_still_loads(tmp_path: Path, protocol: int):
    batch = _cifar_batch(6)
    batch[b"labels"][0] = np.int64(7)  # a numpy scalar among the labels, as some tools write them
    _write_cifar10(tmp_path, batch, protocol=protocol)
    meta = {b"label_names": [f"c{i}".encode() for i in range(10)], b"num_cases_per_batch": 6, b"num_vis": 3072}
    (tmp_path / "batches.meta").write_bytes(pickle.dumps(meta, protocol=protocol))
    train, test, info = load_dataset("cifar10", root=tmp_path)
    assert (len(train), len(test)) == (6, 3) and info.class_names[2] == "c2"
    want = torch.from_numpy(batch[b"data"].reshape(6, 3, 32, 32)).float() / 255
    assert torch.equal(train.images, want)
    assert train.labels.tolist() == [int(v) for v in batch[b"labels"]]
    x, y = read_cifar_batch(tmp_path / "data_batch_1")
    assert x.dtype == np.uint8 and x.shape == (6, 3, 32, 32) and y.dtype == np.int64


def test_cli_reports_crafted_cifar_in_one_line(tmp_path: Path, capsys):
    marker = tmp_path / "pwned"
    _write_cifar10(tmp_path / "c", {b"data": _RunsCommand(f"touch {marker}"), b"labels": [0]})
    code = cli_main(["data", "info", "cifar10", "--root", str(tmp_path / "c")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "data_batch_1" in err and not marker.exists()


# ---------------------------------------------------------------------------------------------------------
# torch.load
# ---------------------------------------------------------------------------------------------------------


def test_every_torch_load_in_the_package_is_weights_only():
    """A checkpoint is a pickle too: every ``torch.load`` in ropekit/ passes ``weights_only=True``."""
    offenders = []
    for path in sorted((ROOT / "ropekit").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load" \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch":
                ok = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                         for k in node.keywords)
                if not ok:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"torch.load without weights_only=True: {offenders}"


# ---------------------------------------------------------------------------------------------------------
# image folders
# ---------------------------------------------------------------------------------------------------------


def _image_folder(root: Path, classes=("cat", "dog"), n: int = 3, ext: str = ".png") -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    for name in classes:
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(root / name / f"{i}{ext}")


def _jpeg_bytes() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


@pytest.mark.parametrize("kind", ["truncated", "garbage"])
def test_corrupt_jpeg_names_the_file(tmp_path: Path, kind: str):
    _image_folder(tmp_path, ext=".jpg")
    bad = tmp_path / "dog" / "broken.jpg"
    data = _jpeg_bytes()
    bad.write_bytes(data[: len(data) // 2] if kind == "truncated" else b"not a jpeg at all" * 10)
    with pytest.raises(DataFileError) as exc:
        load_dataset("imagefolder", root=tmp_path)
    msg = _one_line(exc.value)
    assert msg.startswith(str(bad)) and "skip_corrupt" in msg and exc.value.path == bad


def test_skip_corrupt_counts_the_skipped(tmp_path: Path):
    _image_folder(tmp_path, ext=".jpg")
    data = _jpeg_bytes()
    (tmp_path / "cat" / "a_truncated.jpg").write_bytes(data[: len(data) // 3])
    (tmp_path / "dog" / "b_garbage.jpg").write_bytes(b"\xff\xd8 nonsense")
    with pytest.warns(UserWarning, match=r"skipped 2 unreadable image\(s\) of 8") as rec:
        train, test, info = load_dataset("imagefolder", root=tmp_path, skip_corrupt=True)
    assert "a_truncated.jpg" in str(rec[0].message)
    assert len(train) + len(test) == 6 and info.num_classes == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a clean folder warns about nothing
        (tmp_path / "cat" / "a_truncated.jpg").unlink()
        (tmp_path / "dog" / "b_garbage.jpg").unlink()
        load_dataset("imagefolder", root=tmp_path, skip_corrupt=True)
    with pytest.raises(ValueError, match="skip_corrupt must be true or false"):
        load_dataset("imagefolder", root=tmp_path, skip_corrupt="yes")


def test_sixteen_bit_png_is_scaled_by_its_own_range(tmp_path: Path):
    from PIL import Image

    grey = np.full((6, 5), 32768, np.uint16)  # 50% grey at 16 bits
    ramp = (np.arange(30, dtype=np.uint32).reshape(6, 5) * 2000 + 100).astype(np.uint16)
    for name, arr in (("grey", grey), ("ramp", ramp)):
        (tmp_path / name).mkdir()
        Image.fromarray(arr).save(tmp_path / name / "a.png")
        Image.fromarray(arr).save(tmp_path / name / "b.png")
    with Image.open(tmp_path / "grey" / "a.png") as img:
        assert img.mode in ("I;16", "I")  # the mode the 16-bit code path serves
    x = read_image(tmp_path / "grey" / "a.png", mode="L")
    assert x.shape == (6, 5, 1) and x.dtype == np.float32
    np.testing.assert_allclose(x[..., 0], 32768 / 65535, rtol=0, atol=1e-6)  # not 1.0 (saturated)
    np.testing.assert_allclose(read_image(tmp_path / "ramp" / "a.png", mode="L")[..., 0], ramp / 65535, atol=1e-6)
    rgb = read_image(tmp_path / "ramp" / "a.png")  # grey repeated into three channels
    assert rgb.shape == (6, 5, 3) and np.array_equal(rgb[..., 0], rgb[..., 2])
    train, test, _ = load_dataset("imagefolder", root=tmp_path, mode="L")
    images = torch.cat([train.images, test.images])
    assert images.max() < 0.99 and 0.49 < float(images.median()) < 0.51
    # resizing keeps the scale: a constant image stays constant
    small = read_image(tmp_path / "grey" / "a.png", mode="L", size=(3, 2))
    assert small.shape == (3, 2, 1)
    np.testing.assert_allclose(small, 32768 / 65535, atol=1e-6)


def test_32bit_integer_image_uses_the_16bit_scale(tmp_path: Path):
    from PIL import Image

    img = Image.fromarray(np.full((4, 4), 32768, np.int32))
    assert img.mode == "I"
    img.save(tmp_path / "a.tif")
    np.testing.assert_allclose(read_image(tmp_path / "a.tif", mode="L"), 32768 / 65535, atol=1e-6)


def test_eight_bit_images_unchanged(tmp_path: Path):
    """The 8-bit path gives exactly value / 255, as before the 16-bit support."""
    from PIL import Image

    arr = np.random.default_rng(5).integers(0, 256, (7, 9, 3), dtype=np.uint8)
    Image.fromarray(arr).save(tmp_path / "a.png")
    got = read_image(tmp_path / "a.png")
    assert np.array_equal(got, (torch.from_numpy(arr).float() / 255.0).numpy())


def test_one_class_folder_is_an_error(tmp_path: Path):
    _image_folder(tmp_path, classes=("only",))
    with pytest.raises(ValueError, match="at least 2 classes") as exc:
        load_dataset("imagefolder", root=tmp_path)
    assert "'only'" in _one_line(exc.value)
    (tmp_path / "empty").mkdir()  # a second folder without images does not make a second class
    with pytest.raises(ValueError, match="only 'only' holds images"):
        load_dataset("imagefolder", root=tmp_path)


def test_one_class_elsewhere_is_an_error(tmp_path: Path):
    for prefix in ("train", "t10k"):  # IDX files of 4 blank 5x5 images, every label 0
        (tmp_path / f"{prefix}-images-idx3-ubyte").write_bytes(bytes([0, 0, 8, 3, 0, 0, 0, 4, 0, 0, 0, 5, 0, 0, 0, 5])
                                                               + bytes(100))
        (tmp_path / f"{prefix}-labels-idx1-ubyte").write_bytes(bytes([0, 0, 8, 1, 0, 0, 0, 4]) + bytes(4))
    with pytest.raises(ValueError, match="at least 2"):
        load_dataset("mnist-idx", root=tmp_path)
    assert load_dataset("mnist-idx", root=tmp_path, num_classes=2)[2].num_classes == 2


def test_cli_one_class_folder_exit_2(tmp_path: Path, capsys):
    _image_folder(tmp_path, classes=("only",))
    code = cli_main(["data", "info", "imagefolder", "--root", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "at least 2 classes" in err


# ---------------------------------------------------------------------------------------------------------
# IDX and options
# ---------------------------------------------------------------------------------------------------------


def test_broken_idx_files(tmp_path: Path):
    (tmp_path / "gz").write_bytes(gzip.compress(b"\x00\x00\x08\x01" + b"\x00" * 40)[:-12])  # cut gzip stream
    with pytest.raises(DataFileError, match="broken gzip") as exc:
        read_idx(tmp_path / "gz")
    assert str(tmp_path / "gz") in _one_line(exc.value)
    (tmp_path / "hdr").write_bytes(b"\x00\x00\x08\x03\x00\x00")  # three dims announced, header cut
    with pytest.raises(DataFileError, match="cut short"):
        read_idx(tmp_path / "hdr")


def test_unknown_dataset_option_lists_the_known(tmp_path: Path):
    with pytest.raises(ValueError, match=r"no option colour \(its options: mode, skip_corrupt\)"):
        load_dataset("imagefolder", root=tmp_path, colour="red")
    with pytest.raises(ValueError, match=r"its options: none"):
        load_dataset("cifar10", root=tmp_path, label_type="fine")


def test_data_file_error_pickles():
    e = DataFileError("/x/y.png", "bad\nthing")
    e2 = pickle.loads(pickle.dumps(e))
    assert str(e2) == str(e) == "/x/y.png: bad thing" and e2.path == Path("/x/y.png")


@pytest.mark.parametrize("bad", ["crafted-cifar", "garbage-cifar", "corrupt-jpeg", "one-class"])
def test_train_command_refuses_bad_data_before_training(tmp_path: Path, capsys, bad: str):
    """``ropekit train --data ... --data-root X`` on each kind of bad data: one line, exit 2, nothing run."""
    marker, root = tmp_path / "pwned", tmp_path / "data"
    if bad == "crafted-cifar":
        _write_cifar10(root, {b"data": _RunsCommand(f"touch {marker}"), b"labels": [0]})
    elif bad == "garbage-cifar":
        root.mkdir()
        (root / "data_batch_1").write_bytes(b"\x00\x01garbage")
        (root / "test_batch").write_bytes(b"\x00\x01garbage")
    else:
        _image_folder(root, classes=("cat",) if bad == "one-class" else ("cat", "dog"), ext=".jpg")
        if bad == "corrupt-jpeg":
            (root / "cat" / "9.jpg").write_bytes(_jpeg_bytes()[:300])
    data = "cifar10" if "cifar" in bad else "imagefolder"
    # (an image folder is streamed: a bad file is found when its batch is read, after the start-of-run line, so
    # one batch per image makes the run read them all; the run still ends with the one error line, leaving nothing)
    streamed = ["--batch-size", "1"] if data == "imagefolder" else []
    code = cli_main(["train", "--data", data, "--data-root", str(root), "--out", str(tmp_path / "run"),
                     "--epochs", "1", "--no-progress", *streamed])
    err = capsys.readouterr().err.strip()
    lines = err.splitlines()
    assert code == 2 and (len(lines) == 1 or (streamed and len(lines) == 2 and "error:" not in lines[0])), err
    err = lines[-1]
    assert err.startswith("ropekit train: error: ") and not marker.exists()
    assert not (tmp_path / "run").exists()
    expect = {"crafted-cifar": "data_batch_1", "garbage-cifar": "not a CIFAR python batch",
              "corrupt-jpeg": "9.jpg", "one-class": "at least 2 classes"}[bad]
    assert expect in err
