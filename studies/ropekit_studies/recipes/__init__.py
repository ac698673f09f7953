"""Pinned recipes: the complete training recipe of every study and preset, written out field by field.

A study's results must stay reproducible when a library default changes, so no run of a study inherits a
default of :class:`~ropekit.classification.TrainConfig` or :class:`~ropekit.nn.ViTConfig`. Each recipe states every
field that changes what is learned:

* ``train`` -- every ``TrainConfig`` field except the runtime ones (:data:`RUNTIME_FIELDS`: run folder, device,
  threads, bars, logging, evaluation batch size) and the two each run sets itself (``pe`` and ``seed``);
* ``train["model_options"]`` -- every architecture field of ``ViTConfig`` that ``TrainConfig`` does not carry
  itself (:func:`architecture_fields`: width, depth, heads, MLP ratio, biases, dropout rates, tubelet...), so the
  named model size and the dataclass defaults are never consulted;
* ``study`` -- the encodings, seeds, evaluation subset, the per-encoding settings (``pe_overrides``, e.g. each
  encoding's parameter sharing as its paper trained it) and the study's own options (shifts, sizes, fractions).

A recipe with a missing or unknown field is an error (:func:`check_recipe`), so a field added to either
dataclass breaks the recipe tests until every recipe states its value. Three presets per study:
``default`` (2-core CPU, under 30 minutes per study), ``gpu`` (a larger model, more steps and seeds, under
30 minutes on one GPU) and ``quick`` (seconds; tests and CI).

>>> from ropekit_studies.recipes import recipe, experiment_config
>>> r = recipe("classify", "default")
>>> cfg = experiment_config("classify", "default")
>>> tcfg = cfg.train_config("mixed", 0)          # every field from the recipe, none from a default
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from ropekit.nn.vit import PAPER_SHARING, ViTConfig
from ropekit.classification import DataConfig
from ropekit.train.upgrade import ADDED, FLAT_FIELDS, flatten, upgrade_architecture, upgrade_config
from ..arguments import OPTION_FIELDS, STUDY_OPTIONS, add_arguments
from ..registry import STUDIES
from ..runs import canonical_pe_options
from ..settings import DEFAULT_PES, QUICK_PES, SCALE_PES, ExperimentConfig

__all__ = ["PRESETS", "RECIPES", "RUNTIME_FIELDS",
           "PER_RUN_FIELDS", "DATA_FIELDS", "recipe", "check_recipe", "architecture_fields", "recipe_fields",
           "experiment_config", "compare_with_committed", "recipe_names", "STUDY_CLAIMS",
           "arch", "check_fields", "SLOTS"]

PRESETS = ("default", "gpu", "quick")

#: ``TrainConfig`` fields that do not change what is learned (never part of a recipe).
RUNTIME_FIELDS = frozenset({"out", "progress", "tensorboard", "threads", "device", "eval_batch_size", "compile",
                            "log_every", "checkpoint_every"})
#: Set by each run of a study, not by the recipe.
PER_RUN_FIELDS = frozenset({"pe", "seed"})
#: ``ViTConfig`` fields that come from the dataset (classes, channels, size, modality, frames).
DATA_FIELDS = frozenset({"num_classes", "in_chans", "image_size", "modality", "num_frames"})

#: ``ExperimentConfig`` slots that hold a ``TrainConfig`` field of the same name; the rest go to ``train_options``.
SLOTS = ("data", "data_root", "data_options", "image_size", "split_seed", "train_fraction", "model",
          "model_options", "patch_size", "tubelet_size", "epochs", "batch_size", "lr", "weight_decay",
          "warmup_epochs", "augment_shift")
_STUDY_KEYS = {"pes", "seeds", "eval_limit", "pe_overrides", "options"}


def architecture_fields() -> Set[str]:
    """``ViTConfig`` fields a recipe must pin in ``model_options``: all but the dataset's and those
    ``TrainConfig`` carries itself (``tubelet_size`` included: it is passed on only for video)."""
    train = set(FLAT_FIELDS) - {"tubelet_size"}
    return {f.name for f in dataclasses.fields(ViTConfig)} - DATA_FIELDS - train


def recipe_fields() -> Set[str]:
    """``TrainConfig`` fields a recipe's ``train`` section must hold."""
    return set(FLAT_FIELDS) - RUNTIME_FIELDS - PER_RUN_FIELDS


def preset_copy(recipes: Dict[str, Dict[str, Any]], preset: str, check: Any, what: str) -> Dict[str, Any]:
    """A deep copy of ``recipes[preset]`` passed through ``check(recipe, where)``; ``ValueError`` for an unknown
    preset (the shared lookup of the studies that keep their own recipe tables: detect3d, robot)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
    return check(copy.deepcopy(recipes[preset]), f"{what} recipe {preset}")


def check_fields(what: str, given: Dict[str, Any], expected: set, kind: str, hint: str) -> None:
    """One-line ``ValueError`` naming the fields of ``expected`` missing from ``given`` and those it should not hold."""
    missing = sorted(expected - set(given))
    unknown = sorted(set(given) - expected)
    if missing or unknown:
        parts = ([f"misses {', '.join(missing)}"] if missing else []) + \
                ([f"has fields that are not {kind}: {', '.join(unknown)}"] if unknown else [])
        raise ValueError(f"{what} " + "; ".join(parts) + f" ({hint})")


def check_recipe(r: Dict[str, Any], where: str = "recipe") -> Dict[str, Any]:
    """Raise ``ValueError`` (one line naming the fields) unless ``r`` states every recipe field and no other.

    Returns ``r`` unchanged.
    """
    if set(r) != {"train", "study"}:
        raise ValueError(f"{where}: a recipe has exactly the sections train and study, got {sorted(r)}")
    train = r["train"]
    check_fields(f"{where}: train section", train, recipe_fields(), "recipe fields",
                  "state every TrainConfig field except the runtime ones, pe and seed")
    check_fields(f"{where}: model_options", train["model_options"], architecture_fields(), "architecture fields",
                  "state every ViTConfig architecture field")
    bad = sorted(set(r["study"]) - _STUDY_KEYS)
    if bad or not {"pes", "seeds", "eval_limit", "pe_overrides", "options"} <= set(r["study"]):
        raise ValueError(f"{where}: study section must hold exactly {', '.join(sorted(_STUDY_KEYS))}; "
                         f"got {', '.join(sorted(r['study']))}")
    return r


# ---------------------------------------------------------------------------------------------------------
# the recipes
# ---------------------------------------------------------------------------------------------------------

#: The rotary encodings the studies compare.
STUDY_ROTARY_PES = ("axial", "mixed", "cayley", "circulant", "liere", "liere-commute", "comrope-ap", "comrope-ld")
#: Where the studies' sharing departs from the papers' (``ropekit.nn.PAPER_SHARING``, the one table of how each
#: paper trained its encoding): ComRoPE's paper (Table 7) has one set per layer and head, the committed studies
#: trained it with one set for the whole model (the sharing ablation trains the paper's arm).
STUDY_SHARING_CHANGES: Dict[str, str] = {"comrope-ap": "model", "comrope-ld": "model"}
#: The recipes' per-encoding sharing: ``ropekit.nn.PAPER_SHARING`` with :data:`STUDY_SHARING_CHANGES` --
#: RoPE-Mixed per layer and head, the STRING family per layer (heads share), LieRE one set for the whole model,
#: ComRoPE one set for the model.
STUDY_SHARING: Dict[str, Dict[str, Any]] = {
    pe: {"pe_sharing": STUDY_SHARING_CHANGES.get(pe, PAPER_SHARING[pe])} for pe in STUDY_ROTARY_PES}
# The comparison is DEFAULT_PES (no position, learned absolute, every rotary preset above), the quick preset
# QUICK_PES and the scale study SCALE_PES, all from settings, where the studies take their defaults.
#: Video on the CPU: the comparison without the second LieRE and ComRoPE variants (30 epochs per run).
VIDEO_PES = ["none", "absolute", "axial", "mixed", "cayley", "circulant", "liere", "comrope-ap"]


#: The architecture fields every recipe shares (each preset adds its width, depth, heads, MLP ratio and drop-path
#: rate). A field added to ``ViTConfig`` is stated here once (and in ``ropekit.train.upgrade.ADDED_MODEL`` with the
#: value committed recipes that predate it trained with).
_ARCH = dict(qkv_bias=True, drop_rate=0.0, attn_drop_rate=0.0, pe_fold_train=True, num_kv_heads=None,
             resolution_scaling={})


def arch(embed_dim: int, depth: int, num_heads: int, mlp_ratio: float, drop_path_rate: float = 0.0,
          tubelet_size: int = 2, **changes: Any) -> Dict[str, Any]:
    """A complete ``model_options``: the size given here, :data:`_ARCH` for the rest, with ``changes`` to it
    (e.g. ``num_kv_heads=1``)."""
    unknown = sorted(set(changes) - set(_ARCH))
    if unknown:
        raise ValueError(f"arch: {', '.join(unknown)} are not fields of _ARCH")
    return dict(embed_dim=embed_dim, depth=depth, num_heads=num_heads, mlp_ratio=mlp_ratio,
                drop_path_rate=drop_path_rate, tubelet_size=tubelet_size,
                **copy.deepcopy({**_ARCH, **changes}))


#: The streamed-data fields (augmentation, evaluation crop, loader processes) at their defaults: the studies train
#: on in-memory sets, which refuse any other value.
_STREAM_DEFAULTS = {k: getattr(DataConfig(), k) for k in DataConfig.STREAM_ONLY}


def _mnist(**changes: Any) -> Dict[str, Any]:
    """The MNIST classification recipe of the CPU preset (7x7 tokens of 4x4 pixels), every field stated."""
    train = dict(
        data="mnist", data_root=None, image_size=None, data_options={}, split_seed=0, normalize=True,
        train_fraction=1.0,
        model="tiny", patch_size=4, tubelet_size=None, pe_options={}, pe_sharing="model", per_head=False,
        ape="none", cls="none", coords="grid", jitter=0.0, coord_augment=[0.0, 1.0, 1.0], depth_input="auto",
        depth_scale_init=1.0, init_from=None,
        model_options=arch(embed_dim=64, depth=2, num_heads=2, mlp_ratio=2.0),
        epochs=10, batch_size=64, lr=2e-3, weight_decay=0.05, warmup_epochs=1.0, min_lr=1e-5, label_smoothing=0.0,
        grad_clip=1.0, augment_shift=0, augment_sizes=[], lr_base_batch=None, precision="fp32",
        mixup_alpha=0.0, cutmix_alpha=0.0, native_resolution=False, native_options={}, **_STREAM_DEFAULTS,
    )
    train.update(changes)
    return train


def _mnist_gpu(**changes: Any) -> Dict[str, Any]:
    """The GPU preset: a ViT of width 192, depth 6, 3 heads of 64 (7x7 tokens), 40 epochs at batch 128."""
    return _mnist(**{"model_options": arch(embed_dim=192, depth=6, num_heads=3, mlp_ratio=4.0, drop_path_rate=0.1),
                     "epochs": 40, "batch_size": 128, "lr": 1e-3, "warmup_epochs": 3.0, **changes})


def _mnist_quick(**changes: Any) -> Dict[str, Any]:
    """The quick preset: width 32, depth 1, 10 % of the training images, one epoch."""
    return _mnist(**{"model_options": arch(embed_dim=32, depth=1, num_heads=2, mlp_ratio=2.0),
                     "train_fraction": 0.1, "epochs": 1, "batch_size": 32, "warmup_epochs": 0.2, **changes})


def _study(pes: Sequence[str], seeds: Sequence[int], eval_limit: Optional[int] = None,
           pe_overrides: Optional[Dict[str, Dict[str, Any]]] = None, **options: Any) -> Dict[str, Any]:
    return {"pes": list(pes), "seeds": list(seeds), "eval_limit": eval_limit,
            "pe_overrides": copy.deepcopy(STUDY_SHARING if pe_overrides is None else pe_overrides),
            "options": options}


def _presets(study_default: Dict[str, Any], study_gpu: Dict[str, Any], study_quick: Dict[str, Any],
             train: Optional[Dict[str, Any]] = None, train_gpu: Optional[Dict[str, Any]] = None,
             train_quick: Optional[Dict[str, Any]] = None) -> Dict[str, Dict[str, Any]]:
    return {"default": {"train": _mnist(**(train or {})), "study": study_default},
            "gpu": {"train": _mnist_gpu(**(train_gpu or train or {})), "study": study_gpu},
            "quick": {"train": _mnist_quick(**(train_quick or {})), "study": study_quick}}


#: The claims each study declares before it runs: the comparisons its papers make, ``(first, second, sign, paper)``
#: read as ``first − second`` with the claimed ``sign`` (+1: first above), and the paper's own numbers. A study's
#: claims are one Holm family (:mod:`ropekit_studies.verdict`); ``docs/results/claims.md`` is generated from
#: them and the committed CSVs (:mod:`ropekit_studies.claims`). Kept beside, not inside, the recipes, so that
#: declaring a claim changes no run's configuration.
STUDY_CLAIMS: Dict[str, Tuple[Tuple[str, str, int, str], ...]] = {
    "classify": (
        ("axial", "absolute", 1, "rotary beats APE: STRING Table 1 (ImageNet) RoPE 80.18, ViT 80.04"),
        ("mixed", "absolute", 1, "rotary beats APE: STRING Table 1 RoPE-Mixed 80.86, ViT 80.04"),
        ("cayley", "absolute", 1, "rotary beats APE: STRING Table 1 Cayley 81.09, ViT 80.04"),
        ("circulant", "absolute", 1, "rotary beats APE: STRING Table 1 Circulant 81.22, ViT 80.04"),
        ("liere", "absolute", 1, "rotary beats APE: ComRoPE Table 1 at 224 px LieRE 64.36, APE 58.76"),
        ("liere-commute", "absolute", 1, "rotary beats APE: LieRE Table 1 (no number quoted here)"),
        ("comrope-ap", "absolute", 1, "rotary beats APE: ComRoPE Table 1 at 224 px AP 65.32, APE 58.76"),
        ("comrope-ld", "absolute", 1, "rotary beats APE: ComRoPE Table 1 at 224 px LD 65.49, APE 58.76"),
        ("liere", "liere-commute", 1, "LieRE Table 1 order (no number quoted here)"),
        ("liere-commute", "mixed", 1, "LieRE Table 1 order (no number quoted here)"),
        ("comrope-ld", "liere", 1, "ComRoPE Table 1 at 224 px LD 65.49, LieRE 64.36"),
        ("comrope-ld", "comrope-ap", 1, "ComRoPE Table 1 at 224 px LD 65.49, AP 65.32"),
        ("cayley", "mixed", 1, "STRING beats RoPE: STRING Table 1 Cayley 81.09, RoPE-Mixed 80.86"),
        ("circulant", "mixed", 1, "STRING beats RoPE: STRING Table 1 Circulant 81.22, RoPE-Mixed 80.86"),
        ("cayley", "axial", 1, "STRING beats RoPE: STRING Table 1 Cayley 81.09, RoPE 80.18"),
        ("circulant", "axial", 1, "STRING beats RoPE: STRING Table 1 Circulant 81.22, RoPE 80.18"),
        ("mixed", "axial", 1, "learnable beats fixed: STRING Table 1 RoPE-Mixed 80.86, RoPE 80.18"),
    ),
}


SEEDS = [0, 1, 2]
GPU_SEEDS = [0, 1, 2, 3, 4]
#: The classification, the ranking every other study is read against, has five seeds on the CPU as well: the
#: differences between its rotary encodings are below their spread over three seeds. The shuffle and offset
#: studies, which evaluate the classification's models, take the same five, and so does data efficiency (its
#: full-data runs are the classification's), whose growth of a lead on less data is a small difference too.
#: Resolution (whose grid-coordinate runs are the classification's), exact vs relaxed and video take five as well.
CLASSIFY_SEEDS = [0, 1, 2, 3, 4]
#: Resolution: grid coordinates, normalised ones, and normalised ones trained with scale augmentation (each step at
#: one image size of ``scale_sizes``: 5..9 tokens per side around the 7x7 training grid).
_RES_MODES = ["grid", "normalized", "normalized+scale"]

#: Relaxed STRING with every dimension active (``active_planes = head_dim / 2``), exact and relaxed alike, so
#: the two differ only in the commuting constraint and the free post-rotation.
_RELAXED = {"default": 16, "gpu": 32, "quick": 8}

#: Video: 4 frames of 32x32 (8 on the GPU), one digit moving in one of four directions; the label is the
#: direction, which needs motion and time order (a single frame, or shuffled frames, cannot tell left from right).
#: Tokens are single frames (tubelet 1): a two-frame tubelet would show the motion inside one token, where no
#: position encoding is needed to read it.
_VIDEO_DATA = dict(num_frames=4, labels="direction", digit_size=None, speed=[4, 8], motion="wrap",
                   num_train=2000, num_test=500, seed=None)


#: The encodings of the video study's coordinate-convention arms: the two whose papers normalise coordinates.
_VIDEO_COORD_PES = ["liere", "comrope-ap", "comrope-ld"]


def _video(preset: str) -> Dict[str, Any]:
    mo = {"default": dict(embed_dim=48, depth=2, num_heads=2, mlp_ratio=2.0),
          "gpu": dict(embed_dim=192, depth=6, num_heads=3, mlp_ratio=4.0),
          "quick": dict(embed_dim=48, depth=1, num_heads=2, mlp_ratio=2.0)}[preset]
    data = dict(_VIDEO_DATA)
    if preset == "quick":
        data.update(num_train=300, num_test=100, num_frames=4)
    if preset == "gpu":
        data.update(num_train=8000, num_test=1000, num_frames=8)
    return dict(data="moving-digits", image_size={"quick": 16}.get(preset, 32), data_options=data,
                patch_size={"quick": 4}.get(preset, 8), tubelet_size=1, train_fraction=1.0,
                model_options=arch(**mo, drop_path_rate=0.1 if preset == "gpu" else 0.0, tubelet_size=1),
                epochs={"default": 30, "gpu": 60, "quick": 1}[preset])


#: Multi-query attention (one key/value head shared by every query head) at 6 blocks, each encoding with its own
#: parameters per head: RoPE-Mixed (its paper's sharing) against Cayley-STRING per head, whose per-head basis the
#: shared key projection cannot absorb (``ropekit.nn.attention``). The multi-head counterparts are the 6-block
#: classification's RoPE-Mixed and the 6-block sharing ablation's per-head Cayley (same recipe otherwise).
_MQA_SHARING = {"mixed": {"pe_sharing": "head"}, "cayley": {"pe_sharing": "head"}}
_COMROPE_PROTOCOL_SHARING = {"comrope-ap": {"pe_sharing": "head"}, "comrope-ld": {"pe_sharing": "head"},
                             "circulant": {"pe_sharing": "layer"}}
#: The same protocol with ComRoPE's own start for normalised coordinates: random bases with entries N(0, 1)
#: (``init="normal"``, ``init_std=1``), where ``resolution-comrope`` starts ComRoPE as axial RoPE (``init="rope"``,
#: frequencies made for integer positions, which cost ComRoPE-LD 0.10 on normalised coordinates in
#: classify-coords); with APE and LieRE (one set for the model, its paper's sharing) as the other rows.
_COMROPE_PAPER_START = {**_COMROPE_PROTOCOL_SHARING,
                        "comrope-ap": {"pe_sharing": "head", "pe_options": {"init": "normal", "init_std": 1.0}},
                        "comrope-ld": {"pe_sharing": "head", "pe_options": {"init": "normal", "init_std": 1.0}},
                        "liere": {"pe_sharing": "model"}}
_COMROPE_PAPER_PES = ["comrope-ap", "comrope-ld", "circulant", "liere", "absolute"]

#: Native resolution: the native arm's loader -- token budgets 16..100 around the 7x7 training grid (4x4 to 10x10
#: squares), the aspect ratio stretched by up to 2x either way, no flip (digits), evaluation of the trainer at 7x7.
_NATIVE_OPTIONS = {
    "default": dict(seq_len=128, rows=16, min_tokens=16, max_tokens=100, eval_tokens=49, hflip=0.0, aspect=2.0),
    "gpu": dict(seq_len=256, rows=32, min_tokens=16, max_tokens=196, eval_tokens=49, hflip=0.0, aspect=2.0),
    "quick": dict(seq_len=64, rows=8, min_tokens=9, max_tokens=49, eval_tokens=49, hflip=0.0, aspect=2.0),
}
#: 0.5x..4x the 7x7 training grid (12: rope-vit's 224 -> 384 ratio), and 2:1 and 3:1 grids.
_NATIVE_STUDY = dict(grids=[4, 7, 10, 12, 14, 21, 28], aspect_grids=["5x10", "10x5", "4x12", "12x4"],
                     scalings=["none", "pi", "ntk", "yarn", "cap"], trainings=["fixed", "native"])
_NATIVE_PES = ["absolute", "axial", "mixed", "cayley", "circulant", "comrope-ld"]
#: Fine-tuning at 2x for one epoch at a quarter of the classification's peak learning rate, no warm-up.
_FINETUNE_STUDY = dict(scalings=["none", "pi", "yarn"], factor=2, finetune_epochs=1, finetune_lr=5e-4)
_FINETUNE_PES = ["axial", "mixed", "cayley", "circulant", "comrope-ld"]

RECIPES: Dict[str, Dict[str, Dict[str, Any]]] = {
    "classify": _presets(_study(DEFAULT_PES, CLASSIFY_SEEDS), _study(DEFAULT_PES, GPU_SEEDS),
                         _study(QUICK_PES, [0], 200)),
    # LieRE and ComRoPE-LD on grid and on normalised coordinates (their papers' convention), the classification's
    # recipe otherwise: the grid arms are the classification's runs.
    "classify-coords": _presets(_study(["liere", "comrope-ld"], [0, 1, 2], coord_modes=["grid", "normalized"]),
                                _study(["liere", "comrope-ld"], GPU_SEEDS, coord_modes=["grid", "normalized"]),
                                _study(["liere"], [0], 200, coord_modes=["grid", "normalized"])),
    "resolution": _presets(
        _study(["none", "absolute", "axial", "mixed", "cayley", "liere"], CLASSIFY_SEEDS, coord_modes=_RES_MODES,
               scale_sizes=[20, 24, 28, 32, 36]),
        _study(DEFAULT_PES, GPU_SEEDS, coord_modes=_RES_MODES, scale_sizes=[20, 24, 28, 32, 36]),
        _study(QUICK_PES, [0], 200, coord_modes=_RES_MODES, scale_sizes=[24, 28, 32])),
    "offset": _presets(_study(DEFAULT_PES, CLASSIFY_SEEDS, rhos=[0.0, 0.5, 1.0, 2.0, 4.0, 8.0], cls_pe=["mixed"]),
                       _study(DEFAULT_PES, GPU_SEEDS, rhos=[0.0, 0.5, 1.0, 2.0, 4.0, 8.0], cls_pe=["mixed", "cayley"]),
                       _study(QUICK_PES, [0], 200, rhos=[0.0, 0.5, 1.0, 2.0, 4.0, 8.0], cls_pe=["mixed"])),
    "shuffle": _presets(_study(DEFAULT_PES, CLASSIFY_SEEDS), _study(DEFAULT_PES, GPU_SEEDS),
                        _study(QUICK_PES, [0], 200)),
    "data-efficiency": _presets(
        _study(["absolute", "mixed", "cayley", "liere", "liere-commute"], CLASSIFY_SEEDS,
               fractions=[0.1, 0.25, 0.5, 1.0], budgets=["epochs", "steps"]),
        _study(["absolute", "mixed", "cayley", "liere"], GPU_SEEDS, fractions=[0.1, 0.25, 0.5, 1.0],
               budgets=["epochs", "steps"]),
        _study(QUICK_PES, [0], 200, fractions=[0.5, 1.0], budgets=["epochs", "steps"])),
    # separate runs of 2..10 epochs, each with its own schedule (LieRE's compute-efficiency claim)
    "compute-efficiency": _presets(
        _study(["absolute", "mixed", "cayley", "liere", "liere-commute"], SEEDS, epoch_budgets=[2, 4, 6, 10]),
        _study(["absolute", "mixed", "cayley", "liere", "liere-commute"], GPU_SEEDS, epoch_budgets=[5, 10, 20, 40]),
        _study(["absolute", "mixed"], [0], 200, epoch_budgets=[1])),
    "exact-vs-relaxed": {
        # shift augmentation of one patch; unnormalised inputs, so the zero fill of the augmentation and the
        # canvas background are both black (normalised, zero is the mean grey)
        preset: {"train": {**base["train"], "augment_shift": base["train"]["patch_size"], "normalize": False,
                           "pe_options": {"active_planes": _RELAXED[preset]}, "pe_sharing": "layer"},
                 "study": _study(["relaxed"], seeds, limit, pe_overrides={}, shifts=[0, 1, 2], canvas_pad=2,
                                 deltas=[0.25, 0.5, 1.0, 2.0])}
        for preset, base, seeds, limit in (
            ("default", {"train": _mnist()}, CLASSIFY_SEEDS, None), ("gpu", {"train": _mnist_gpu()}, GPU_SEEDS, None),
            ("quick", {"train": _mnist_quick()}, [0], 200))},
    # depth and training length one at a time, then both (the reference arm first: the recipe's own)
    "scale": _presets(_study(SCALE_PES, SEEDS, arms=[[2, 10], [6, 10], [2, 40], [6, 40]]),
                      _study(SCALE_PES, SEEDS, arms=[[6, 40], [2, 40], [6, 10], [2, 10]]),
                      _study(["absolute", "mixed"], [0], 200, arms=[[1, 1], [2, 1]])),
    # width with the head dimension fixed (the recipe's 32; the GPU preset's 64), the recipe's depth and epochs
    "scale-width": _presets(_study(["absolute", "mixed", "liere"], SEEDS, arms=[[2, 10]], widths=[32, 64, 128]),
                            _study(["absolute", "mixed", "liere"], SEEDS, arms=[[6, 40]], widths=[64, 192, 384]),
                            _study(["absolute", "mixed", "liere"], [0], 200, arms=[[1, 1]], widths=[16, 32])),
    "video": {preset: {"train": {**_mnist(), **_video(preset)}, "study": _study(pes, seeds, limit)}
              for preset, pes, seeds, limit in (("default", VIDEO_PES, CLASSIFY_SEEDS, None),
                                                ("gpu", DEFAULT_PES, GPU_SEEDS, None),
                                                ("quick", QUICK_PES, [0], None))},
    # LieRE and ComRoPE on grid and on normalised (t, y, x) coordinates (their papers' convention), the video's
    # recipe otherwise: the grid arms are the video study's runs of the same seeds.
    "video-coords": {preset: {"train": {**_mnist(), **_video(preset)},
                              "study": _study(pes, seeds, coord_modes=["grid", "normalized"])}
                     for preset, pes, seeds in (("default", _VIDEO_COORD_PES, SEEDS),
                                                ("gpu", _VIDEO_COORD_PES, GPU_SEEDS),
                                                ("quick", ["liere"], [0]))},
    "ablations": _presets(
        _study(["mixed", "cayley", "circulant", "liere", "liere-commute", "comrope-ap", "comrope-ld"], SEEDS,
               groups=["sharing", "block", "jitter"],
               sharing_pe=["mixed", "cayley", "circulant", "liere", "liere-commute", "comrope-ap", "comrope-ld"],
               block_pe=["liere", "comrope-ap", "comrope-ld", "circulant"], jitter_pe=["mixed", "cayley"]),
        _study(["mixed", "cayley", "circulant", "liere", "liere-commute", "comrope-ap", "comrope-ld"], SEEDS,
               groups=["sharing", "block", "jitter"],
               sharing_pe=["mixed", "cayley", "circulant", "liere", "liere-commute", "comrope-ap", "comrope-ld"],
               block_pe=["liere", "comrope-ap", "comrope-ld", "circulant"], jitter_pe=["mixed", "cayley"]),
        _study(["mixed", "liere", "circulant"], [0], 200, groups=["sharing", "block", "jitter"],
               sharing_pe=["mixed"], block_pe=["liere", "circulant"], jitter_pe=["mixed"])),
    # ComRoPE's Table 1 protocol: one training size, normalised coordinates perturbed by sigma in {0, 1},
    # evaluation from about 0.5x to 2x; ComRoPE per layer and head (its Table 7), Circulant per layer.
    "resolution-comrope": _presets(
        _study(["comrope-ap", "comrope-ld", "circulant"], SEEDS, pe_overrides=_COMROPE_PROTOCOL_SHARING,
               coord_modes=["normalized", "normalized+jitter"], jitter_sigma=1.0, scale_sizes=None,
               sizes=[16, 20, 24, 28, 36, 44, 56]),
        _study(["comrope-ap", "comrope-ld", "circulant"], GPU_SEEDS, pe_overrides=_COMROPE_PROTOCOL_SHARING,
               coord_modes=["normalized", "normalized+jitter"], jitter_sigma=1.0, scale_sizes=None,
               sizes=[16, 20, 24, 28, 36, 44, 56]),
        _study(["comrope-ld"], [0], 200, pe_overrides=_COMROPE_PROTOCOL_SHARING,
               coord_modes=["normalized", "normalized+jitter"], jitter_sigma=1.0, scale_sizes=None,
               sizes=[16, 28, 56])),
    "resolution-comrope-paper": _presets(
        _study(_COMROPE_PAPER_PES, SEEDS, pe_overrides=_COMROPE_PAPER_START,
               coord_modes=["normalized", "normalized+jitter"], jitter_sigma=1.0, scale_sizes=None,
               sizes=[16, 20, 24, 28, 36, 44, 56]),
        _study(_COMROPE_PAPER_PES, GPU_SEEDS, pe_overrides=_COMROPE_PAPER_START,
               coord_modes=["normalized", "normalized+jitter"], jitter_sigma=1.0, scale_sizes=None,
               sizes=[16, 20, 24, 28, 36, 44, 56]),
        _study(["comrope-ld", "absolute"], [0], 200, pe_overrides=_COMROPE_PAPER_START,
               coord_modes=["normalized"], jitter_sigma=1.0, scale_sizes=None, sizes=[16, 28])),
    # fixed-size against native-resolution training (ropekit_studies.native_resolution): the classification's
    # recipe (its fixed arms are the classification's runs of the same seeds), every test digit at 11 grids, 5 scalings
    "native-resolution": _presets(
        _study(_NATIVE_PES, SEEDS, None, **_NATIVE_STUDY, native_options=_NATIVE_OPTIONS["default"]),
        _study(_NATIVE_PES, GPU_SEEDS, None, **_NATIVE_STUDY, native_options=_NATIVE_OPTIONS["gpu"]),
        _study(["absolute", "mixed", "comrope-ld"], [0], 200, grids=[4, 7, 12, 28], aspect_grids=["5x10"],
               scalings=["none", "pi", "ntk", "yarn", "cap"], trainings=["fixed", "native"],
               native_options=_NATIVE_OPTIONS["quick"])),
    # fine-tuning at twice the size (ropekit_studies.resolution_finetune): the classification's recipe and runs,
    # then one epoch at 56 px from each with no scaling, position interpolation or YaRN in place
    "resolution-finetune": _presets(
        _study(_FINETUNE_PES, CLASSIFY_SEEDS, None, **_FINETUNE_STUDY),
        _study(_FINETUNE_PES, GPU_SEEDS, None, **_FINETUNE_STUDY),
        _study(["mixed", "cayley"], [0], 200, **_FINETUNE_STUDY)),
    "mqa": {"default": {"train": _mnist(model_options=arch(embed_dim=64, depth=6, num_heads=2, mlp_ratio=2.0,
                                                            num_kv_heads=1)),
                        "study": _study(["mixed", "cayley"], SEEDS, pe_overrides=_MQA_SHARING)},
            "gpu": {"train": _mnist_gpu(model_options=arch(embed_dim=192, depth=6, num_heads=3, mlp_ratio=4.0,
                                                            drop_path_rate=0.1, num_kv_heads=1)),
                    "study": _study(["mixed", "cayley"], GPU_SEEDS, pe_overrides=_MQA_SHARING)},
            "quick": {"train": _mnist_quick(model_options=arch(embed_dim=32, depth=1, num_heads=2, mlp_ratio=2.0,
                                                                num_kv_heads=1)),
                      "study": _study(["mixed", "cayley"], [0], 200, pe_overrides=_MQA_SHARING)}},
}


def recipe_names() -> List[str]:
    """The studies that have recipes."""
    return list(RECIPES)


def recipe(study: str, preset: str = "default") -> Dict[str, Any]:
    """A deep copy of the recipe of ``study`` at ``preset`` (checked complete).

    Raises:
        ValueError: unknown study or preset, or an incomplete recipe.
    """
    if study not in RECIPES:
        raise ValueError(f"no recipe for study {study!r}; studies with recipes: {', '.join(RECIPES)}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
    return check_recipe(copy.deepcopy(RECIPES[study][preset]), f"recipe {study}/{preset}")


def experiment_config(study: str, preset: str = "default", r: Optional[Dict[str, Any]] = None):
    """The :class:`~ropekit_studies.ExperimentConfig` of ``study`` at ``preset``, built from its recipe
    (or from ``r``): every ``TrainConfig`` field is given explicitly, so no dataclass default is used."""
    r = check_recipe(copy.deepcopy(r), f"recipe {study}/{preset}") if r is not None else recipe(study, preset)
    train = r["train"]
    slots = {k: train[k] for k in SLOTS}
    rest = {k: v for k, v in train.items() if k not in SLOTS}
    s = r["study"]
    return ExperimentConfig(pes=list(s["pes"]), seeds=list(s["seeds"]), eval_limit=s["eval_limit"],
                            train_options=rest, pe_overrides=copy.deepcopy(s["pe_overrides"]), quick=preset == "quick",
                            preset=preset, **slots)


def _selection(command: Optional[str]) -> Dict[str, Any]:
    """What a recorded ``ropekit experiment`` command chose on top of its preset's recipe: the encodings
    (``pes``) and seeds of ``--pe`` and ``--seeds`` (a subset of the recipe's lists, e.g. the seeds a lent GPU had
    time for), the architecture fields of ``--model-opt`` (``model_options``, e.g. a deeper backbone) and the
    study options given on the command line (``options``: lists, e.g. ``--groups sharing``, and single values,
    e.g. ``--factor 4``)."""
    import argparse
    import shlex

    from ropekit.classification.config import parse_key_values

    words = shlex.split(command or "")
    if words[:2] != ["ropekit", "experiment"]:
        return {}
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    args, _ = parser.parse_known_args(words[2:])
    given = vars(args)
    out: Dict[str, Any] = {key: list(given[flag]) for key, flag in (("pes", "pe"), ("seeds", "seeds"))
                           if flag in given}
    if "model_opt" in given:
        out["model_options"] = parse_key_values(given["model_opt"], "--model-opt")
    options = {dest: (list(given[dest]) if isinstance(given[dest], list) else given[dest])
               for dest in OPTION_FIELDS if dest in given}
    if options:  # e.g. --groups sharing --sharing-pe mixed,cayley: a part of the ablations; --factor 4: a variant
        out["options"] = options
    return out


def compare_with_committed(study_dir: Any, extra_args: Sequence[str] = ()) -> List[str]:
    """Differences between a study's committed ``config.json`` and what its recorded preset resolves to now.

    Compares the recipe section as a whole and, for every recorded run, each recipe field of its training
    configuration with the recipe's value (fields the study varies per run -- ``Study.varies`` -- excepted),
    and every study option the recipe states with the option the study recorded (a recorded configuration goes
    through ``ropekit.train.upgrade``: a field added since counts at the value it trained with). Encodings and seeds the
    recorded command chose with ``--pe`` / ``--seeds`` replace the recipe's lists (an error unless they are among
    them), as do list-valued study options it gave (``--groups``, ``--sharing-pe``, ...: a part of the study;
    an error unless a subset of the recipe's list, or where the recipe states no such list), single-valued ones
    it gave (``--factor``, ``--canvas-pad``: a variant of the study), and its
    ``--model-opt`` fields the recipe's architecture fields. detect3d and robot folders are
    compared by their study's own ``compare`` (:class:`~ropekit_studies.registry.Study`), as are ALOHA folders
    (one study's or a merge's, recognised by their ``ropekit robot aloha`` command or ``merged`` parts): each
    part's recorded command, with ``extra_args`` appended (options that were the preset's default when the study
    ran and that its ``commands.sh`` now states, e.g. ``--aux-weight 0``), against the configuration it resolves
    to now.
    A committed architecture without a field added to ``ViTConfig`` since is read as holding the value of
    ``ropekit.train.upgrade.ADDED_MODEL``.
    Returns one line per difference; an empty list means the committed runs are what the command trains now.
    """
    path = Path(study_dir) / "config.json"
    doc = json.loads(path.read_text())
    name, preset = doc.get("study"), doc.get("preset")
    if "merged" in doc or str(doc.get("command") or "").startswith("ropekit robot aloha"):
        return STUDIES["aloha"].compare(doc, folder=Path(study_dir).name, extra_args=tuple(extra_args))
    if name not in STUDIES or preset not in PRESETS:
        return [f"{path}: no study/preset recorded (written before recipes were pinned?)"]
    if extra_args:
        raise ValueError(f"{name}: extra command-line options are compared for ALOHA folders only")
    if STUDIES[name].compare is not None:  # its own recipe format (detect3d, robot, retrieval, owl)
        return STUDIES[name].compare(doc)
    now = recipe(name, preset)
    diffs: List[str] = []
    chosen = _selection(doc.get("command"))
    model_options = chosen.pop("model_options", {})  # --model-opt replaces the recipe's architecture fields
    unknown = sorted(set(model_options) - architecture_fields())
    if unknown:
        diffs.append(f"{name}: the command's --model-opt {', '.join(unknown)} are not architecture fields")
    now["train"]["model_options"].update(model_options)
    narrowed = chosen.pop("options", {})

    def narrows(flag: str, values: List[Any], stated: Any) -> bool:
        """Whether the command's ``values`` may replace the recipe's list ``stated``; reports why not, or the
        values outside it (which still replace it, so that the committed outputs are compared with them)."""
        if not isinstance(stated, list):
            diffs.append(f"{name}: the command's {flag} is not a list the recipe states")
            return False
        outside = [v for v in values if v not in stated]
        if outside:
            diffs.append(f"{name}: the command's {flag} {outside} are not in the recipe's {stated}")
        return True

    for key, values in chosen.items():  # --pe / --seeds narrow the recipe's lists
        if narrows("--pe" if key == "pes" else f"--{key}", values, now["study"][key]):
            now["study"][key] = values
    options = now["study"].pop("options")  # the outputs record the options the study resolved ...
    flags = {dest: flag for flag, _, dest, _ in STUDY_OPTIONS}
    for key, values in narrowed.items():  # ... of which a list the command gave narrows the recipe's list,
        if not isinstance(values, list):  # and a single value it gave replaces the recipe's
            options[key] = values
        elif narrows(flags.get(key, key), values, options.get(key)):
            options[key] = values
    now, options = json.loads(json.dumps(now)), json.loads(json.dumps(options))
    committed = copy.deepcopy(doc.get("recipe") or {})
    if "model_options" in committed.get("train", {}):
        committed["train"]["model_options"] = upgrade_architecture(committed["train"]["model_options"])
    ran = doc.get("options") or {}
    for k, v in options.items():  # ... which include every option the recipe states
        if ran.get(k, "<missing>") != v:
            diffs.append(f"{name}: option {k}: committed {ran.get(k, '<missing>')!r}, recipe {v!r}")
    added = json.loads(json.dumps(ADDED))
    for section in ("train", "study"):
        a, b = committed.get(section, {}), now[section]
        if section == "train":
            a = {**{k: v for k, v in added.items() if k in b}, **a}
        for k in sorted(set(a) | set(b)):
            if a.get(k, "<missing>") != b.get(k, "<missing>"):
                diffs.append(f"{name}: recipe {section}.{k}: committed {a.get(k, '<missing>')!r}, "
                             f"now {b.get(k, '<missing>')!r}")
    varies = set(STUDIES[name].varies) | PER_RUN_FIELDS
    base = now["train"]
    for run in doc.get("runs", []):
        tc = flatten(upgrade_config(run.get("train_config", {})))  # (fields added since: at their value then)
        if "model_options" in tc:  # a run that predates a later architecture field trained with its value
            tc["model_options"] = upgrade_architecture(tc["model_options"])
        expected = {**base, **now["study"]["pe_overrides"].get(tc.get("pe"), {})}
        if isinstance(expected.get("pe_options"), dict):  # a run records them as its key hashes them: no defaults
            expected["pe_options"] = canonical_pe_options(str(tc.get("pe", "")), expected["pe_options"])
        for k, v in expected.items():
            if k in varies and (STUDIES[name].varies_overrides
                                or k not in now["study"]["pe_overrides"].get(tc.get("pe"), {})):
                continue
            if tc.get(k, "<missing>") != v:
                diffs.append(f"{name}: run {run.get('label', run.get('key'))}: {k} = {tc.get(k, '<missing>')!r}, "
                             f"recipe {v!r}")
    return diffs
