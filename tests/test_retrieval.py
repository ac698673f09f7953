"""Contrastive image-text training: the SigLIP loss, retrieval recall, the dual encoder and ``--task retrieval``."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ropekit.cli import main
from ropekit.multimodal import (DualEncoder, RetrievalConfig, RetrievalOptions, recall_ranks, retrieval_recall,
                                siglip_loss, train_retrieval)
from ropekit.nn import TextConfig, TextTransformer, VisionTransformer, vit_config
from ropekit.classification import TrainConfig

TINY_VIT = dict(embed_dim=24, depth=1, num_heads=2)
TINY_TEXT = dict(text_width=16, text_depth=1, text_heads=2, embed_dim=16)


def _unit(x):
    return F.normalize(x, dim=-1)


def test_siglip_loss_matches_the_direct_float64_formula():
    torch.manual_seed(0)
    b, e = 7, 5
    x, y = _unit(torch.randn(b, e, dtype=torch.float64)), _unit(torch.randn(b, e, dtype=torch.float64))
    t, bias = torch.tensor(math.log(10.0), dtype=torch.float64), torch.tensor(-10.0, dtype=torch.float64)
    direct = 0.0
    for i in range(b):
        for j in range(b):
            z = 1.0 if i == j else -1.0
            logit = math.exp(float(t)) * float(x[i] @ y[j]) + float(bias)
            direct += math.log1p(math.exp(-z * logit))  # -log sigmoid(z * logit)
    direct /= b
    assert siglip_loss(x, y, t, bias).item() == pytest.approx(direct, rel=1e-12)
    # float32 inputs agree to float32 precision; custom positives (two equal captions)
    assert siglip_loss(x.float(), y.float(), t.float(), bias.float()).item() == pytest.approx(direct, rel=1e-5)
    pos = torch.eye(b, dtype=torch.bool)
    pos[0, 1] = pos[1, 0] = True
    with_pos = siglip_loss(x, y, t, bias, pos).item()
    logit01 = math.exp(float(t)) * float(x[0] @ y[1]) + float(bias)
    logit10 = math.exp(float(t)) * float(x[1] @ y[0]) + float(bias)
    expected = direct + (math.log1p(math.exp(-logit01)) - math.log1p(math.exp(logit01))
                         + math.log1p(math.exp(-logit10)) - math.log1p(math.exp(logit10))) / b
    assert with_pos == pytest.approx(expected, rel=1e-12)
    # gradients reach the temperature and the bias
    t2, b2 = t.clone().requires_grad_(), bias.clone().requires_grad_()
    siglip_loss(x, y, t2, b2).backward()
    assert t2.grad is not None and b2.grad is not None and b2.grad.abs() > 0
    with pytest.raises(ValueError, match=r"both be \(B, E\)"):
        siglip_loss(x, y[:3], t, bias)


def _brute_force_recall(scores, relevant, k):
    """Sort each row by score, breaking ties so that irrelevant items come first; a hit if a relevant item is in
    the first k."""
    hits = []
    for s, rel in zip(scores.tolist(), relevant.tolist()):
        order = sorted(range(len(s)), key=lambda j: (-s[j], rel[j]))  # ties: irrelevant (False) first
        hits.append(any(rel[j] for j in order[:k]))
    return sum(hits) / len(hits)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_recall_against_a_brute_force_reference_with_ties(seed):
    g = torch.Generator().manual_seed(seed)
    n = 40
    # few distinct values: many exact ties
    img = torch.randint(-2, 3, (n, 3), generator=g).float()
    txt = torch.randint(-2, 3, (n, 3), generator=g).float()
    keys = [int(v) for v in torch.randint(0, 30, (n,), generator=g)]  # some texts are equal
    rec = retrieval_recall(img, txt, keys, ks=(1, 3, 5, 10), chunk=7)
    key = torch.as_tensor(keys)
    relevant = key[:, None] == key[None, :]
    for k in (1, 3, 5, 10):
        assert rec[f"i2t_r{k}"] == pytest.approx(_brute_force_recall(img @ txt.T, relevant, k))
        assert rec[f"t2i_r{k}"] == pytest.approx(_brute_force_recall(txt @ img.T, relevant, k))
    assert rec["mean_recall"] == pytest.approx(sum(v for k, v in rec.items() if k != "mean_recall") / 8)


def test_recall_edge_cases():
    e = torch.eye(4)
    perfect = retrieval_recall(e, e)
    assert perfect["i2t_r1"] == perfect["t2i_r1"] == perfect["mean_recall"] == 1.0
    # all scores equal: ties count against the query, so nothing is retrieved at rank 1..3 among 4
    flat = retrieval_recall(torch.ones(4, 2), torch.ones(4, 2), ks=(1, 3, 4))
    assert flat["i2t_r1"] == flat["i2t_r3"] == 0.0 and flat["i2t_r4"] == 1.0
    # equal captions make every one of their images right
    same = retrieval_recall(torch.tensor([[1.0, 0], [0.9, 0.1]]), torch.tensor([[0.0, 1], [0.0, 1]]), ["a", "a"])
    assert same["i2t_r1"] == 1.0 and same["t2i_r1"] == 1.0
    with pytest.raises(ValueError, match="N > 0"):
        retrieval_recall(torch.zeros(0, 2), torch.zeros(0, 2))
    with pytest.raises(ValueError, match="at least one relevant"):
        recall_ranks(torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.bool))


def test_dual_encoder_embeds_rgbd_and_text_to_unit_vectors():
    torch.manual_seed(0)
    vit = VisionTransformer(vit_config("tiny", num_classes=0, in_chans=3, image_size=(16, 16), modality="rgbd",
                                       patch_size=4, pe="cayley", **TINY_VIT))
    text = TextTransformer(TextConfig(20, context_length=8, embed_dim=16, depth=1, num_heads=2))
    model = DualEncoder(vit, text, embed_dim=12)
    x = torch.rand(3, 4, 16, 16) + torch.tensor([0, 0, 0, 2.0]).view(1, 4, 1, 1)
    img, txt = model(x, torch.randint(1, 20, (3, 8)))
    assert img.shape == txt.shape == (3, 12)
    assert torch.allclose(img.norm(dim=-1), torch.ones(3)) and torch.allclose(txt.norm(dim=-1), torch.ones(3))
    assert model.logit_scale.item() == pytest.approx(math.log(10)) and model.logit_bias.item() == -10
    assert {"logit_scale", "logit_bias"} <= model.no_weight_decay()
    assert any(n.startswith("vision.") for n in model.no_weight_decay())  # the encodings
    with pytest.raises(ValueError, match="num_classes=0"):
        DualEncoder(VisionTransformer(vit_config("tiny", num_classes=3, **TINY_VIT)), text)


def test_options_are_checked():
    with pytest.raises(ValueError, match="unknown"):
        RetrievalOptions.from_dict({"text_dept": 2})
    with pytest.raises(ValueError, match="text_depth must be a positive"):
        RetrievalOptions.from_dict({"text_depth": 0})
    with pytest.raises(ValueError, match="unknown pe"):
        RetrievalOptions.from_dict({"text_pe": "bogus"})


def _tiny(tmp_path, pe="cayley", depth_input="auto", epochs=2, name="run"):
    return RetrievalConfig(
        TrainConfig.from_dict(dict(data="captioned-scenes", data_options={"num_train": 48, "num_test": 24},
                                   image_size=16,
                    patch_size=4, pe=pe, depth_input=depth_input, epochs=epochs, batch_size=16, threads=1,
                    device="cpu", progress=False, tensorboard=False, augment_shift=0, model_options=TINY_VIT,
                    out=str(tmp_path / name))),
        RetrievalOptions(**TINY_TEXT, num_queries=2))


def test_training_a_few_steps_writes_the_run_folder(tmp_path):
    res = train_retrieval(_tiny(tmp_path), quiet=True)
    run = tmp_path / "run"
    for f in ("config.json", "checkpoint.pt", "metrics.csv", "summary.json", "curves.png", "queries.png"):
        assert (run / f).is_file(), f
    assert len(res.history) == 2 and res.history[-1]["train_loss"] < res.history[0]["train_loss"] * 1.5
    f = res.final
    assert all(0 <= f[k] <= 1 for k in ("i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "mean_recall"))
    assert f["i2t_r1"] <= f["i2t_r5"] <= f["i2t_r10"]
    config = json.loads((run / "config.json").read_text())
    assert config["task"] == "retrieval" and config["model"]["num_classes"] == 0
    assert config["model"]["depth_input"] == "coord"  # (auto, resolved: a rotary encoding takes depth as z)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["num_test_pairs"] == 24 and summary["mean_recall"] == pytest.approx(f["mean_recall"])
    # the run folder gives back the trained towers: the same test embeddings, hence the same recall
    from ropekit.multimodal import load_retrieval_run

    model, tok, cfg = load_retrieval_run(run)
    assert cfg.options.text_width == 16 and tok.context_length == cfg.options.context_length
    test = res.model  # (the trained model, in memory)
    ids = tok(["a big red 3", "a small blue square . the blue square is behind the red 3"])
    assert torch.allclose(model.encode_text(ids), test.encode_text(ids), atol=1e-6)
    # the depth hard negatives, recomputed from the trained towers with the flip written as string replacement
    from ropekit.multimodal import build_retrieval_task

    task = build_retrieval_task(_tiny(tmp_path, name="again"))
    images = task.test_scenes.images
    wins, flips = [], {"in front of": "behind", "behind": "in front of"}
    for i, caps in enumerate(task.test_scenes.captions):
        for words in caps:
            text = " ".join(words)
            rel = [r for r in flips if f" {r} " in text]
            if rel:
                neg = text.replace(f" {rel[0]} ", f" {flips[rel[0]]} ")
                with torch.no_grad():
                    e = model.encode_image(images[i:i + 1])
                    t, n = model.encode_text(tok([text, neg]))
                s_t, s_n = float(e[0].double() @ t.double()), float(e[0].double() @ n.double())
                wins.append(1.0 if s_t > s_n else 0.5 if s_t == s_n else 0.0)
    assert summary["depth_hn_pairs"] == len(wins) and f["depth_hn_pairs"] == len(wins) > 0
    assert summary["depth_hn_ties"] == wins.count(0.5)
    assert summary["depth_hn_acc"] == pytest.approx(sum(wins) / len(wins), abs=1e-9)
    assert "depth_hn_acc" in (run / "metrics.csv").read_text().splitlines()[0]
    with pytest.raises(ValueError, match="not a retrieval run"):
        load_retrieval_run_of_classification(tmp_path)


def load_retrieval_run_of_classification(tmp_path):
    from ropekit.multimodal import load_retrieval_run
    from ropekit.classification import train

    train(TrainConfig.from_dict(dict(data="digits", train_fraction=0.05, epochs=1, batch_size=16, image_size=8,
                                     patch_size=2,
                      threads=1, device="cpu", progress=False, tensorboard=False, out=str(tmp_path / "cls"),
                      model_options=dict(embed_dim=8, depth=1, num_heads=1))), quiet=True)
    load_retrieval_run(tmp_path / "cls")


@pytest.mark.slow
def test_resume_continues_bit_for_bit(tmp_path):
    """A run stopped mid-epoch (the engine saves a checkpoint) and resumed ends where an uninterrupted run ends."""
    full = train_retrieval(_tiny(tmp_path, epochs=2, name="full"), quiet=True)
    part = train_retrieval(_tiny(tmp_path, epochs=2, name="part"), quiet=True, on_step=lambda step: step == 4)
    assert part.interrupted
    resumed = train_retrieval(_tiny(tmp_path, epochs=2, name="part"), resume=True, quiet=True)
    assert resumed.history[-1]["train_loss"] == full.history[-1]["train_loss"]
    assert resumed.history[-1]["mean_recall"] == full.history[-1]["mean_recall"]
    for a, b in zip(resumed.model.state_dict().values(), full.model.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("pe,depth_input,coord_dim,chans", [("absolute", "ignore", 0, 3), ("absolute", "channel", 0, 4),
                                                            ("cayley", "ignore", 2, 3), ("mixed", "coord", 3, 3),
                                                            ("cayley", "both", 3, 4)])
def test_the_study_arms_build_the_intended_towers(tmp_path, pe, depth_input, coord_dim, chans):
    from ropekit.multimodal import build_retrieval_task

    task = build_retrieval_task(_tiny(tmp_path, pe=pe, depth_input=depth_input))
    vit = task.model.vision
    assert vit.patch_embed.proj.in_channels == chans
    assert (vit.coord_dim if vit.cfg.rotary else 0) == coord_dim


def test_data_without_captions_is_refused(tmp_path):
    cfg = _tiny(tmp_path)
    cfg.train = cfg.train.replace(data="rgbd-digits", data_options={"num_train": 8, "num_test": 4})
    with pytest.raises(ValueError, match="retrieval needs captioned data"):
        train_retrieval(cfg, quiet=True)
    # a checkpoint to start from would be recorded and not read: refused before anything loads
    cfg = _tiny(tmp_path, name="from")
    cfg.train = cfg.train.replace(init_from=str(tmp_path / "some-run"))
    with pytest.raises(ValueError, match="retrieval task trains both towers .* reads no checkpoint"):
        train_retrieval(cfg, quiet=True)
    assert not (tmp_path / "from" / "config.json").exists()
    # as would classification's augmentation, mixing, smoothing and packing: named, before anything is written
    for change, flag in (({"mixup_alpha": 0.2}, "--mixup"), ({"label_smoothing": 0.1}, "--label-smoothing"),
                         ({"native_resolution": True}, "--native-resolution")):
        cfg = _tiny(tmp_path, name="unread")
        cfg.train = cfg.train.replace(**change)
        with pytest.raises(ValueError, match=f"^{flag}: classification options the retrieval task does not read"):
            train_retrieval(cfg, quiet=True)
        assert not (tmp_path / "unread" / "config.json").exists()


def test_the_command_line(tmp_path, capsys):
    out = tmp_path / "cli"
    argv = ["train", "--task", "retrieval", "--data-opt", "num_train=32", "--data-opt", "num_test=16",
            "--image-size", "16", "--patch-size", "4", "--epochs", "1", "--batch-size", "16", "--threads", "1",
            "--device", "cpu", "--no-progress", "--no-tensorboard", "--out", str(out),
            "--model-opt", "embed_dim=24", "--model-opt", "depth=1", "--task-opt", "text_width=16",
            "--task-opt", "text_depth=1", "--task-opt", "num_queries=0"]
    assert main(argv) == 0
    assert "mean recall" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["train"]["data"]["name"] == "captioned-scenes" and config["retrieval"]["text_width"] == 16
    assert not (out / "queries.png").exists()
    assert main(["train", "--task", "retrieval", "--task-opt", "bogus=1", "--out", str(tmp_path / "x")]) == 2
    assert "bogus" in capsys.readouterr().err
    # the command line's task default does not shift images; a shift given there would not be read
    assert main(["train", "--task", "retrieval", "--augment-shift", "2", "--out", str(tmp_path / "y")]) == 2
    assert "--augment-shift: classification options the retrieval task does not read" in capsys.readouterr().err
    assert not (tmp_path / "y").exists()
    assert main(["train", "--task-opt", "text_width=8", "--out", str(tmp_path / "y")]) == 2
    assert "takes no --task-opt" in capsys.readouterr().err


def test_the_quick_study_writes_its_report(tmp_path):
    from ropekit_studies import compare_with_committed, run_experiment
    from ropekit_studies.retrieval import reading

    out = tmp_path / "study"
    res = run_experiment("retrieval", out=out, preset="quick", overrides={"progress": False},
                         arms=["rgb-ape", "rgbd-cayley", "rgb-cayley"])
    for f in ("retrieval.csv", "curves.csv", "retrieval.json", "table.md", "retrieval.png", "queries.png",
              "config.json"):
        assert (out / f).is_file(), f
    assert "Cayley: RGB-D (depth as z) − RGB (2-D)" in res.table and "68.77" in res.table
    doc = json.loads((out / "config.json").read_text())
    assert doc["preset"] == "quick" and len(doc["runs"]) == 3
    assert compare_with_committed(out) == []
    doc["recipe"]["train"]["epochs"] = 99
    (out / "config.json").write_text(json.dumps(doc))
    assert any("train recipe differs" in d for d in compare_with_committed(out))
    # a second call reads the finished runs back
    again = run_experiment("retrieval", out=out, preset="quick", overrides={"progress": False},
                           arms=["rgb-ape", "rgbd-cayley", "rgb-cayley"])
    assert again.table == res.table
    with pytest.raises(ValueError, match="--arms"):
        run_experiment("retrieval", out=out, preset="quick", overrides={"pes": ["cayley"]})
    assert "Depth hard negatives" in res.table and "control: RGB cannot see depth" in res.table
    rows = json.loads((out / "retrieval.json").read_text())["rows"]
    assert all("depth_hn_acc" in row and "depth_hn_pairs" in row and "depth_hn_ties" in row for row in rows)
    assert reading([0.02, 0.03, 0.025]) == "holds" and reading([0.02, 0.01, 0.03]) == "trend"  # t = 3.46, p = 0.074
    assert reading([0.01, -0.01, 0.0]) == "null" and reading([-0.03, -0.02, -0.025]) == "reversed"


def test_hard_negative_verdicts_per_arm():
    """Per-arm accuracies, bootstrap intervals over seeds and captions (against the normal approximation of the
    binomial where the seeds agree), the declared claims read as one family, and too few pairs."""
    from ropekit_studies.retrieval import _outcomes, hard_negative_table, hard_negatives

    assert _outcomes(0.75, 4, 0) == [1.0, 1.0, 1.0, 0.0] and _outcomes(0.625, 4, 1) == [1.0, 1.0, 0.5, 0.0]
    n = 400
    acc = {"rgb-ape": [0.49, 0.51, 0.50], "rgbd-cayley": [0.70, 0.70, 0.70], "rgbd-rope": [0.60, 0.62, 0.61],
           "rgbd-ape": [0.55, 0.58, 0.57]}
    rows = [{"arm": a, "seed": str(k), "depth_hn_acc": str(v), "depth_hn_pairs": str(n), "depth_hn_ties": "0"}
            for a, vs in acc.items() for k, v in enumerate(vs)]
    rows += [{"arm": "rgb-ape", "seed": 3, "depth_hn_acc": float("nan"), "depth_hn_pairs": 0},  # no depth caption
             {"arm": "rgb-cayley", "seed": 0}]  # a run from before the measure: left out
    hn = {h["arm"]: h for h in hard_negatives(rows, ["rgb-ape", "rgbd-rope", "rgbd-cayley", "rgbd-ape",
                                                     "rgb-cayley"], resamples=4000)}
    assert set(hn) == set(acc)
    for a, vs in acc.items():
        assert hn[a]["acc"] == pytest.approx(vs) and hn[a]["n"] == 3 and hn[a]["pairs"] == [n] * 3
        assert hn[a]["low95"] < np.mean(vs) < hn[a]["high95"]
    # equal seeds: only the captions vary, the mean of 3 x 400 Bernoulli(0.7): half-width 1.96 sqrt(0.21 / 1200);
    # 4,000 resamples put about 3 % Monte-Carlo error on a 95 % quantile
    half = 1.96 * np.sqrt(0.7 * 0.3 / (3 * n))
    c = hn["rgbd-cayley"]
    assert (c["high95"] - c["low95"]) / 2 == pytest.approx(half, rel=0.1)
    assert hn["rgb-ape"]["reading"] == "null" and hn["rgb-ape"]["as_expected"]
    assert hn["rgbd-cayley"]["reading"] == "holds" and hn["rgbd-rope"]["reading"] == "holds"
    assert hn["rgbd-ape"]["reading"] is None and hn["rgbd-ape"]["claim"] is None  # reported, not claimed
    table = hard_negative_table(list(hn.values()))
    assert "not as expected" not in table and "not a claim" in table
    # an RGB tower above chance fails the control
    leak = [dict(r, depth_hn_acc=0.7 + 0.01 * int(r["seed"])) if r["arm"] == "rgb-ape" and r["seed"] != 3 else r
            for r in rows]
    bad = {h["arm"]: h for h in hard_negatives(leak, ["rgb-ape", "rgbd-cayley"], resamples=2000)}
    assert bad["rgb-ape"]["reading"] == "holds" and not bad["rgb-ape"]["as_expected"]
    assert "not as expected" in hard_negative_table(list(bad.values()))
    # one pair per seed, every one right: 2 pairs cannot exclude chance (2 * 0.5^2 = 0.5)
    tiny = [{"arm": "rgbd-cayley", "seed": k, "depth_hn_acc": 1.0, "depth_hn_pairs": 1} for k in (0, 1)]
    (t,) = hard_negatives(tiny, ["rgbd-cayley"], resamples=500)
    assert t["reading"] == "not assessable" and not t["as_expected"]
    assert "not assessable** (2 pairs)" in hard_negative_table([t])
    assert hard_negatives([{"arm": "rgb-ape", "seed": 0}], ["rgb-ape"]) == []


def test_the_depth_only_study_trains_on_depth_only_scenes(tmp_path):
    from ropekit_studies import compare_with_committed, run_experiment

    out = tmp_path / "depth"
    res = run_experiment("retrieval-depth", out=out, preset="quick", overrides={"progress": False, "seeds": [0, 1]},
                         arms=["rgb-ape", "rgbd-cayley"])
    doc = json.loads((out / "config.json").read_text())
    assert doc["study"] == "retrieval-depth" and doc["recipe"]["train"]["data_options"]["cues"] == "depth-only"
    assert doc["recipe"]["seeds"] == [0, 1] and len(doc["runs"]) == 4
    assert doc["command"] == ("ropekit experiment retrieval-depth --preset quick --seeds 0,1 --arms "
                              f"rgb-ape,rgbd-cayley --out {out}")
    assert (out / "retrieval-depth.csv").is_file() and "(depth-only)" in res.table
    assert compare_with_committed(out) == []
    from ropekit_studies.retrieval import recipe

    assert "cues" not in recipe("default")["train"]["data_options"]  # the committed study's recipe is unchanged
    with pytest.raises(ValueError, match="unknown retrieval study"):
        recipe("quick", "retrieval-flat")


def test_the_docs_state_the_share_of_captions_with_a_depth_relation():
    """The shares the docs give are those of the recipes' test splits, counted here from the generated captions
    (and the counter checked on hand-made captions)."""
    from pathlib import Path

    from ropekit_studies.retrieval import caption_depth_counts, depth_share_phrases
    from ropekit.multimodal.hard_negatives import depth_relation_counts

    docs = Path(__file__).resolve().parents[1] / "docs"
    pages = {name: " ".join((docs / name).read_text().split()) for name in ("multimodal.md", "results/README.md")}
    for study, where in (("retrieval", ("multimodal.md", "results/README.md")),
                         ("retrieval-depth", ("multimodal.md", "results/README.md"))):
        counts = caption_depth_counts("default", study)
        assert counts["captions"] == 2000 and 0 < counts["depth"] == counts["multi_object_depth"]
        first, second = depth_share_phrases(counts)
        for page in where:
            assert first in pages[page], (study, page, first)
        assert second in pages["multimodal.md"], (study, second)
    caps = [[["a", "red", "3", ".", "the", "red", "3", "is", "in", "front", "of", "the", "blue", "2"]],
            [["a", "red", "3"], ["a", "blue", "2", "behind"]], [["a", "red", "3", "is", "left", "of"]]]
    n = depth_relation_counts(caps, [2, 1, 3])
    assert n == {"captions": 4, "depth": 2, "multi_object": 2, "multi_object_depth": 1}
    with pytest.raises(ValueError, match="object counts"):
        depth_relation_counts(caps, [2])
