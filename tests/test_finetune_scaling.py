"""Fine-tuning at a new resolution with the encodings' frequencies scaled: ``ropekit train --init-from RUN --scaling
METHOD`` and the ``ViTConfig.resolution_scaling`` field it records.

References are independent of ``ropekit.encodings.scaling``: position interpolation by ``s`` is the same model with
its learned frequencies divided by ``s`` (an exact operation on the checkpoint), and an encoding with
``ResolutionScaling("none")`` is the encoding itself.
"""

import argparse
import json
import shutil

import pytest
import torch

from ropekit.classification import TrainConfig, evaluate_run, train
from ropekit.nn import VisionTransformer, vit_config
from ropekit.train.checkpoint import load_checkpoint

TINY = dict(embed_dim=24, depth=1, num_heads=1, mlp_ratio=2.0)
PES = ["axial", "mixed", "cayley", "circulant", "comrope-ld", "string"]


def _cfg(out, **kw) -> TrainConfig:
    base = dict(data="digits", train_fraction=0.5, model_options=dict(TINY), batch_size=32, epochs=3, lr=3e-3,
                eval_batch_size=400, progress=False, tensorboard=False, threads=1, out=str(out), device="cpu")
    base.update(kw)
    return TrainConfig.from_dict(base)


def _args(argv):
    from ropekit.train.commands import add_train_arguments

    p = argparse.ArgumentParser()
    add_train_arguments(p)
    return p.parse_args(argv)


@pytest.mark.parametrize("pe, sharing", [(pe, sharing) for pe in PES for sharing in ("model", "layer", "head")
                                          if (pe, sharing) != ("axial", "head")])  # (fixed axial: no per-head)
def test_scaled_model_has_the_plain_models_state_dict(pe, sharing):
    """A model whose encodings are wrapped keeps their tensors' names: checkpoints load both ways, strictly, and
    with the method ``none`` the two models are the same function."""
    torch.manual_seed(0)
    kw = dict(pe=pe, image_size=(16, 16), patch_size=4, depth=2, embed_dim=32, num_heads=2, pe_sharing=sharing)
    plain = VisionTransformer(vit_config("tiny", **kw)).eval()
    scaled = VisionTransformer(vit_config("tiny", resolution_scaling={"method": "none"}, **kw)).eval()
    assert list(plain.state_dict()) == list(scaled.state_dict())
    scaled.load_state_dict(plain.state_dict(), strict=True)
    x = torch.randn(2, 1, 16, 16)
    torch.testing.assert_close(scaled(x), plain(x), rtol=0, atol=0)
    again = VisionTransformer(vit_config("tiny", **kw))
    again.load_state_dict(scaled.state_dict(), strict=True)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), plain.state_dict().values()))


@pytest.mark.parametrize("method", ["pi", "ntk", "yarn", "cap"])
def test_folded_scaled_model_equals_the_module_path(method):
    """``ropekit.fold`` (what the export serves) turns a scaled model into fixed-frequency RoPE with the same logits:
    the scaled frequencies and the attention factor folded, for every commuting encoding, at a larger input."""
    from ropekit.fold import fold

    for pe in PES:
        torch.manual_seed(0)
        scaling = {"method": method, "scale": [2.0, 1.5], "train_extent": [4.0, 4.0]}
        model = VisionTransformer(vit_config("tiny", pe=pe, image_size=(16, 16), patch_size=4, embed_dim=32,
                                             num_heads=2, depth=2, resolution_scaling=scaling)).eval()
        x = torch.randn(2, 1, 32, 24)
        with torch.no_grad():
            # fp32 round-off of logits of size ~1 through two blocks
            torch.testing.assert_close(fold(model)(x), model(x), rtol=1e-5, atol=1e-5, msg=pe)


def test_resolution_scaling_field_refuses_what_it_cannot_scale():
    base = dict(image_size=(16, 16), patch_size=4, embed_dim=24, depth=1, num_heads=1)
    with pytest.raises(ValueError, match="has none"):
        VisionTransformer(vit_config("tiny", pe="absolute", resolution_scaling={"method": "pi", "scale": 2}, **base))
    with pytest.raises(ValueError, match="grid coordinates"):
        VisionTransformer(vit_config("tiny", pe="cayley", coords="normalized",
                                     resolution_scaling={"method": "pi", "scale": 2}, **base))
    with pytest.raises(ValueError, match="acts on a RoPE form; liere"):  # LieRE with c >= 2 has no RoPE form
        VisionTransformer(vit_config("tiny", pe="liere", resolution_scaling={"method": "pi", "scale": 2}, **base))
    with pytest.raises(ValueError, match="unknown field.*factor"):
        VisionTransformer(vit_config("tiny", pe="cayley", resolution_scaling={"method": "pi", "factor": 2}, **base))
    with pytest.raises(ValueError, match="needs train_extent"):
        VisionTransformer(vit_config("tiny", pe="cayley", resolution_scaling={"method": "yarn", "scale": 2}, **base))


def test_fine_tune_with_interpolation_starts_as_the_source_with_halved_frequencies(tmp_path):
    """``--init-from`` an 8-px run (4x4 patches) at 16 px with ``--scaling pi``: ``s = 2`` from the source's extent
    to this run's. Before any step the fine-tuned model is the source with its Cayley frequencies halved, at 16 px;
    the run records the resolved scaling, so its evaluation and a resume need neither the source nor ``--scaling``
    again; ``ropekit eval --scaling`` on it measures from the source's extent."""
    from ropekit.classification.trainer import build_model, load_data
    from ropekit.train.commands import config_from_args
    from ropekit.train.finetune import init_from_checkpoint

    src = tmp_path / "src"
    train(_cfg(src), quiet=True)
    argv = ["--data", "digits", "--train-fraction", "0.5", "--epochs", "2", "--batch-size", "32", "--image-size", "16",
            "--patch-size", "2", "--model-opt", "embed_dim=24", "--model-opt", "depth=1", "--model-opt", "num_heads=1",
            "--model-opt", "mlp_ratio=2.0", "--threads", "1", "--device", "cpu", "--no-progress", "--no-tensorboard",
            "--init-from", str(src), "--scaling", "pi", "--out", str(tmp_path / "ft")]
    cfg, resume, _ = config_from_args(_args(argv))
    assert cfg.model.options["resolution_scaling"] == {"method": "pi"} and not resume

    # the first forward pass: the source model with halved frequencies (a plain model, no scaling code)
    _, test_ds, info = load_data(cfg)
    model, vit_cfg = build_model(cfg, info)
    resolved = vit_cfg.resolution_scaling
    assert resolved["scale"] == [2.0, 2.0] and resolved["train_extent"] == [4.0, 4.0]
    init_from_checkpoint(model, load_checkpoint(src))
    ref = VisionTransformer(dataclass_replace(vit_cfg, resolution_scaling={}))
    state = load_checkpoint(src)["model"]
    keys = [k for k in state if k.endswith("freq_param")]
    assert keys
    ref.load_state_dict({k: v * 0.5 if k in keys else v for k, v in state.items()})
    x = test_ds.images[:64]
    with torch.no_grad():
        got, want = model.eval()(x), ref.eval()(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # fp32 round-off of the same angles
    with torch.no_grad():
        plain = VisionTransformer(dataclass_replace(vit_cfg, resolution_scaling={}))
        plain.load_state_dict(state)
        assert (plain.eval()(x) - want).abs().max() > 1e-3  # the scaling is not the identity here

    # the run: stopped after 3 steps, the source removed, resumed from its folder alone
    part = train(cfg, on_step=lambda s: s == 3, quiet=True)
    assert part.interrupted
    recorded = json.loads((tmp_path / "ft" / "config.json").read_text())
    assert recorded["model"]["resolution_scaling"]["scale"] == [2.0, 2.0]
    assert recorded["train"]["model"]["options"]["resolution_scaling"]["scale"] == [2.0, 2.0]
    # resumed with the options it started with (as a study resumes it, or the same command with --resume): the
    # method asked for is the scaling it resolved; another method, or another field of it, is a change
    from ropekit.classification.trainer import resume_changes

    assert resume_changes(recorded["train"], cfg) == {}
    for other in ({"method": "yarn"}, {"method": "pi", "margin": 0.5}):
        changed = cfg.replace(model_options={**cfg.model.options, "resolution_scaling": other})
        with pytest.raises(ValueError, match="options differ from the run's: model_options"):
            resume_changes(recorded["train"], changed)
    shutil.rmtree(src)
    again, resume, _ = config_from_args(_args(["--resume", str(tmp_path / "ft")]))
    done = train(again, resume=resume, quiet=True)
    assert not done.interrupted and len(done.history) == 2

    # evaluation rebuilds the scaled model from the run alone
    ev = evaluate_run(tmp_path / "ft")
    assert (ev["scaling"], ev["scale"]) == ("pi", [2.0, 2.0])  # the report names the scaling the model carries
    assert ev["test_loss"] == pytest.approx(done.history[-1]["test_loss"], rel=1e-6)
    # --scaling pi at 32 px (16x16 patches): s measured from the source's 4x4 extent (s = 4), not the run's 8x8
    # (s = 2): the fine-tuned parameters with their frequencies divided by 4, in a plain model, at 32 px
    far = evaluate_run(tmp_path / "ft", image_size=32, scaling="pi")
    assert far["scale"] == [4.0, 4.0] and far["train_extent"] == [4.0, 4.0]
    ckpt = torch.load(tmp_path / "ft" / "checkpoint.pt", weights_only=False)
    ckpt["model"] = {k: v * 0.25 if k.endswith("freq_param") else v for k, v in ckpt["model"].items()}
    ckpt["vit_config"] = {**ckpt["vit_config"], "resolution_scaling": {}}
    torch.save(ckpt, tmp_path / "checkpoint.pt")
    ref_far = evaluate_run(tmp_path / "checkpoint.pt", image_size=32)
    assert far["test_loss"] == pytest.approx(ref_far["test_loss"], rel=1e-6)
    # and at the run's own size the method it was fine-tuned with is what it already carries
    same = evaluate_run(tmp_path / "ft", scaling="pi")
    assert same["scale"] == [2.0, 2.0] and same["test_loss"] == pytest.approx(ev["test_loss"], rel=1e-6)


def dataclass_replace(cfg, **changes):
    import dataclasses

    return dataclasses.replace(cfg, **changes)


def test_scaling_option_errors(tmp_path):
    from ropekit._errors import CommandError
    from ropekit.train.commands import config_from_args

    common = ["--data", "digits", "--device", "cpu", "--out", str(tmp_path / "x")]
    with pytest.raises(CommandError, match="--scaling pi scales from .* --init-from RUN"):
        config_from_args(_args([*common, "--scaling", "pi"]))
    with pytest.raises(CommandError, match="--scaling bogus: unknown method; known: pi, ntk, yarn, cap"):
        config_from_args(_args([*common, "--scaling", "bogus", "--init-from", "r"]))
    with pytest.raises(CommandError, match="conflicts with --model-opt resolution_scaling"):
        config_from_args(_args([*common, "--scaling", "pi", "--init-from", "r",
                                "--model-opt", 'resolution_scaling={"method": "ntk"}']))
