"""The committed study results are what their documented commands train at this version.

Each folder under ``docs/results/`` written by ``ropekit experiment NAME --out docs/results/NAME`` records its
preset, its complete recipe and every run's configuration. A changed default, recipe or study option makes the
folder differ from what the command would train now, and this test fails until the study is regenerated
(``docs/results/REGENERATE.md``). The README's results table must be the committed classification table.
"""

import importlib.util
import sys
from pathlib import Path

import pytest

from ropekit.train.upgrade import upgrade_architecture
from ropekit_studies.recipes import compare_with_committed

pytestmark = pytest.mark.repro

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
COMMITTED = ["classify", "shuffle", "offset", "resolution", "data-efficiency", "exact-vs-relaxed", "video",
             "ablations", "scale", "data-efficiency-depth6", "data-efficiency-liere", "compute-efficiency", "video-depth6", "resolution-depth6", "shuffle-depth6",
             "exact-vs-relaxed-depth6", "ablations-depth6", "classify-depth6", "offset-depth6", "detect3d", "robot",
             "gpu/classify", "retrieval", "owl", "mqa", "resolution-comrope", "classify-normalized", "scale-width", "compute-efficiency-depth6",
             "video-normalized", "robot-ood",
             "data-efficiency-depth6-liere", "retrieval-depth-quick", "native-resolution", "retrieval-depth",
             "resolution-comrope-paper", "resolution-finetune", "resolution-finetune-4x"]


@pytest.mark.parametrize("study", COMMITTED)
def test_committed_study_matches_its_recipe(study):
    assert (RESULTS / study / "config.json").is_file(), f"docs/results/{study} has no config.json"
    assert compare_with_committed(RESULTS / study) == []


def test_every_committed_study_folder_is_checked():
    """A study folder committed under docs/results (or docs/results/gpu) is in the list above, so no result
    escapes the check against its recipe."""
    found = {str(p.parent.relative_to(RESULTS)) for pattern in ("*/config.json", "gpu/*/config.json")
             for p in RESULTS.glob(pattern)}
    assert found == set(COMMITTED)


def test_readme_results_table_is_the_committed_one():
    spec = importlib.util.spec_from_file_location("gen_readme_results", ROOT / "tools" / "gen_readme_results.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gen_readme_results"] = mod
    spec.loader.exec_module(mod)
    readme = (ROOT / "README.md").read_text()
    table = (RESULTS / "classify" / "table.md").read_text()
    assert mod.render(readme, table) == readme, "run python tools/gen_readme_results.py"
    assert table.strip() in readme


def _schedule_pilots():
    """``(name, argv)`` of every ``run`` line of docs/results/detect3d/schedule/commands.sh, as the arguments its
    ``run`` function passes to ``python -m ropekit_studies.detection`` (without ``--out``)."""
    import shlex

    pilots = []
    for line in (RESULTS / "detect3d" / "schedule" / "commands.sh").read_text().splitlines():
        if line.startswith("run "):
            words = shlex.split(line, comments=True)
            name, enc, inp, steps, batch, lr, warmup, log_every, *seed = words[1:]
            assert len(seed) <= 1, line
            seed = seed[0] if seed else "0"
            pilots.append((name, ["--encodings", enc, "--inputs", inp, "--seeds", seed, "--set", f"train.steps={steps}",
                                  "--set", f"train.batch_size={batch}", "--set", f"train.lr={lr}",
                                  "--set", f"train.warmup_steps={warmup}", "--set", f"train.log_every={log_every}"]))
    return pilots


def test_detect3d_schedule_pilots_are_what_their_commands_train():
    """Each committed pilot run has the settings its line of commands.sh resolves to at this version, and the
    committed table is what summarise.py writes from the run files."""
    import argparse
    import json

    from ropekit_studies import detection as ex

    pilots = _schedule_pilots()
    assert len(pilots) >= 10
    parser = argparse.ArgumentParser()
    ex.add_arguments(parser)
    for name, argv in pilots:
        cfg = ex.config_from_args(parser.parse_args(argv))
        (enc,), (inp,), (seed,) = cfg.encodings, cfg.inputs, cfg.seeds
        doc = json.loads((RESULTS / "detect3d" / "schedule" / name / "runs" / f"{enc}-{inp}-s{seed}" / "metrics.json")
                         .read_text())
        settings = {**doc["settings"], "backbone": upgrade_architecture(doc["settings"]["backbone"])}
        assert settings == json.loads(json.dumps(ex.run_settings(cfg, enc, inp, seed))), name
    summarise = RESULTS / "detect3d" / "schedule" / "summarise.py"
    spec = importlib.util.spec_from_file_location("schedule_summary", summarise)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.load()
    assert sorted(r["pilot"] for r in rows) == sorted(name for name, _ in pilots)
    committed = (RESULTS / "detect3d" / "schedule" / "table.md").read_text()
    assert mod.render_table(rows) == committed, "run docs/results/detect3d/schedule/summarise.py"
    readme = (RESULTS / "detect3d" / "README.md").read_text()
    assert mod.with_readme_block(readme, mod.readme_block(rows)) == readme, \
        "docs/results/detect3d/README.md's grid and questions differ from the run files: run summarise.py"


def test_one_comparison_for_every_committed_folder():
    """``ropekit_studies.recipes.compare_with_committed`` is the one comparison (a study with its own recipe format
    plugs its part in through the study registry): no other definition of that name in the library or the
    studies, and it takes an ALOHA folder as it takes a classification one."""
    root = Path(__file__).resolve().parents[1]
    defs = [str(p.relative_to(root)) for base in ("ropekit", "studies") for p in sorted((root / base).rglob("*.py"))
            if "def compare_with_committed(" in p.read_text()]
    assert defs == ["studies/ropekit_studies/recipes/__init__.py"]
    assert compare_with_committed(RESULTS / "aloha" / "cpu") == []
