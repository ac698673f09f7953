"""The nested run configuration and its one converter (``ropekit.train.upgrade``): every committed ``config.json``
loads to the configuration it loaded to before the converter existed, a nested configuration round-trips through
JSON, and a bad key is named in one line."""

import hashlib
import json
import random
import warnings
from pathlib import Path

import pytest

from ropekit.nn.vit import ViTConfig
from ropekit.classification.config import POSITION_FIELDS, TrainConfig
from ropekit.train.upgrade import ADDED, ADDED_MODEL, FLAT_FIELDS, NESTED_NAMES, SECTIONS, flatten, nest, \
    upgrade_architecture, upgrade_config

ROOT = Path(__file__).resolve().parents[1]
#: For each committed ``config.json`` under docs/results: the first 16 hex digits of the SHA-256 of
#: ``{JSON pointer: TrainConfig.from_dict(section, strict=False).to_dict()}`` over its ``train`` / ``train_config``
#: sections, computed by the loader of main 836965f (flat fields, before the converter).
EXPECTED = json.loads((ROOT / "tests" / "data" / "committed_train_configs.json").read_text())


def _sections(obj, ptr=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            p = f"{ptr}/{k}"
            if k in ("train", "train_config") and isinstance(v, dict):
                yield p, v
            yield from _sections(v, p)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _sections(v, f"{ptr}/{i}")


def test_every_committed_config_loads_as_before():
    files = sorted((ROOT / "docs" / "results").rglob("config.json"))
    got = {}
    for f in files:
        loaded = {}
        for ptr, section in _sections(json.loads(f.read_text())):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (keys of other tasks' sections: ignored, as before, with a warning)
                cfg = TrainConfig.from_dict(section, source=str(f), strict=False)
            # the nested form is the same configuration: flattening it back gives the loaded fields (the flat
            # form the loader of 836965f returned, TrainConfig.to_dict() then, is the converter's flatten now)
            flat = flatten(cfg.to_nested())
            assert flatten(json.loads(json.dumps(cfg.to_nested()))) == flat, f"{f}#{ptr}"
            loaded[ptr] = flat
        if loaded:
            key = str(f.relative_to(ROOT))
            got[key] = hashlib.sha256(json.dumps(loaded, sort_keys=True).encode()).hexdigest()[:16]
    assert len(got) >= 150  # the committed studies are all here (180 files at 836965f)
    assert sorted(got) == sorted(EXPECTED)
    bad = [k for k in got if got[k] != EXPECTED[k]]
    assert not bad, f"{len(bad)} committed configurations load differently, e.g. {bad[:3]}"


def test_added_fields_are_what_old_runs_trained_with():
    # a recorded configuration that predates a field is read at the value runs trained with before it existed:
    # these equal today's defaults; if a default changes, ADDED keeps the old runs as they were
    defaults = flatten(TrainConfig().to_nested())
    for name, value in ADDED.items():
        assert defaults[name] == value, name
    vit = ViTConfig().to_dict()
    assert {k: vit[k] for k in ADDED_MODEL} == {"num_kv_heads": None, "coord_augment": (0.0, 1.0, 1.0),
                                                "resolution_scaling": {}}
    # a recorded run lacking them loads with them; a user's options lacking them are left to the defaults
    old = {k: v for k, v in defaults.items() if k not in ADDED}
    assert flatten(upgrade_config(old)) == defaults
    assert set(flatten(upgrade_config(old, fill=False))) == set(old)


def test_sections_partition_the_fields():
    names = [n for s in SECTIONS.values() for n in s]
    assert len(names) == len(set(names))
    assert set(names) | {"model_options"} == set(FLAT_FIELDS)
    # and the sections of TrainConfig are those of the converter (model.size and data.name renamed, the ViT's
    # position fields and model.options in ModelConfig.options)
    nested = TrainConfig().to_nested()
    assert {s: set(v) for s, v in nested.items()} == {
        s: {NESTED_NAMES.get(n, n) for n in names} | ({"options"} if s == "model" else set())
        for s, names in SECTIONS.items()}


def _random_config(rng: random.Random) -> TrainConfig:
    return TrainConfig.from_dict(dict(
        data=rng.choice(["mnist", "digits", "cifar10"]), model=rng.choice(["tiny", "small", "base"]),
        pe=rng.choice(["cayley", "axial", "mixed", "absolute"]), patch_size=rng.choice([None, 2, 4]),
        lr=rng.choice([1e-3, 3e-4, 0.1]), lr_base_batch=rng.choice([None, 256]), epochs=rng.randint(1, 50),
        augment_sizes=rng.choice([[], [16, 32]]), coord_augment=rng.choice([[0.0, 1.0, 1.0], [0.5, 1.2, 2.0]]),
        model_options=rng.choice([{}, {"depth": rng.randint(1, 8)}, {"drop_path_rate": 0.1, "num_kv_heads": 1}]),
        compile=rng.choice([False, True, "aot_eager"]), threads=rng.choice([None, 1, 4]), seed=rng.randint(0, 99),
        data_options=rng.choice([{}, {"mode": "L"}]), out=rng.choice([None, "runs/x"])))


@pytest.mark.parametrize("seed", range(20))
def test_nested_round_trips_through_json(seed):
    cfg = _random_config(random.Random(seed))
    nested = cfg.to_nested()
    assert set(nested) == set(SECTIONS)
    assert nested["model"]["size"] == cfg.model.size and nested["data"]["name"] == cfg.data.name
    assert nested["optim"]["lr"] == cfg.optim.lr and nested["run"]["seed"] == cfg.run.seed
    assert nested["model"]["options"] == {k: v for k, v in cfg.model.options.items() if k not in POSITION_FIELDS}
    back = TrainConfig.from_dict(json.loads(json.dumps(nested)))
    assert back == cfg
    # and the flat form still loads to the same configuration
    assert TrainConfig.from_dict(json.loads(json.dumps(flatten(cfg.to_nested())))) == cfg
    assert nest(flatten(cfg.to_nested())) == nested


def test_model_section_takes_vit_fields_by_name():
    cfg = TrainConfig.from_dict({"model": {"size": "small", "pe": "axial", "depth": 4, "options": {"mlp_ratio": 2.0}},
                                 "optim": {"lr": 0.01}})
    assert (cfg.model.size, cfg.model.vit().pe, cfg.optim.lr) == ("small", "axial", 0.01)
    assert {k: v for k, v in cfg.model.options.items() if k not in POSITION_FIELDS} == {"depth": 4, "mlp_ratio": 2.0}
    with pytest.raises(ValueError, match=r"^model: depth is given twice"):
        TrainConfig.from_dict({"model": {"depth": 4, "options": {"depth": 5}}})


@pytest.mark.parametrize("doc, name", [
    ({"optim": {"learning_rate": 1e-3}}, "optim.learning_rate"),
    ({"model": {"model": "tiny"}}, "model.model"),  # the size is model.size in the nested form
    ({"data": {"data": "mnist"}}, "data.data"),  # the dataset is data.name
    ({"model": {"bogus": 1}}, "model.bogus"),
    ({"run": {"lr": 1e-3}}, "run.lr"),  # a field of another section
    ({"optim": {}, "extra": 1}, "extra"),
    ({"learning_rate": 1e-3}, "learning_rate"),  # the flat form
])
def test_unknown_key_is_one_line_error_naming_it(doc, name):
    with pytest.raises(ValueError) as e:
        TrainConfig.from_dict(doc, source="config.yaml")
    assert str(e.value) == f"config.yaml: unknown option(s) {name}"
    with pytest.warns(UserWarning, match=name.replace(".", r"\.")):  # a recorded run: ignored, with a warning
        TrainConfig.from_dict(doc, source="config.json", strict=False)


def test_section_that_is_not_a_mapping():
    with pytest.raises(ValueError, match=r"^section optim must be a mapping"):
        TrainConfig.from_dict({"model": {"size": "tiny"}, "optim": 3})


def test_upgrade_architecture():
    assert upgrade_architecture({"depth": 2}) == {"num_kv_heads": None, "resolution_scaling": {}, "depth": 2}
    assert upgrade_architecture({"coords": "grid", "num_kv_heads": 1}) == {
        "num_kv_heads": 1, "coord_augment": [0.0, 1.0, 1.0], "resolution_scaling": {}, "coords": "grid"}


def _command(argv):
    import argparse

    from ropekit.train.commands import add_train_arguments, config_from_args

    p = argparse.ArgumentParser()
    add_train_arguments(p)
    return config_from_args(p.parse_args(argv))[0]


def test_config_file_nested_or_flat_resolves_the_same(tmp_path):
    # the command line is unchanged and wins over the file, whichever form the file has
    nested = tmp_path / "nested.yaml"
    nested.write_text("model: {size: small, pe: axial, depth: 3}\noptim: {lr: 0.004, epochs: 2}\n"
                      "data: {name: digits}\nrun: {seed: 5}\n")
    flat = tmp_path / "flat.json"
    flat.write_text(json.dumps({"model": "small", "pe": "axial", "model_options": {"depth": 3}, "lr": 0.004,
                                "epochs": 2, "data": "digits", "seed": 5}))
    a = _command(["--config", str(nested), "--lr", "0.002", "--device", "cpu"])
    b = _command(["--config", str(flat), "--lr", "0.002", "--device", "cpu"])
    assert a == b
    assert (a.model.size, a.model.vit().pe, a.model.options["depth"], a.optim.lr, a.optim.epochs, a.data.name,
            a.run.seed) == ("small", "axial", 3, 0.002, 2, "digits", 5)
    assert set(a.model.options) - set(POSITION_FIELDS) == {"depth"}


def test_config_file_with_an_unknown_nested_key_is_one_line(tmp_path, capsys, no_data):
    from ropekit.cli import main

    bad = tmp_path / "run.yaml"
    bad.write_text("optim: {learning_rate: 0.1}\n")
    code = main(["train", "--config", str(bad), "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "unknown option(s) optim.learning_rate" in err, err


@pytest.mark.parametrize("seed", range(20))
def test_dotted_flat_and_nested_keys_give_one_configuration(seed):
    """``section.key``, the flat name of earlier versions and the nested mapping are three spellings of one setting,
    read by the one converter; ``replace`` takes the same keys."""
    rng = random.Random(seed)
    lr, depth, name, size = rng.choice([1e-3, 0.02]), rng.randint(1, 8), rng.choice(["digits", "mnist"]), \
        rng.choice(["tiny", "small"])
    dotted = TrainConfig.from_dict({"optim.lr": lr, "model.depth": depth, "data.name": name, "model.size": size,
                                    "model.pe": "axial", "run.seed": seed})
    flat = TrainConfig.from_dict({"lr": lr, "model_options": {"depth": depth}, "data": name, "model": size,
                                  "pe": "axial", "seed": seed})
    nested = TrainConfig.from_dict({"optim": {"lr": lr}, "model": {"size": size, "pe": "axial", "depth": depth},
                                    "data": {"name": name}, "run": {"seed": seed}})
    assert dotted == flat == nested
    assert (nested.optim.lr, nested.model.vit().depth, nested.data.name, nested.model.size, nested.run.seed) == (
        lr, depth, name, size, seed)
    assert nested.model.vit().embed_dim == {"tiny": 96, "small": 384}[size]  # the size's own, not a copy
    changed = nested.replace(**{"optim.lr": 0.5, "seed": 3, "model.pe": "mixed"})
    assert (changed.optim.lr, changed.run.seed, changed.model.vit().pe, changed.model.vit().depth) == (
        0.5, 3, "mixed", depth)
    assert nested.optim.lr == lr  # replace returns a copy
    with pytest.raises(ValueError, match=r"^unknown option\(s\) optim\.learning_rate$"):
        nested.replace(**{"optim.learning_rate": 0.1})


def test_set_takes_section_keys_through_the_converter(capsys, no_data):
    from ropekit.cli import main

    cfg = _command(["--set", "optim.lr=0.004", "--set", "data.name=digits", "--set", "model.depth=3",
                    "--set", "run.seed=7", "--set", "weight_decay=0.2", "--device", "cpu"])
    assert (cfg.optim.lr, cfg.data.name, cfg.model.vit().depth, cfg.run.seed, cfg.optim.weight_decay) == (
        0.004, "digits", 3, 7, 0.2)
    assert _command(["--set", "optim.lr=0.004", "--device", "cpu"]) == _command(["--lr", "0.004", "--device", "cpu"])
    # one setting, two spellings, two values: refused in one line naming both
    code = main(["train", "--set", "optim.lr=0.01", "--lr", "0.002"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.endswith("--set optim.lr=0.01 conflicts with --lr 0.002; give lr once"), err
    code = main(["train", "--set", "model.depth=3", "--model-opt", "depth=4"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.endswith("--set model.depth=3 conflicts with --model-opt depth=4; give depth once"), err
    code = main(["train", "--set", "optim.learning_rate=0.01"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "unknown option(s) optim.learning_rate" in err, err
