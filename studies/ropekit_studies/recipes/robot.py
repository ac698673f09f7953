"""Pinned recipes of the robot study (2-D vs 3-D STRING pick policies): every field, per preset.

A robot study run never takes a value from a dataclass default or a named model size: the recipe of each
preset (``default`` for a 2-core CPU, ``gpu`` for one GPU, ``quick`` for tests) states

* ``demos``: episodes, action noise, ``clean_labels`` (DART: noisy actions executed, the expert's
  noise-free ones recorded), seed and ``expert`` -- every :class:`~ropekit.robot.expert.ScriptedExpert`
  setting (the grasp strategy included);
* ``env``: :class:`~ropekit.robot.env.PickConfig` overrides shared by demos and evaluation (the presets'
  scenes are the conditions);
* ``policy``: every :class:`~ropekit.robot.policy.PolicyConfig` field except those each arm sets (``modality``,
  ``pe``, ``pe_options``, ``depth_scale_init``, ``image_size``), with ``vit_overrides`` stating every backbone
  field of :class:`~ropekit.nn.ViTConfig` except the data's and the per-run ones;
* ``train``: every :class:`~ropekit.robot.train.PolicyTrainConfig` field except ``seed`` (per run) and
  ``num_threads`` (hardware); ``finetune``: the fields the fine-tunings change;
* the study: the encodings ``pe_2d`` / ``pe_3d`` with their options, the arms, the training ``seeds``, the depth
  lift's initial scale (``depth_scale``, coordinate units per metre), the conditions and the evaluation.

:func:`check_recipe` rejects a recipe with a missing or unknown field, so a field added to any of these classes
breaks the recipe tests until every preset states its value.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Dict, Set

from ropekit.nn.vit import ViTConfig
from ropekit.train.upgrade import upgrade_architecture

from . import DATA_FIELDS, PRESETS, check_fields, preset_copy

__all__ = ["ARMS", "TOP_FIELDS", "recipe", "check_recipe", "policy_fields",
           "backbone_fields", "train_fields", "expert_fields", "with_later_backbone"]

#: The policies a study can train. ``2d``: RGB, 2-D encoding, from scratch. ``3d``: RGB-D with the 3-D encoding,
#: started from ``2d`` (the STRING paper's protocol) and fine-tuned. ``2d_ft``: ``2d`` fine-tuned on RGB on the
#: same schedule (the control for the extra steps). ``3d_scratch``: RGB-D with the 3-D encoding from scratch for
#: as many steps as ``3d`` had in all.
ARMS = ("2d", "3d", "2d_ft", "3d_scratch")

TOP_FIELDS = frozenset({"demos", "env", "policy", "train", "finetune", "pe_2d", "pe_3d", "pe_options", "arms",
                        "seeds", "depth_scale", "conditions", "eval_episodes", "eval_seed"})
#: ``PolicyConfig`` fields each arm sets.
PER_ARM_POLICY = frozenset({"modality", "pe", "pe_options", "depth_scale_init", "image_size"})
#: ``ViTConfig`` fields the policy sets itself (its data, its encoding, the depth path).
PER_RUN_BACKBONE = frozenset({"pe", "pe_options", "depth_input", "depth_scale_init"})


def policy_fields() -> Set[str]:
    from ropekit.robot.policy import PolicyConfig

    return {f.name for f in dataclasses.fields(PolicyConfig)} - PER_ARM_POLICY


def backbone_fields() -> Set[str]:
    return {f.name for f in dataclasses.fields(ViTConfig)} - DATA_FIELDS - PER_RUN_BACKBONE


def train_fields() -> Set[str]:
    from ropekit.robot.train import PolicyTrainConfig

    return {f.name for f in dataclasses.fields(PolicyTrainConfig)} - {"seed", "num_threads"}


def expert_fields() -> Set[str]:
    from ropekit.robot.expert import ScriptedExpert

    params = inspect.signature(ScriptedExpert.__init__).parameters
    return set(params) - {"self", "env", "noise", "seed", "belief_offset"}


def _backbone(**changes: Any) -> Dict[str, Any]:
    """ViT-tiny-like encoder: 8-px patches, width 96, 4 blocks of 2 heads, MLP ratio 2, mean pooling is not used
    (the policy pools with its own queries), grid coordinates, one encoding set for the whole model."""
    b = dict(patch_size=8, tubelet_size=2, embed_dim=96, depth=4, num_heads=2, mlp_ratio=2.0, qkv_bias=True,
             drop_rate=0.0, attn_drop_rate=0.0, drop_path_rate=0.0, pe_sharing="model", per_head=False,
             pe_fold_train=True, ape="none", cls="none", coords="grid", jitter=0.0,
             coord_augment=[0.0, 1.0, 1.0], num_kv_heads=None, resolution_scaling={})
    b.update(changes)
    return b


def with_later_backbone(doc: Dict[str, Any]) -> Dict[str, Any]:
    """A committed recipe or configuration (robot or ALOHA) with its ``policy.vit_overrides`` completed by the
    backbone fields added since it was trained (:func:`ropekit.train.upgrade.upgrade_architecture`)."""
    policy = doc.get("policy")
    if not isinstance(policy, dict) or not isinstance(policy.get("vit_overrides"), dict):
        return doc
    return {**doc, "policy": {**policy, "vit_overrides": upgrade_architecture(policy["vit_overrides"])}}


def _policy(**changes: Any) -> Dict[str, Any]:
    """Diffusion head: 8-step chunks of which 4 are executed, relative tip targets, 4 pooling queries with their
    expected patch positions (keypoints), FiLM residual MLP of width 256, DDPM with 100 steps predicting the clean
    chunk (``sample``: with ``epsilon`` the first chunks hardly followed the target), 10 DDIM steps; the auxiliary
    loss (the target's position relative to the tip, from the conditioning) at weight 1."""
    p = dict(vit_size="tiny", vit_overrides=_backbone(), horizon=8, n_action_steps=4, action_mode="relative",
             num_queries=4, keypoints=True, aux_weight=1.0, cond_dim=256, hidden_dim=256, num_blocks=3,
             num_train_timesteps=100, num_inference_steps=10, prediction="sample")
    p.update(changes)
    return p


def _train(**changes: Any) -> Dict[str, Any]:
    t = dict(steps=2000, batch_size=64, lr=5e-4, min_lr=1e-5, warmup_steps=100, weight_decay=1e-4,
             depth_lr_mult=10.0, noise_samples=4, shift=0, grad_clip=1.0, ema_decay=0.995, only_successful=True,
             log_every=25)
    t.update(changes)
    return t


def _expert(**changes: Any) -> Dict[str, Any]:
    """Moves of at most 5 cm per step; approach 8 cm above the top; press 2 cm into it with the suction on from
    3 cm above (a height error of a few centimetres still grasps); lift 22 cm."""
    e = dict(max_step=0.05, approach_height=0.08, lift_height=0.22, reach_tol=0.012, close_steps=1,
             press_depth=0.02, suction_height=0.03)
    e.update(changes)
    return e


def _demos(episodes: int) -> Dict[str, Any]:
    """Scripted demonstrations with 2 cm of action noise executed and the noise-free actions as labels (DART):
    the demos then cover the states a slightly wrong policy reaches, and show the way back."""
    return dict(episodes=episodes, noise=0.02, clean_labels=True, seed=0, expert=_expert())


_CONDITIONS = ["in_distribution", "ood_table_height"]
_ALL_CONDITIONS = _CONDITIONS + ["ood_large_distractors", "ood_light"]


def _recipe(preset: str) -> Dict[str, Any]:
    if preset == "default":
        # 64x64 camera, 8x8 tokens, 2000 demos, 6000 steps: 2-D policies of this recipe (seed 0, two demo
        # sets) succeeded in 97 and 79 of 100 in-distribution episodes. Fewer demos over-fit (300 demos: 48 % at
        # 2000 steps, 41 % at 4000), fewer steps under-fit (2000 demos at 2000 steps: 8 of 50). The depth lift
        # starts at 8 coordinate units per metre: a patch of 8 px spans ~0.12 m at the table (~0.9 m from the
        # camera, 60 degree field of view), so z then moves like y and x.
        return dict(demos=_demos(episodes=2000), env={},
                    policy=_policy(), train=_train(steps=6000), finetune=dict(steps=800, warmup_steps=50),
                    pe_2d="circulant", pe_3d="circulant", pe_options={"block_size": 16}, arms=list(ARMS),
                    seeds=[0, 1, 2], depth_scale=8.0, conditions=list(_ALL_CONDITIONS), eval_episodes=100,
                    eval_seed=1000)
    if preset == "gpu":
        # 128x128 camera, 16x16 tokens (a patch spans half as much, so 16 units per metre), width 192 with 6 blocks
        # of 4 heads, the CPU recipe's 2000 demos and 6000 steps at twice the batch; sized for the 12 policies
        # and 2400 evaluation episodes in about 30 minutes on one GPU -- an estimate, not measured.
        return dict(demos=_demos(episodes=2000), env={"image_size": 128},
                    policy=_policy(vit_overrides=_backbone(embed_dim=192, depth=6, num_heads=4, mlp_ratio=4.0)),
                    train=_train(steps=6000, batch_size=128, warmup_steps=300),
                    finetune=dict(steps=2400, warmup_steps=100), pe_2d="circulant", pe_3d="circulant",
                    pe_options={"block_size": 16}, arms=list(ARMS), seeds=[0, 1, 2], depth_scale=16.0,
                    conditions=list(_ALL_CONDITIONS), eval_episodes=100,
                    eval_seed=1000)
    # quick: 32x32 camera, a 1-block encoder, a few demos, steps and episodes -- the study's machinery in seconds
    return dict(demos=_demos(episodes=3), env={"max_steps": 6, "image_size": 32},
                policy=_policy(vit_overrides=_backbone(depth=1, patch_size=16, embed_dim=48, num_heads=1),
                               hidden_dim=64, cond_dim=64, num_blocks=1, num_inference_steps=2),
                train=_train(steps=4, batch_size=8, warmup_steps=1, noise_samples=1, log_every=2,
                             only_successful=False),  # 6-step demos rarely succeed
                finetune=dict(steps=2, warmup_steps=1, log_every=1), pe_2d="circulant", pe_3d="circulant",
                pe_options={"block_size": 8}, arms=list(ARMS), seeds=[0], depth_scale=8.0,
                conditions=list(_CONDITIONS), eval_episodes=2, eval_seed=1000)


RECIPES: Dict[str, Dict[str, Any]] = {preset: _recipe(preset) for preset in PRESETS}


def check_recipe(r: Dict[str, Any], where: str = "robot recipe") -> Dict[str, Any]:
    """Raise ``ValueError`` (one line naming the fields) unless ``r`` states every field and no other.

    Returns ``r`` unchanged.
    """
    check_fields(where, r, set(TOP_FIELDS), "robot recipe fields", "see ropekit_studies.recipes.robot")
    check_fields(f"{where}: demos", r["demos"], {"episodes", "noise", "clean_labels", "seed", "expert"},
                  "demo fields", "episodes, noise, clean_labels, seed, expert")
    check_fields(f"{where}: demos.expert", r["demos"]["expert"], expert_fields(), "ScriptedExpert settings",
                  "state every ScriptedExpert argument except env, noise, seed and belief_offset")
    check_fields(f"{where}: policy", r["policy"], policy_fields(), "PolicyConfig fields",
                  f"state every PolicyConfig field except {', '.join(sorted(PER_ARM_POLICY))}")
    check_fields(f"{where}: policy.vit_overrides", r["policy"]["vit_overrides"], backbone_fields(),
                  "backbone fields", "state every ViTConfig field except the data's and the encoding's")
    check_fields(f"{where}: train", r["train"], train_fields(), "PolicyTrainConfig fields",
                  "state every PolicyTrainConfig field except seed and num_threads")
    bad = sorted(set(r["finetune"]) - train_fields())
    if bad:
        raise ValueError(f"{where}: finetune has fields that are not PolicyTrainConfig fields: {', '.join(bad)}")
    unknown = sorted(set(r["arms"]) - set(ARMS))
    if unknown or "2d" not in r["arms"]:
        raise ValueError(f"{where}: arms must include 2d and be among {', '.join(ARMS)}; got {r['arms']}")
    return r


def recipe(preset: str = "default") -> Dict[str, Any]:
    """A deep copy of the robot recipe at ``preset`` (checked complete).

    Raises:
        ValueError: unknown preset, or an incomplete recipe.
    """
    return preset_copy(RECIPES, preset, check_recipe, "robot")
