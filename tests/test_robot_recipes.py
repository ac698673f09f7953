"""The robot study's pinned recipes state every setting (a changed library default cannot change the study)."""

from __future__ import annotations

import pytest

from ropekit_studies.recipes import PRESETS
from ropekit.robot.expert import ScriptedExpert
from ropekit.robot.policy import PolicyConfig
from ropekit_studies.recipes.robot import ARMS, check_recipe, recipe
from ropekit.robot.train import PolicyTrainConfig


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_builds_its_policies_and_expert(preset):
    from ropekit_studies.robot import arm_settings, planned_runs

    r = recipe(preset)
    assert set(r["arms"]) <= set(ARMS)
    for arm, seed in planned_runs(r):
        s = arm_settings(r, arm, seed, image_size=64)
        cfg = PolicyConfig(**s["policy"])  # every field given: no TypeError, no default taken
        assert cfg.modality == ("rgbd" if arm.startswith("3d") else "image")
        PolicyTrainConfig(**s["train"])
    assert set(r["demos"]["expert"]) >= {"press_depth", "suction_height"}


def test_a_missing_or_unknown_field_is_one_clear_error():
    r = recipe("default")
    del r["train"]["lr"]
    with pytest.raises(ValueError, match="train.*misses lr"):
        check_recipe(r)
    r = recipe("default")
    r["policy"]["vit_overrides"]["not_a_field"] = 1
    with pytest.raises(ValueError, match="not_a_field"):
        check_recipe(r)
    r = recipe("default")
    del r["demos"]["expert"]["press_depth"]
    with pytest.raises(ValueError, match="press_depth"):
        check_recipe(r)
    with pytest.raises(ValueError, match="unknown preset"):
        recipe("huge")


def test_expert_defaults_match_the_recipe():
    # the demos of `ropekit robot collect` (expert defaults) are those of the study
    import inspect

    params = inspect.signature(ScriptedExpert.__init__).parameters
    for k, v in recipe("default")["demos"]["expert"].items():
        assert params[k].default == v, k


def test_the_cpu_and_gpu_recipes_evaluate_every_condition():
    """In distribution, table height, large distractors and lighting: the STRING paper's out-of-distribution
    conditions, all in the default evaluation."""
    from ropekit_studies.robot import CONDITIONS

    for preset in ("default", "gpu"):
        assert recipe(preset)["conditions"] == list(CONDITIONS)
