"""The open-vocabulary detection task on captioned scenes (ropekit.detection.owl_task): targets, held-out classes,
towers and the checkpoints they may come from, a short training run in 2-D and 3-D with its metrics and figure."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("pycocotools")
captioned = pytest.importorskip("ropekit.data.captioned")

from ropekit.detection.owl_task import (OwlDataConfig, OwlTaskConfig, OwlTrainConfig, class_split,  # noqa: E402
                                        evaluate_owl, load_scenes, owl_targets, plot_owl_examples, summarise_3d,
                                        train_owl)
from ropekit.detection.owl_towers import load_towers, towers_from_config  # noqa: E402
from ropekit.train.checkpoint import atomic_save  # noqa: E402

SMALL = {"vit": {"embed_dim": 24, "depth": 1, "num_heads": 2}, "text": {"embed_dim": 16, "depth": 1, "num_heads": 2},
         "embed_dim": 16, "image_size": 16}


def _fake_scenes():
    """Two 16 × 16 scenes: an object reaching past the border, a hidden one, a one-pixel sliver, padding."""
    box = torch.tensor([[[-4.0, 2.0, 6.0, 10.0], [2.0, 2.0, 8.0, 8.0], [3.0, 3.0, 3.5, 9.0]],
                        [[10.0, 10.0, 20.0, 20.0], [0, 0, 0, 0], [0, 0, 0, 0]]])
    clipped = box.clone()
    clipped[..., 0::2] = clipped[..., 0::2].clamp(0, 16)
    clipped[..., 1::2] = clipped[..., 1::2].clamp(0, 16)
    return SimpleNamespace(images=torch.zeros(2, 4, 16, 16), box2d=box, box2d_clipped=clipped,
                           visible=torch.tensor([[0.6, 0.1, 1.0], [0.9, 0, 0]]),
                           valid=torch.tensor([[True, True, True], [True, False, False]]),
                           classes=torch.tensor([[3, 10, 7], [12, -1, -1]]), box3d=torch.zeros(2, 3, 12))


def test_targets_clip_boxes_and_drop_hidden_or_degenerate_objects():
    tg = owl_targets(_fake_scenes(), min_visible=0.25)
    assert tg.mask.tolist() == [[True, False, False], [True, False, False]]
    assert tg.classes.tolist() == [[3, -1, -1], [12, -1, -1]]
    # (-4, 2, 6, 10) clipped to (0, 2, 6, 10): centre (3, 6), size (6, 8) over 16
    assert torch.allclose(tg.boxes2d[0, 0], torch.tensor([3, 6, 6, 8]) / 16)
    assert torch.allclose(tg.boxes2d[1, 0], torch.tensor([13, 13, 6, 6]) / 16)


def test_3d_metrics_against_hand_computation():
    import numpy as np

    m = summarise_3d(np.array([0.5, 0.1, 0.0, 0.3]), np.array([False, True, False, False]),
                     np.array([3.0, 2.0, 4.4]), np.array([3.2, 2.0, 4.0]))  # object 3 unmatched (IoU 0)
    assert m["mean_iou"] == pytest.approx(0.9 / 4) and m["mean_iou_unseen"] == pytest.approx(0.1)
    assert m["mean_iou_seen"] == pytest.approx(0.8 / 3) and m["iou25"] == pytest.approx(0.5)  # 0.5 and 0.3
    assert m["depth_err"] == pytest.approx(0.2)  # median of 0.2, 0.0, 0.4
    assert m["depth_err_rel"] == pytest.approx(0.0625)  # median of 0.0625, 0, 0.1
    assert m["num_targets"] == 4
    empty = summarise_3d(np.zeros(0), np.zeros(0, bool), np.zeros(0), np.zeros(0))
    assert all(math.isnan(empty[k]) for k in ("mean_iou", "iou25", "depth_err", "depth_err_rel"))
    with pytest.raises(ValueError, match="shapes differ"):
        summarise_3d(np.zeros(3), np.zeros(2, bool), np.zeros(1), np.zeros(1))


def test_solid_scenes_change_only_the_3d_boxes():
    card = load_scenes(OwlDataConfig(num_train=6, num_test=2, image_size=16))
    block = load_scenes(OwlDataConfig(num_train=6, num_test=2, image_size=16, solid=True))
    for c, b in zip(card, block):
        assert torch.equal(c.images, b.images) and torch.equal(c.box2d, b.box2d)
        v = b.valid
        assert torch.allclose(b.box3d[..., 11][v], b.true_size[v]) and torch.allclose(
            b.box3d[..., 2][v], b.depth[v] + b.true_size[v] / 2)


def test_held_out_classes():
    seen, unseen = class_split(("7", "triangle"))
    assert [captioned.CLASS_NAMES[c] for c in unseen] == ["7", "triangle"] and len(seen) == 12
    with pytest.raises(ValueError, match="unknown held-out class 'dog'"):
        class_split(("dog",))
    with pytest.raises(ValueError, match="every class is held out"):
        class_split(captioned.CLASS_NAMES)


def test_towers_refuse_a_checkpoint_of_another_task(tmp_path):
    atomic_save({"format": "ropekit-checkpoint", "version": 1, "model": {}, "vit_config": {}}, tmp_path / "c.pt")
    with pytest.raises(ValueError, match="checkpoint of the classification task.*--task retrieval"):
        load_towers(tmp_path / "c.pt")
    atomic_save({"format": "ropekit-checkpoint", "version": 1, "model": {}, "det_train_config": {}}, tmp_path / "d.pt")
    with pytest.raises(ValueError, match="detection task"):
        load_towers(tmp_path / "d.pt")
    with pytest.raises(FileNotFoundError):
        load_towers(tmp_path / "nothing")
    with pytest.raises(ValueError, match="unknown tower setting"):
        towers_from_config({"width": 3})


def test_empty_queries_are_refused():
    towers = towers_from_config(SMALL)
    from ropekit.detection.owl_towers import build_detector

    model = build_detector(towers, "2d")
    with pytest.raises(ValueError, match="no text query"):
        model(torch.zeros(1, 4, 16, 16), towers.tokenize([]))
    with pytest.raises(ValueError, match="empty"):
        towers.tokenize([""])
    # the class head starts at the contrastive image projection
    assert torch.equal(model.heads.class_embed.weight, towers.vision_proj.weight)


@pytest.mark.parametrize("boxes", ["2d", "3d"])
def test_a_short_run_trains_evaluates_and_draws(tmp_path, boxes):
    torch.set_num_threads(1)
    data = OwlDataConfig(num_train=16, num_test=8, image_size=16, unseen=("7", "9", "triangle"))
    train_set, test_set = load_scenes(data)
    cfg = OwlTaskConfig(boxes=boxes, towers=SMALL, data=data,
                        train=OwlTrainConfig(steps=3, batch_size=8, log_every=3, warmup_steps=1, iou_samples=64))
    model, towers, history = train_owl(cfg, train_set, out_dir=tmp_path / "run")
    assert len(history) == 1 and math.isfinite(history[0]["loss"])
    assert (tmp_path / "run" / "checkpoint.pt").exists()
    m = evaluate_owl(model, test_set, towers.tokenize, data, cfg.train)
    keys = ("AP", "AP50", "AP75", "AP_seen", "AP_unseen") if boxes == "2d" else ("mean_iou", "mean_iou_seen")
    for k in keys:
        assert 0.0 <= m[k] <= 1.0 or math.isnan(m[k]), k
    png = plot_owl_examples(model, test_set, towers.tokenize, tmp_path / "ex.png", index=(0, 1), data=data)
    assert png.stat().st_size > 1000
    # the run's checkpoint is an owl checkpoint: refused as towers
    with pytest.raises(ValueError, match="owl task"):
        load_towers(tmp_path / "run")


def test_ropekit_train_task_owl(tmp_path, capsys):
    from ropekit.cli import main

    run = tmp_path / "owl"
    argv = ["train", "--task", "owl", "--image-size", "16", "--data-opt", "num_train=8", "--data-opt", "num_test=4",
            "--batch-size", "4", "--threads", "1", "--device", "cpu", "--no-progress", "--out", str(run),
            "--task-opt", "steps=2", "--task-opt", "vocabulary=colour", "--task-opt", "unseen=purple"]
    # scratch towers are not a command-line choice: init_from names the contrastive run
    assert main(argv + ["--task-opt", "init_from=" + str(tmp_path / "none")]) == 2
    assert "contrastive run not found" in capsys.readouterr().err
    assert main(argv[:-2] + ["--task-opt", "colour=1"]) == 2
    assert "unknown --task-opt colour" in capsys.readouterr().err


@pytest.mark.slow
def test_towers_from_a_contrastive_run_then_ropekit_train_task_owl(tmp_path, capsys):
    pytest.importorskip("ropekit.multimodal.train")
    import json

    from ropekit.cli import main
    from ropekit.detection.owl_towers import build_detector, pretrain_towers
    from ropekit_studies.owl import owl_recipe

    r = owl_recipe("quick")
    pretrain_towers("cayley", "rgbd", 0, data=r["data"], towers=r["towers"], schedule=r["pretrain"],
                    run_dir=tmp_path / "pre")
    towers = load_towers(tmp_path / "pre")
    assert towers.input == "rgbd" and towers.embed_dim == r["towers"]["embed_dim"] and towers.colour_stats is None
    model = build_detector(towers, "3d")  # the detector's towers are the contrastive model's, weights included
    ckpt = torch.load(tmp_path / "pre" / "checkpoint.pt", weights_only=True)["model"]
    assert torch.equal(model.heads.class_embed.weight, ckpt["vision_proj.weight"])
    assert torch.equal(model.text.proj.weight, ckpt["text_proj.weight"])
    assert torch.equal(model.vision.patch_embed.proj.weight, ckpt["vision.patch_embed.proj.weight"])
    q = towers.tokenize(["red", "blue"])
    emb = torch.nn.functional.normalize(model.encode_queries(q), dim=-1)
    from ropekit.multimodal.retrieval import DualEncoder
    from ropekit.nn import TextConfig, TextTransformer, ViTConfig, VisionTransformer

    full = torch.load(tmp_path / "pre" / "checkpoint.pt", weights_only=True)
    dual = DualEncoder(VisionTransformer(ViTConfig.from_dict(full["vit_config"], strict=False)),
                       TextTransformer(TextConfig(**full["text_config"])), embed_dim=r["towers"]["embed_dim"])
    dual.load_state_dict(full["model"])
    assert torch.allclose(emb, dual.encode_text(q), atol=1e-6)  # queries embedded as the contrastive model does
    argv = ["train", "--task", "owl", "--image-size", "16", "--data-opt", "num_train=8", "--data-opt", "num_test=4",
            "--batch-size", "4", "--threads", "1", "--device", "cpu", "--no-progress", "--out", str(tmp_path / "owl"),
            "--task-opt", "steps=2", "--task-opt", "vocabulary=colour", "--task-opt", "boxes=3d",
            "--task-opt", f"init_from={tmp_path / 'pre'}"]
    assert main(argv) == 0
    assert "mean_iou" in capsys.readouterr().out
    metrics = json.loads((tmp_path / "owl" / "metrics.json").read_text())
    assert 0.0 <= metrics["mean_iou"] <= 1.0 and (tmp_path / "owl" / "examples.png").is_file()


def test_colour_statistics_of_a_standardised_contrastive_run_are_applied():
    from ropekit.detection.owl_towers import _colour_stats

    cfg = {"data": "captioned-scenes", "data_options": {"num_train": 8, "num_test": 4}, "image_size": 16}
    assert _colour_stats({**cfg, "normalize": False}) is None
    mean, std = _colour_stats({**cfg, "normalize": True})
    assert len(mean) == len(std) == 3 and all(0 < m < 1 for m in mean) and all(s > 0 for s in std)
    towers = towers_from_config(SMALL)
    from ropekit.detection.owl_towers import build_detector

    plain = build_detector(towers, "2d")
    towers.colour_stats = (mean, std)
    standardising = build_detector(towers, "2d")  # (the same tower modules)
    x = torch.rand(1, 4, 16, 16)
    xs = x.clone()
    xs[:, :3] = (x[:, :3] - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]
    assert torch.allclose(standardising.tokens(x)[0], plain.tokens(xs)[0], atol=1e-5)
