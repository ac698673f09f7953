"""Pinned study recipes: every study's documented command resolves to run configurations whose every
``TrainConfig`` / ``ViTConfig`` field comes from its recipe (never from a library default), recipes are checked
complete, ``--preset gpu`` resolves for every study, and the committed-config comparison finds differences."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from ropekit_studies import STUDIES, run_experiment, study_config
from ropekit_studies import recipes as R
from ropekit.nn import vit as vit_module
from ropekit.nn.vit import ViTConfig
from ropekit.classification import DataConfig, OptimConfig, build_vit_config
from ropekit.classification.config import SECTION_TYPES
from ropekit.train.upgrade import FLAT_FIELDS, flatten

CASES = [(name, preset) for name in R.RECIPES for preset in R.PRESETS]


class _Sentinel:
    """A default no recipe may reach: any configuration holding it was built from a library default."""

    def __repr__(self) -> str:
        return "<library default>"


SENTINEL = _Sentinel()


def _info(cfg) -> SimpleNamespace:
    """A dataset description of the recipe's data without loading it (the test is about defaults, not data)."""
    size = cfg.image_size or 28
    video = cfg.data == "moving-digits"
    return SimpleNamespace(image_size=(size, size), num_classes=4 if video else 10, in_chans=1,
                           kind="video" if video else "image",
                           num_frames=cfg.data_options.get("num_frames") if video else None)


def _resolve_all(name: str, preset: str):
    """``{pe: (TrainConfig dict, ViTConfig dict)}`` for every encoding and the first seed of the documented command
    ``ropekit experiment NAME --preset PRESET``."""
    cfg = study_config(name, preset=preset)
    out = {}
    for pe in cfg.pes:
        tcfg = cfg.train_config(pe, cfg.seeds[0])
        out[pe] = (flatten(tcfg.to_nested()), build_vit_config(tcfg, _info(cfg)).to_dict())
    return out


def _patch_defaults(monkeypatch, cls, names) -> None:
    """Replace the dataclass defaults of the fields ``names`` of ``cls`` by ``SENTINEL`` (factories included)."""
    init = cls.__init__
    params = [f for f in dataclasses.fields(cls) if f.init]
    with_default = [f for f in params if f.default is not dataclasses.MISSING
                    or f.default_factory is not dataclasses.MISSING]
    old = init.__defaults__
    assert len(old) == len(with_default)
    new = tuple(SENTINEL if f.name in names else d for f, d in zip(with_default, old))
    monkeypatch.setattr(init, "__defaults__", new)


def _has_sentinel(x) -> bool:
    if x is SENTINEL:
        return True
    if isinstance(x, dict):
        return any(_has_sentinel(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(_has_sentinel(v) for v in x)
    return False


@pytest.mark.parametrize("name,preset", CASES)
def test_every_field_comes_from_the_recipe(monkeypatch, name, preset):
    expected = _resolve_all(name, preset)
    # every library default a recipe field could fall back on now reads as a sentinel
    # (TrainConfig's sections now hold the fields: each section's field of a flat name, ViTConfig's own for the
    # position fields of model.options)
    wanted = R.recipe_fields() | R.PER_RUN_FIELDS
    for section, cls in SECTION_TYPES.items():
        names = {f.name for f in dataclasses.fields(cls)}
        flat = {{"name": "data", "size": "model", "options": "model_options"}.get(n, n): n for n in names}
        _patch_defaults(monkeypatch, cls, {flat[n] for n in wanted if n in flat})
    _patch_defaults(monkeypatch, ViTConfig, {f.name for f in dataclasses.fields(ViTConfig)})
    monkeypatch.setattr(vit_module, "VIT_SIZES", {k: {f: SENTINEL for f in v} for k, v in vit_module.VIT_SIZES.items()})
    assert SENTINEL in DataConfig.__init__.__defaults__ and SENTINEL in OptimConfig.__init__.__defaults__  # in place
    got = _resolve_all(name, preset)
    assert not _has_sentinel(got), f"{name}/{preset}: a field fell back on a library default"
    assert got == expected


@pytest.mark.parametrize("name,preset", CASES)
def test_recipe_values_reach_every_run(name, preset):
    r = R.recipe(name, preset)
    cfg = study_config(name, preset=preset)
    for pe in cfg.pes:
        tcfg = flatten(cfg.train_config(pe, cfg.seeds[-1]).to_nested())
        want = {**r["train"], **r["study"]["pe_overrides"].get(pe, {})}
        assert {k: tcfg[k] for k in want} == json.loads(json.dumps(want)) or \
            {k: tcfg[k] for k in want} == want, (name, preset, pe)
        assert tcfg["pe"] == pe and tcfg["seed"] == cfg.seeds[-1]
    assert cfg.pes == r["study"]["pes"] and cfg.seeds == r["study"]["seeds"] and cfg.preset == preset


def test_recipe_fields_cover_both_dataclasses():
    train_fields = set(FLAT_FIELDS)
    assert R.recipe_fields() | R.RUNTIME_FIELDS | R.PER_RUN_FIELDS >= train_fields
    vit_fields = {f.name for f in dataclasses.fields(ViTConfig)}
    # every ViTConfig field is either the dataset's, carried by TrainConfig, or pinned in model_options
    assert R.DATA_FIELDS | (train_fields & vit_fields) | R.architecture_fields() == vit_fields
    assert {"embed_dim", "depth", "num_heads", "mlp_ratio", "qkv_bias", "drop_path_rate"} <= R.architecture_fields()
    assert {"normalize", "grad_clip", "augment_shift", "lr", "min_lr", "warmup_epochs", "batch_size", "epochs",
            "label_smoothing", "weight_decay", "model_options"} <= R.recipe_fields()


def test_incomplete_or_unknown_recipe_fields_are_errors():
    r = R.recipe("classify", "default")
    del r["train"]["grad_clip"]
    with pytest.raises(ValueError, match="misses grad_clip"):
        R.check_recipe(r)
    r = R.recipe("classify", "default")
    r["train"]["grad_clipping"] = 1.0
    with pytest.raises(ValueError, match="grad_clipping"):
        R.check_recipe(r)
    r = R.recipe("classify", "default")
    del r["train"]["model_options"]["qkv_bias"]
    with pytest.raises(ValueError, match="model_options misses qkv_bias"):
        R.check_recipe(r)
    r = R.recipe("classify", "default")
    r["train"]["device"] = "cpu"  # runtime fields are not part of a recipe
    with pytest.raises(ValueError, match="device"):
        R.check_recipe(r)
    with pytest.raises(ValueError, match="unknown preset"):
        R.recipe("classify", "tpu")


def test_every_comparison_study_has_a_recipe():
    assert set(R.RECIPES) == {n for n in STUDIES if n not in ("robot", "detect3d", "aloha", "owl", "retrieval",
                                                                 "retrieval-depth")}


def test_gpu_preset_is_larger_and_resolves_from_the_cli():
    from ropekit.cli import build_parser
    from ropekit_studies.arguments import overrides

    for name in R.RECIPES:
        cpu, gpu = study_config(name, preset="default"), study_config(name, preset="gpu")
        c, g = cpu.train_config(cpu.pes[0], 0), gpu.train_config(gpu.pes[0], 0)
        assert g.model.options["embed_dim"] > c.model.options["embed_dim"], name
        # deeper, unless the CPU preset has the GPU preset's 6 blocks already (mqa)
        assert g.model.options["depth"] > c.model.options["depth"] or c.model.options["depth"] == 6, name

        def steps(t):  # optimisation steps (MNIST: 4,000 training images; video: num_train clips)
            return t.optim.epochs * t.data.data_options.get("num_train",
                                                            4000) * t.data.train_fraction / t.optim.batch_size

        assert steps(g) > steps(c) and len(gpu.seeds) >= len(cpu.seeds), name
        args = build_parser("experiment").parse_args(["experiment", name, "--preset", "gpu"])
        assert args.preset == "gpu" and not args.quick
        assert study_config(name, args.quick, overrides(args), args.preset) == gpu
    with pytest.raises(ValueError, match="contradict"):
        study_config("classify", quick=True, preset="gpu")


def test_classify_recipe_meets_the_study_design():
    for preset in ("default", "gpu"):
        r = R.recipe("classify", preset)
        assert set(r["study"]["pes"]) >= {"none", "absolute", "mixed", "liere-commute", "cayley", "circulant",
                                          "comrope-ap", "comrope-ld", "axial", "liere"}
        assert len(r["study"]["seeds"]) >= 3
        assert r["study"]["pe_overrides"]["mixed"]["pe_sharing"] == "head"  # per layer and head
        assert 28 // r["train"]["patch_size"] >= 7  # at least 7x7 tokens on 28 px MNIST


def test_compare_with_committed_on_quick_output(tmp_path, monkeypatch):
    out = tmp_path / "classify"
    monkeypatch.setitem(R.RECIPES["classify"]["quick"]["study"], "pes", ["mixed"])  # one run keeps the test fast
    run_experiment("classify", out=out, quick=True,
                   overrides={"cache_dir": str(tmp_path / "cache"), "progress": False})
    doc = json.loads((out / "config.json").read_text())
    assert doc["preset"] == "quick" and doc["recipe"]["train"]["grad_clip"] == R.recipe("classify", "quick")[
        "train"]["grad_clip"]
    assert R.compare_with_committed(out) == []
    # a changed recipe (as a changed default would be, were it not pinned) is reported, for the recipe and runs
    monkeypatch.setitem(R.RECIPES["classify"]["quick"]["train"], "grad_clip", 0.25)
    diffs = R.compare_with_committed(out)
    assert any("recipe train.grad_clip" in d for d in diffs)
    assert sum("grad_clip = 1.0, recipe 0.25" in d for d in diffs) == len(doc["runs"]) == 1
    monkeypatch.setitem(R.RECIPES["classify"]["quick"]["train"], "grad_clip", 1.0)
    assert R.compare_with_committed(out) == []
    # a run trained with another value than the recipe's is reported too
    doc["runs"][0]["train_config"]["lr"] = 0.5
    (out / "config.json").write_text(json.dumps(doc))
    assert [d for d in R.compare_with_committed(out) if "lr = 0.5" in d]
    # seeds (or encodings) chosen on the recorded command line narrow the recipe's lists; others are reported
    doc["runs"][0]["train_config"]["lr"] = R.recipe("classify", "quick")["train"]["lr"]
    doc["command"] = "ropekit experiment classify --quick --seeds 0 --pe mixed"
    (out / "config.json").write_text(json.dumps(doc))
    assert R.compare_with_committed(out) == []
    doc["command"] = "ropekit experiment classify --quick --seeds 0,7"
    (out / "config.json").write_text(json.dumps(doc))
    diffs = R.compare_with_committed(out)
    assert any("--seeds [7] are not in the recipe's [0]" in d for d in diffs)
    assert any("recipe study.seeds: committed [0], now [0, 7]" in d for d in diffs)
    # --model-opt on the recorded command is part of what it trains: the committed runs must have it
    doc["command"] = "ropekit experiment classify --quick --model-opt depth=3"
    (out / "config.json").write_text(json.dumps(doc))
    diffs = R.compare_with_committed(out)
    assert any("model_options" in d and "'depth': 3" in d for d in diffs)
    doc["command"] = "ropekit experiment classify --quick --model-opt nonsense=3"
    (out / "config.json").write_text(json.dumps(doc))
    assert any("--model-opt nonsense are not architecture fields" in d for d in R.compare_with_committed(out))
    # a run records its encoding options as its key hashes them, without the encoding's defaults: a recipe that
    # states a default value explicitly (ComRoPE's init_std=1) is what the run trained; another value is not
    doc["command"] = "ropekit experiment classify --quick"
    (out / "config.json").write_text(json.dumps(doc))
    monkeypatch.setitem(R.RECIPES["classify"]["quick"]["study"], "pe_overrides",
                        {"mixed": {"pe_options": {"base": 100.0}}})  # the default
    assert not [d for d in R.compare_with_committed(out) if "run " in d]
    monkeypatch.setitem(R.RECIPES["classify"]["quick"]["study"], "pe_overrides",
                        {"mixed": {"pe_options": {"base": 10000.0}}})
    assert [d for d in R.compare_with_committed(out) if "pe_options = {}, recipe {'base': 10000.0}" in d]
    # a results folder written before recipes were pinned says so
    (out / "config.json").write_text(json.dumps({"study": "classify", "runs": []}))
    assert "no study/preset recorded" in R.compare_with_committed(out)[0]


def test_one_paper_sharing_table_and_the_studies_departure_from_it():
    """``ropekit.nn.PAPER_SHARING`` is the one table of each paper's sharing (ComRoPE: per layer and head, its
    Table 7); the studies' recipes derive theirs from it and depart only for ComRoPE (one set for the model, as the
    committed studies trained it) -- reference: the recipes' literal table before it was derived."""
    from ropekit.nn import PAPER_SHARING

    assert PAPER_SHARING["comrope-ap"] == PAPER_SHARING["comrope-ld"] == "head"
    committed = {"axial": "model", "mixed": "head", "cayley": "layer", "circulant": "layer", "liere": "model",
                 "liere-commute": "model", "comrope-ap": "model", "comrope-ld": "model"}
    assert R.STUDY_SHARING == {pe: {"pe_sharing": s} for pe, s in committed.items()}
    assert {pe for pe in committed if PAPER_SHARING[pe] != committed[pe]} == set(R.STUDY_SHARING_CHANGES)
    assert not hasattr(R, "PAPER_SHARING") or R.PAPER_SHARING is PAPER_SHARING  # no second table
    assert R.recipe("classify", "default")["study"]["pe_overrides"] == R.STUDY_SHARING
