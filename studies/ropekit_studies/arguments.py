"""The options of ``ropekit experiment``: its argument parser (:func:`add_arguments`), also used to read the commands
that committed studies recorded, and the configuration overrides the options give (:func:`overrides`).

Every option defaults to the study's pinned recipe (:mod:`ropekit_studies.recipes`); an option given
overrides it.
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, List

from ropekit.classification.config import parse_key_values
from .registry import STUDIES

__all__ = ["add_arguments", "overrides", "OPTION_FIELDS", "STUDY_OPTIONS"]

S = argparse.SUPPRESS


def _list(text: str) -> List[str]:
    return [t for t in text.replace(",", " ").split() if t]


def _numbers(text: str, kind: type, what: str) -> list:
    try:
        return [kind(t) for t in _list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}") from None


def _floats(text: str) -> List[float]:
    return _numbers(text, float, "numbers")


def _ints(text: str) -> List[int]:
    return _numbers(text, int, "integers")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = "Run an experiment study: train (or reuse cached runs of) the same backbone for each " \
                    "encoding and seed, then write CSV/JSON, a markdown table and one PNG into --out.\n\nstudies:\n" + \
                    "\n".join(f"  {name:<17} {s.help}" for name, s in STUDIES.items()) + \
                    "\n  all               every study above, one after the other (--out is then a parent folder)" \
                    "\n  verify FOLDER     re-run a sample (--sample 2x2, or --pe / --seeds) of a committed study " \
                    "folder and\n                    say, reading by reading, whether the re-run keeps it (exit 1 " \
                    "if not)"
    p.epilog = ("Examples: `ropekit experiment offset --quick`; `ropekit experiment classify --pe mixed,cayley "
                "--seeds 0,1,2 --out results/classify`. Trained runs are cached in --cache-dir by a hash of their "
                "configuration, so studies that need the same models train them once.")
    p.add_argument("name", choices=list(STUDIES) + ["all", "verify"], metavar="NAME", help="the study (see above)")
    p.add_argument("folder", nargs="?", default=None, metavar="FOLDER",
                   help="verify: the committed study folder (with its config.json and CSV)")
    p.add_argument("--quick", action="store_true", help="tiny model, 10%% of the data, 1 epoch, 1 seed, 2-3 encodings "
                                                        "(the same as --preset quick)")
    p.add_argument("--preset", choices=("default", "gpu", "quick"), default=None,
                   help="the study's pinned recipe: default (2-core CPU, under 30 min per study), gpu (larger model, "
                        "more steps and seeds, under 30 min on one GPU) or quick")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="output folder (default runs/experiments/NAME); one that holds files is refused unless "
                        "--overwrite")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the results in an --out folder that holds some (trained runs still come from the "
                        "cache)")
    p.add_argument("--cache-dir", metavar="DIR", default=S,
                   help="trained runs, reused by every study that needs them (default .cache/ropekit-experiments "
                        "under the current directory; the path is printed at the end)")
    p.add_argument("--pe", type=_list, metavar="LIST", default=S,
                   help="encodings, comma-separated (default: the study's list; none, absolute, axial, mixed, "
                        "cayley, circulant, liere, liere-commute, comrope-ap, comrope-ld)")
    p.add_argument("--seeds", type=_ints, metavar="LIST", default=S, help="seeds, comma-separated (default 0,1,2)")
    d = p.add_argument_group("data and backbone (shared by every run of the study)")
    d.add_argument("--data", default=S, help="dataset (default mnist; video: moving-digits)")
    d.add_argument("--data-root", metavar="PATH", default=S)
    d.add_argument("--data-opt", metavar="KEY=VALUE", action="append", default=S, help="dataset option (repeatable)")
    d.add_argument("--image-size", type=int, metavar="N", default=S, help="training image size")
    d.add_argument("--train-fraction", type=float, metavar="F", default=S, help="fraction of the training set")
    d.add_argument("--model", default=S, help="ViT size preset (tiny, small, base), then --model-opt overrides")
    d.add_argument("--model-opt", metavar="KEY=VALUE", action="append", default=S,
                   help="ViTConfig field, e.g. embed_dim=64 (repeatable; replaces the preset's width/depth/heads)")
    d.add_argument("--patch-size", type=int, metavar="P", default=S)
    d.add_argument("--tubelet-size", type=int, metavar="T", default=S)
    o = p.add_argument_group("schedule")
    o.add_argument("--epochs", type=int, default=S)
    o.add_argument("--batch-size", type=int, default=S)
    o.add_argument("--lr", type=float, default=S)
    o.add_argument("--weight-decay", type=float, default=S)
    o.add_argument("--warmup-epochs", type=float, default=S)
    o.add_argument("--augment-shift", type=int, metavar="PIXELS", default=S)
    o.add_argument("--set", metavar="KEY=VALUE", action="append", default=S,
                   help="any other TrainConfig field for every run (repeatable)")
    e = p.add_argument_group("evaluation and running")
    e.add_argument("--eval-limit", type=int, metavar="N", default=S, help="evaluate on the first N test examples")
    e.add_argument("--threads", type=int, default=S, help="torch CPU threads (default 1)")
    e.add_argument("--no-progress", dest="progress", action="store_false", default=S, help="no progress bars")
    s = p.add_argument_group("study options")
    for flag, parse, dest, text in STUDY_OPTIONS:
        s.add_argument(flag, dest=dest, type=parse, metavar="LIST", default=S, help=text)
    v = p.add_argument_group("verify")
    v.add_argument("--sample", default="2x2", metavar="AxS",
                   help="verify: the first A arms (encodings) and S seeds of the committed study, unless --pe / "
                        "--seeds name them (default 2x2)")
    v.add_argument("--metric", default="test_acc", metavar="LIST",
                   help="verify: the CSV columns compared, comma-separated (default test_acc)")
    v.add_argument("--report", metavar="FILE", default=None, help="verify: also write the markdown report here")
    v.add_argument("--rerun", metavar="FOLDER", default=None,
                   help="verify: compare this study folder, re-run before (e.g. a kept --out), instead of training")
    s.add_argument("--canvas-pad", type=int, metavar="PATCHES", default=S,
                   help="exact-vs-relaxed: background border of the evaluation canvas, in patches per side (default 2)")
    s.add_argument("--factor", type=int, metavar="N", default=S,
                   help="resolution-finetune: the fine-tuning image size over the training size (default 2)")


#: The options of single studies: (flag, parser of the comma list, namespace name, help).
STUDY_OPTIONS = (
    ("--rhos", _floats, "rhos", "offset: std of the global offset, in patches (default 0,0.5,1,2,4,8)"),
    ("--cls-pe", _list, "cls_pe", "offset: encodings also trained with an unrotated and a centroid CLS token "
                                  "(default mixed)"),
    ("--sizes", _ints, "sizes", "resolution: evaluation image sizes (default: training size -2..+3 patches)"),
    ("--fractions", _floats, "fractions", "data-efficiency: fractions of the training set (default 0.1,0.25,0.5,1)"),
    ("--deltas", _floats, "deltas", "exact-vs-relaxed: coordinate-only shifts in patches for the logit sensitivity"),
    ("--partial-planes", _ints, "partial_planes", "exact-vs-relaxed: also train relaxed STRING with only this many "
                                                  "active planes (each below head_dim / 2; default none)"),
    ("--shifts", _ints, "shifts", "exact-vs-relaxed: whole-patch shifts of the content on the canvas (default 0,1,2)"),
    ("--coord-modes", _list, "coord_modes", "resolution, classify-coords, video-coords: coordinate conventions "
                                           "trained (grid, normalized; resolution also normalized+scale)"),
    ("--grids", _ints, "grids", "native-resolution: square evaluation grids, patches per side (default 4,7,10,12,14,"
                                "21,28: 0.5x..4x a 7x7 training grid)"),
    ("--aspect-grids", _list, "aspect_grids", "native-resolution: non-square evaluation grids HxW (e.g. 5x10,10x5)"),
    ("--scalings", _list, "scalings", "native-resolution: resolution-scaling methods evaluated besides none "
                                      "(pi, ntk, yarn, cap); resolution-finetune: the methods fine-tuned with"),
    ("--trainings", _list, "trainings", "native-resolution: fixed and/or native (packed, mixed aspect ratios)"),
    ("--scale-sizes", _ints, "scale_sizes", "resolution: training image sizes of the normalized+scale convention"),
    ("--epoch-budgets", _ints, "epoch_budgets", "compute-efficiency: training lengths in epochs, each a separate "
                                                "run with its own schedule (default 2,4,6,10)"),
    ("--budgets", _list, "budgets", "data-efficiency: equal 'epochs' (always) and equal 'steps' at every fraction "
                                    "(default both)"),
    ("--groups", _list, "groups", "ablations: sharing, block, jitter (default all three)"),
    ("--sharing-pe", _list, "sharing_pe", "ablations: encodings trained with model/layer/head sharing "
                                          "(default every learnable one)"),
    ("--block-pe", _list, "block_pe", "ablations: encodings whose block size varies "
                                      "(default liere,comrope-ap,comrope-ld,circulant)"),
    ("--block-sizes", _ints, "block_sizes_", "ablations: block sizes (default 2,4,8 for LieRE/ComRoPE, 4..64 for "
                                             "Circulant; the full head dimension is always included for LieRE and "
                                             "Circulant)"),
    ("--jitter-pe", _list, "jitter_pe", "ablations: encodings trained with position jitter 0 and 1 "
                                        "(default mixed,cayley)"),
    ("--arms", _list, "arms", "scale: DEPTHxEPOCHS arms, the reference first (default 2x10,6x10,2x40,6x40: the "
                              "recipe's, three times the depth, four times the epochs, both); retrieval: vision "
                              "towers (default rgb-ape,rgbd-ape,rgbd-rope,rgbd-mixed,rgbd-circulant,rgbd-cayley,"
                              "rgb-cayley)"),
    ("--widths", _ints, "widths", "scale: embedding widths crossed with every arm, heads scaled so the head "
                                  "dimension stays the recipe's (default the recipe's width only)"),
    ("--inputs", _list, "inputs", "detect3d: rgb (ViT), rgbd (ViTD: depth as input, and as coordinate for rotary "
                                  "encodings), rgbd-channel (depth as input only), rgbd-coord (as coordinate only); "
                                  "default rgb,rgbd,rgbd-channel"),
    ("--boxes", _list, "boxes", "owl: the detectors to train, 2d and/or 3d (default both; the other kind's "
                                "finished runs are read back into the report)"),
)


_CFG_FIELDS = ("cache_dir", "pes", "seeds", "data", "data_root", "image_size", "train_fraction", "model",
               "patch_size", "tubelet_size", "epochs", "batch_size", "lr", "weight_decay", "warmup_epochs",
               "augment_shift", "eval_limit", "threads", "progress")
OPTION_FIELDS = tuple(dest for _, _, dest, _ in STUDY_OPTIONS) + ("canvas_pad", "factor")


def overrides(args: argparse.Namespace) -> Dict[str, Any]:
    """The :class:`~ropekit_studies.settings.ExperimentConfig` fields the parsed options set."""
    given = vars(args)
    out: Dict[str, Any] = {}
    for name in _CFG_FIELDS:
        key = "pe" if name == "pes" else name
        if key in given:
            out[name] = given[key]
    if "data_opt" in given:
        out["data_options"] = parse_key_values(given["data_opt"], "--data-opt")
    if "model_opt" in given:
        out["model_options"] = parse_key_values(given["model_opt"], "--model-opt")
    if "set" in given:
        out["train_options"] = parse_key_values(given["set"], "--set")
    return out
