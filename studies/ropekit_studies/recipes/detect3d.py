"""Pinned recipes of the detect3d study: every data, detector, backbone and training field, per preset.

The study's results must not change when a library default does, so a detect3d run never takes a value from
a dataclass default, a named model size or the scene generator's defaults: the recipe of each preset
(``default`` for a 2-core CPU, ``gpu`` for one GPU, ``quick`` for tests) states

* the study: ``encodings``, ``inputs``, ``seeds``, the per-encoding backbone settings ``pe_overrides`` (each
  encoding's parameter sharing as its paper trained it);
* the data: ``n_train``, ``n_test``, ``image_size``, ``scene_seed`` and ``scenes`` -- every field of
  :class:`~ropekit.detection.scenes.SceneConfig`;
* the detector: ``intrinsics``, ``box_param``, ``head_hidden`` and ``backbone`` -- every
  :class:`~ropekit.nn.ViTConfig` field except the data's (classes, channels, size, modality, frames) and the two
  each run sets (``pe``, ``depth_input``);
* ``train`` -- every :class:`~ropekit.detection.train.DetTrainConfig` field except ``seed`` (per run) and
  ``eval_batch_size`` (memory only), and ``precision``.

:func:`check_recipe` rejects a recipe with a missing or unknown field, so a field added to any of these classes
breaks the recipe tests until every preset states its value. The field checks and the preset names are those of
the classification studies (:mod:`ropekit_studies.recipes`).

>>> from ropekit_studies.recipes.detect3d import recipe
>>> r = recipe("default")
>>> r["backbone"]["embed_dim"], r["train"]["steps"]     # doctest: +SKIP
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Dict, Set

from . import DATA_FIELDS, STUDY_SHARING, PRESETS, arch, check_fields, preset_copy
from ropekit.nn.vit import ViTConfig
from ropekit.detection.scenes import SceneConfig

__all__ = ["RECIPES", "TOP_FIELDS", "backbone_fields", "train_fields", "scene_fields", "recipe", "check_recipe",
           "DEFAULT_ENCODINGS", "DEFAULT_INPUTS"]

#: APE (learned absolute), NoPE, and the rotary encodings of the STRING paper's detection table.
DEFAULT_ENCODINGS = ["absolute", "none", "axial", "mixed", "cayley", "circulant"]
#: ViT (RGB), ViTD (depth as input, and as coordinate for rotary encodings) and the ablation "depth as input
#: only" (rotary encodings; for the others it is ViTD itself).  ``rgbd-coord`` (coordinate only) is an option.
DEFAULT_INPUTS = ["rgb", "rgbd", "rgbd-channel"]

#: The fields of a recipe's top level.
TOP_FIELDS = frozenset({"encodings", "inputs", "seeds", "n_train", "n_test", "image_size", "scene_seed", "scenes",
                        "intrinsics", "box_param", "head_hidden", "backbone", "pe_overrides", "train"})
#: Backbone fields each run sets itself (from its encoding and input).
PER_RUN_BACKBONE = frozenset({"pe", "depth_input"})
#: ``DetTrainConfig`` fields that are not part of a recipe: the seed (per run) and the evaluation batch size.
NON_RECIPE_TRAIN = frozenset({"seed", "eval_batch_size"})


def backbone_fields() -> Set[str]:
    """``ViTConfig`` fields a recipe's ``backbone`` must state: all but the data's and the per-run ones."""
    return {f.name for f in dataclasses.fields(ViTConfig)} - DATA_FIELDS - PER_RUN_BACKBONE


def train_fields() -> Set[str]:
    """Fields a recipe's ``train`` section must state: ``DetTrainConfig``'s (but seed and evaluation batch size)
    and the training precision."""
    from ropekit.detection.train import DetTrainConfig

    return {f.name for f in dataclasses.fields(DetTrainConfig)} - NON_RECIPE_TRAIN | {"precision"}


def scene_fields() -> Set[str]:
    """Every :class:`SceneConfig` field (a recipe's ``scenes``)."""
    return {f.name for f in dataclasses.fields(SceneConfig)}


def check_recipe(r: Dict[str, Any], where: str = "detect3d recipe") -> Dict[str, Any]:
    """Raise ``ValueError`` (one line naming the fields) unless ``r`` states every recipe field and no other.

    Returns ``r`` unchanged.
    """
    check_fields(where, r, set(TOP_FIELDS), "detect3d recipe fields", "see ropekit_studies.recipes.detect3d")
    check_fields(f"{where}: backbone", r["backbone"], backbone_fields(), "backbone fields",
                  "state every ViTConfig field but the data's, pe and depth_input")
    check_fields(f"{where}: train section", r["train"], train_fields(), "training fields",
                  "state every DetTrainConfig field but seed and eval_batch_size, and precision")
    check_fields(f"{where}: scenes", r["scenes"], scene_fields(), "SceneConfig fields", "state every one")
    for enc, over in r["pe_overrides"].items():
        bad = sorted(set(over) - backbone_fields())
        if bad:
            raise ValueError(f"{where}: pe_overrides[{enc!r}] has fields that are not backbone fields: "
                             f"{', '.join(bad)}")
    return r


# ---------------------------------------------------------------------------------------------------------
# the recipes
# ---------------------------------------------------------------------------------------------------------


def _backbone(embed_dim: int, depth: int, num_heads: int, mlp_ratio: float, patch_size: int,
              depth_scale_init: float, drop_path_rate: float = 0.0) -> Dict[str, Any]:
    """A complete ``backbone``: the classification recipes' shared architecture fields (``arch``), then the
    position settings every run shares (mean pooling, grid coordinates, one encoding set for the model unless
    ``pe_overrides`` says otherwise)."""
    return dict(**arch(embed_dim=embed_dim, depth=depth, num_heads=num_heads, mlp_ratio=mlp_ratio,
                        drop_path_rate=drop_path_rate),
                patch_size=patch_size, pe_options={}, pe_sharing="model", per_head=False, ape="none", cls="none",
                coords="grid", jitter=0.0, coord_augment=[0.0, 1.0, 1.0],
                depth_scale_init=depth_scale_init)


def _scenes() -> Dict[str, Any]:
    """The scene distribution, every field stated (1-6 objects of 4 classes on a floor or a table, random
    camera, field of view and light; see :class:`~ropekit.detection.scenes.SceneConfig`)."""
    return dict(min_objects=1, max_objects=6, use_meshes=True, table_prob=0.5, table_height=[0.45, 0.8],
                region_half=0.4, box_side=[0.06, 0.3], cyl_radius=[0.03, 0.1], cyl_height=[0.06, 0.3],
                sphere_radius=[0.03, 0.12], duck_extent=[0.1, 0.25], cam_distance=[0.9, 1.6],
                cam_elevation=[30.0, 70.0], fov=[45.0, 70.0], target_jitter=0.05, near=0.02, far=20.0,
                min_visible_pixels=4)


def _train(**changes: Any) -> Dict[str, Any]:
    """The CPU training recipe: 2400 steps of 32 scenes (9.6 epochs of the 8000), AdamW at 1e-3 with 100 warm-up
    steps then cosine decay, Hungarian loss weights of DETR (class 1, box L1 5, corner L1 5, no-object 0.1), at
    most 4 objects per training image, Monte Carlo IoU with 512 points per box, the learning curve on 100
    held-out scenes every 100 steps.

    The schedule is sized from the pilots in ``docs/results/detect3d/schedule/``: the held-out IoU of a ViTD
    still grows with the step count (one seed: 0.20 after 300 steps, 0.28 after 1200, 0.35 after 2400, 0.38
    after 4800), 1e-3 was the best learning rate of 3e-4 ... 2e-3, and at equal cost batch 32 the best of 16, 32
    and 64 (by 0.02 or less)."""
    t = dict(steps=2400, batch_size=32, lr=1e-3, min_lr=1e-5, weight_decay=0.05, warmup_steps=100, grad_clip=1.0,
             max_train_objects=4, class_weight=1.0, box_weight=5.0, corner_weight=5.0, no_object_weight=0.1,
             iou_samples=512, iou_thresholds=[0.25, 0.5], log_every=100, val_scenes=100, precision="fp32")
    t.update(changes)
    return t


def _recipe(preset: str) -> Dict[str, Any]:
    if preset == "default":
        # 64x64 renders, 8x8 patches -> 8x8 tokens; width 96, 4 blocks of 2 heads of 48 (a multiple of 6: every
        # encoding splits evenly over 2 or 3 axes); a = 5 per metre makes z roughly isotropic with (y, x) in
        # patch units at the scenes' typical depth (a patch of 8 px at ~1.3 m spans ~0.2 m).
        return dict(encodings=list(DEFAULT_ENCODINGS), inputs=list(DEFAULT_INPUTS), seeds=[0, 1, 2],
                    n_train=8000, n_test=500, image_size=64, scene_seed=0, scenes=_scenes(), intrinsics="focal",
                    box_param="ray", head_hidden=0,
                    backbone=_backbone(embed_dim=96, depth=4, num_heads=2, mlp_ratio=2.0, patch_size=8,
                                       depth_scale_init=5.0),
                    pe_overrides=copy.deepcopy(STUDY_SHARING), train=_train())
    if preset == "gpu":
        # 128x128 renders, 8x8 patches -> 16x16 tokens; a patch now spans half the metres of a CPU-preset one,
        # so a = 10 per metre keeps z isotropic with (y, x); width 192, 6 blocks of 4 heads of 48, MLP ratio 4
        # (~72x the FLOPs of a CPU-preset image); twice the training scenes and twice the images seen of the CPU
        # preset, in 1200 steps of 128 (in the CPU pilots the held-out IoU followed the images seen, not the batch
        # size: 16, 32 and 64 at equal images within 0.02); bf16 autocast (rotations stay fp32). Not timed on a GPU.
        return dict(encodings=list(DEFAULT_ENCODINGS), inputs=list(DEFAULT_INPUTS), seeds=[0, 1, 2],
                    n_train=16000, n_test=500, image_size=128, scene_seed=0, scenes=_scenes(), intrinsics="focal",
                    box_param="ray", head_hidden=0,
                    backbone=_backbone(embed_dim=192, depth=6, num_heads=4, mlp_ratio=4.0, patch_size=8,
                                       depth_scale_init=10.0, drop_path_rate=0.1),
                    pe_overrides=copy.deepcopy(STUDY_SHARING),
                    train=_train(steps=1200, batch_size=128, warmup_steps=100, log_every=100, val_scenes=200,
                                 precision="bf16"))
    # quick: 32x32 renders, 4x4 tokens, 1 block, 3 steps -- the study's machinery in seconds
    return dict(encodings=["none", "cayley"], inputs=list(DEFAULT_INPUTS), seeds=[0], n_train=32, n_test=8,
                image_size=32, scene_seed=0, scenes=_scenes(), intrinsics="focal", box_param="ray", head_hidden=0,
                backbone=_backbone(embed_dim=48, depth=1, num_heads=1, mlp_ratio=2.0, patch_size=8,
                                   depth_scale_init=5.0),
                pe_overrides=copy.deepcopy(STUDY_SHARING),
                train=_train(steps=3, batch_size=8, warmup_steps=1, log_every=1, val_scenes=4, iou_samples=256))


RECIPES: Dict[str, Dict[str, Any]] = {preset: _recipe(preset) for preset in PRESETS}


def recipe(preset: str = "default") -> Dict[str, Any]:
    """A deep copy of the detect3d recipe at ``preset`` (checked complete).

    Raises:
        ValueError: unknown preset, or an incomplete recipe.
    """
    return preset_copy(RECIPES, preset, check_recipe, "detect3d")
