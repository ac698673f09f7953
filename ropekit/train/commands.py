"""``ropekit train`` and ``ropekit eval``: argument parsing on top of :mod:`ropekit.classification.trainer`.

Every option defaults to "not given" (``argparse.SUPPRESS``), so the precedence is simply
``TrainConfig`` defaults < the task's defaults < ``--preset`` < ``--config FILE`` < the command line. With
``--resume`` the run folder's ``config.json`` replaces the defaults, the preset and the file. On the command line
every setting has one value: a dedicated option (``--lr 0.002``), ``--set KEY=VALUE`` and the ``--*-opt`` options
are one level, and two of them giving one setting different values is refused, naming both.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from .._errors import CommandError

__all__ = ["add_train_arguments", "run_train", "add_eval_arguments", "run_eval", "config_from_args",
           "given_fields", "fit_registered_task", "train_classification"]

S = argparse.SUPPRESS

# command-line option -> TrainConfig field (for options whose names differ or need parsing)
_KV_OPTIONS = {"pe_opt": "pe_options", "data_opt": "data_options", "model_opt": "model_options",
               "native_opt": "native_options"}


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    p.epilog = ("Examples: `ropekit train` (MNIST, ViT-tiny, Cayley-STRING); `ropekit train --pe circulant "
                "--pe-opt block_size=16 --epochs 5`; `ropekit train --data rgbd-digits --pe mixed`; "
                "`torchrun --nproc_per_node 2 -m ropekit.cli train` (DDP).")
    from ..classification.recipes import list_recipes
    from .tasks import task_names

    g = p.add_argument_group("configuration")
    g.add_argument("--task", default=S,
                   help=f"training task: {', '.join(task_names())} (default classification; other packages add "
                        f"theirs through the entry-point group ropekit.tasks). Tasks trained for a number of steps "
                        f"(detection, robot, aloha) read the run options (--out, --device, --precision, --resume, "
                        f"--seed, --threads, logging), their optimiser's and their model's, and --task-opt: "
                        f"demos / scenes files, steps=N ...; see ropekit.tasks")
    g.add_argument("--preset", metavar="NAME", default=S,
                   help=f"a training recipe to start from ({', '.join(list_recipes())}; see ropekit/classification/recipes); "
                        f"--config and command-line options override it")
    g.add_argument("--task-opt", metavar="KEY=VALUE", action="append", default=S,
                   help="an option of the task besides the TrainConfig ones, e.g. text_depth=3 for retrieval "
                        "(repeatable)")
    g.add_argument("--config", metavar="FILE", default=S,
                   help="YAML or JSON file of options (TrainConfig fields); command-line options override it "
                        "(precedence: defaults < --preset < --config < command line)")
    g.add_argument("--set", metavar="KEY=VALUE", action="append", default=S,
                   help="set any TrainConfig field, by its name or as section.key, e.g. --set weight_decay=0.1 or "
                        "--set optim.weight_decay=0.1 (repeatable; the same level as the dedicated options: "
                        "--set lr=0.01 --lr 0.002 is refused)")
    d = p.add_argument_group("data")
    d.add_argument("--data", default=S, help="dataset held in memory: mnist (default), digits, moving-digits, "
                                             "rgbd-digits, cifar10, cifar100, mnist-idx; or streamed from disk: "
                                             "imagefolder (DATA_ROOT/<class>/<image>, or its train/ and val/; "
                                             "alias folder-stream), shards (WebDataset shards of `ropekit data "
                                             "convert`)")
    d.add_argument("--data-root", "--data-dir", dest="data_root", metavar="PATH", default=S,
                   help="folder of user data (imagefolder, shards, cifar10, cifar100, mnist-idx); recorded as an "
                        "absolute path")
    d.add_argument("--image-size", "--img-size", dest="image_size", type=int, metavar="N", default=S,
                   help="resize (or generate) images at N x N (default: the data set's own size; imagefolder: the "
                        "first image's shorter side, at most 224; shards: 224)")
    d.add_argument("--data-opt", metavar="KEY=VALUE", action="append", default=S, help="dataset option (repeatable)")
    d.add_argument("--train-fraction", type=float, metavar="F", default=S,
                   help="train on this stratified fraction of the training set")
    d.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=S,
                   help="standardise the colour channels with the training set's statistics (default on)")
    d.add_argument("--workers", type=int, metavar="N", default=S,
                   help="data-loader processes decoding streamed data (default 0: in the training process)")
    d.add_argument("--allow-data-change", action="store_true", default=S,
                   help="with --resume: continue although the data's fingerprint (file list and sizes, split) "
                        "differs from the run's (recorded in config.json)")
    d.add_argument("--native-resolution", action="store_true", default=S,
                   help="train on packed batches of images at their own aspect ratio and a sampled number of tokens "
                        "(image folders, shards or in-memory sets, RGB-D too; see docs/native-resolution.md)")
    d.add_argument("--native-opt", metavar="KEY=VALUE", action="append", default=S,
                   help="native resolution option: seq_len, rows, min_tokens, max_tokens, eval_tokens, max_images, "
                        "token_drop, hflip, aspect (repeatable)")
    a = p.add_argument_group("augmentation of streamed data: imagefolder, shards (the in-memory sets use "
                             "--augment-shift)")
    a.add_argument("--crop-scale", type=float, nargs=2, metavar=("LO", "HI"), default=S,
                   help="random resized crop: area fraction range (default 0.08 1)")
    a.add_argument("--crop-ratio", type=float, nargs=2, metavar=("LO", "HI"), default=S,
                   help="random resized crop: aspect-ratio range (default 3/4 4/3)")
    a.add_argument("--hflip", type=float, metavar="P", default=S, help="horizontal flip probability (default 0.5)")
    a.add_argument("--auto-augment", metavar="POLICY", default=S,
                   help="none (default), randaugment, trivialaugment, or rand-m9-n2 style (magnitude, ops)")
    a.add_argument("--random-erasing", type=float, metavar="P", default=S,
                   help="probability of erasing a random rectangle (default 0)")
    a.add_argument("--crop-pct", type=float, metavar="F", default=S,
                   help="evaluation: resize to size / F, crop the centre (default 0.875)")
    a.add_argument("--mixup", dest="mixup_alpha", type=float, metavar="ALPHA", default=S,
                   help="MixUp Beta(ALPHA, ALPHA) on every batch, also of in-memory data (default 0: off)")
    a.add_argument("--cutmix", dest="cutmix_alpha", type=float, metavar="ALPHA", default=S,
                   help="CutMix Beta(ALPHA, ALPHA) (default 0: off; with --mixup, one of the two per batch)")
    m = p.add_argument_group("model")
    m.add_argument("--model", default=S, help="ViT size: tiny (default), small, base")
    m.add_argument("--patch-size", type=int, metavar="P", default=S,
                   help="patch size (default: a power of two, 16 from 112 px on the shorter side, 8 from 56, 4 from 16 "
                        "(32 px -> 4, 64 -> 8, 224 -> 16): 4 to 14 patches per side up to 224 px)")
    m.add_argument("--pe", default=S,
                   help="position encoding: none, axial, mixed, cayley (default), circulant, tensor, string, liere, "
                        "liere-commute, comrope-ap, comrope-ld, relaxed; or absolute / sincos (absolute embedding)")
    m.add_argument("--pe-opt", metavar="KEY=VALUE", action="append", default=S,
                   help="encoding option, e.g. block_size=8 (repeatable; see ropekit.pe_options(name))")
    m.add_argument("--per-head", action="store_true", default=S,
                   help="encoding parameters per head (the one way to ask for them; --pe-opt per_head is refused)")
    m.add_argument("--pe-sharing", default=S,
                   help="auto (as each encoding's paper: mixed per layer and head, liere one set for the model, STRING "
                        "per layer; see docs/presets.md), model (one encoding for all layers), layer, or head (short "
                        "for layer with --per-head)")
    m.add_argument("--ape", default=S, help="absolute embedding added besides the rotary one: none, learned, sincos")
    m.add_argument("--cls", default=S, help="none (mean pooling), unrotated or centroid CLS token")
    m.add_argument("--coords", default=S, help="patch coordinates: grid (indices) or normalized ([0, 1])")
    m.add_argument("--jitter", type=float, metavar="SIGMA", default=S, help="position jitter in patches (training)")
    m.add_argument("--coord-augment", type=float, nargs=3, metavar=("SHIFT", "JITTER", "RESCALE"), default=S,
                   help="coordinate augmentation in training (DINOv3, timm): per image a uniform shift in [-SHIFT, "
                        "SHIFT], a per-axis scale in [1/JITTER, JITTER] and a global scale in [1/RESCALE, RESCALE] "
                        "(log-uniform) of the patch coordinates; never at evaluation (default 0 1 1: off)")
    m.add_argument("--depth-input", default=S, help="RGB-D: auto, coord (ViTD z coordinate), channel, ignore")
    m.add_argument("--depth-scale-init", type=float, metavar="A", default=S,
                   help="RGB-D: initial a of z = a * depth + b (0 when fine-tuning a 2-D model)")
    m.add_argument("--model-opt", metavar="KEY=VALUE", action="append", default=S,
                   help="any ViTConfig field, e.g. embed_dim=128 or depth=4 (repeatable)")
    m.add_argument("--init-from", metavar="CKPT", default=S, help="initialise matching weights from a checkpoint")
    m.add_argument("--scaling", metavar="METHOD", default=S,
                   help="with --init-from at a larger image size: fine-tune with the encodings' frequencies scaled "
                        "from the extent the source run trained at to this run's, by pi (position interpolation), "
                        "ntk, yarn or cap (recorded in the run: evaluation and resume keep it)")
    o = p.add_argument_group("optimisation")
    o.add_argument("--epochs", type=int, default=S, help="epochs (default 12)")
    o.add_argument("--batch-size", type=int, default=S, help="global batch size (default 32)")
    o.add_argument("--lr", type=float, default=S, help="peak learning rate of AdamW (default 1e-3)")
    o.add_argument("--lr-base-batch", type=int, metavar="B", default=S,
                   help="scale --lr by batch size / B (linear scaling rule; default: no scaling)")
    o.add_argument("--weight-decay", type=float, default=S, help="AdamW weight decay (default 0.05)")
    o.add_argument("--warmup-epochs", type=float, default=S, help="linear warm-up, then cosine decay")
    o.add_argument("--label-smoothing", type=float, default=S)
    o.add_argument("--augment-shift", type=int, metavar="PIXELS", default=S,
                   help="random translation by up to PIXELS (default 1; 0: off)")
    o.add_argument("--grad-clip", type=float, default=S, help="gradient-norm clipping (default 0: off)")
    r = p.add_argument_group("run")
    r.add_argument("--seed", type=int, default=S, help="seed of initialisation, data order and augmentation")
    r.add_argument("--out", "--output", dest="out", metavar="DIR", default=S,
                   help="run folder (default runs/<data>-<pe>-<model>-s<seed>-<time>)")
    r.add_argument("--resume", nargs="?", const=True, metavar="RUN_DIR", default=S,
                   help="continue the run in RUN_DIR (or --out; its checkpoint.pt also names it) exactly where its "
                        "checkpoint stopped")
    r.add_argument("--allow-change", metavar="KEY[,KEY]", action="append", default=S,
                   help="with --resume: let these options differ from the run's (epochs, precision, "
                        "eval_batch_size); more epochs stretch the cosine schedule to the new total, and what ran is "
                        "recorded in config.json")
    r.add_argument("--device", default=S, help="auto, cpu, cuda, cuda:1, ... (under torchrun each process needs its "
                                               "own GPU; --device cpu runs every process on the CPU with gloo)")
    r.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=S,
                   help="autocast precision of the forward pass (fp16 with a gradient scaler; bf16 also on the CPU)")
    r.add_argument("--compile", nargs="?", const=True, metavar="BACKEND", default=S,
                   help="torch.compile the model (optionally with another backend than inductor, e.g. aot_eager)")
    r.add_argument("--threads", type=int, default=S, help="torch CPU threads per process (default: half the cores)")
    r.add_argument("--log-every", type=int, metavar="N", default=S,
                   help="read the loss guard and running loss every N steps (default 50; 1: check before every "
                        "update)")
    r.add_argument("--checkpoint-every", type=int, metavar="N", default=S,
                   help="also checkpoint every N steps inside an epoch (default 0: after each epoch and on Ctrl-C)")
    r.add_argument("--no-progress", dest="progress", action="store_false", default=S, help="no progress bar")
    r.add_argument("--no-tensorboard", dest="tensorboard", action="store_false", default=S,
                   help="no TensorBoard event files")


def config_from_args(args: argparse.Namespace, defaults: Optional[Dict[str, Any]] = None):
    """``(cfg, resume, allow_change)``: the resolved ``TrainConfig`` of a ``ropekit train`` command line, whether to
    resume, and the options ``--allow-change`` lets differ from the run's. Everything is checked (names, types,
    ranges, the device) before any data loads; a bad value raises a one-line ``ValueError``. ``defaults``: values
    that replace ``TrainConfig``'s defaults (a task's own, :attr:`~ropekit.train.tasks.TaskSpec.defaults`).

    Precedence: defaults < ``defaults`` < ``--preset`` < ``--config FILE`` < the command line; with ``--resume`` the
    run's ``config.json`` takes the place of the first four. On the command line a dedicated option, ``--set`` and
    the ``--*-opt`` options are one level: one setting given two different values there is refused, naming both.
    ``data_root`` is made absolute (resolved against the current directory) so that the run folder travels.
    """
    from ..encodings import list_pes
    from ..classification.config import DATA_CHANGE, TrainConfig, load_config_file, parse_key_values, \
        split_pending_scaling

    given: Dict[str, Any] = {k: v for k, v in vars(args).items()
                             if k not in ("command", "debug", "task", "task_opt")}
    resume = given.pop("resume", None)
    preset = given.pop("preset", None)
    config_file = given.pop("config", None)
    sets = given.pop("set", None)
    allow = [k.strip().replace("-", "_") for item in given.pop("allow_change", None) or [] for k in item.split(",")
             if k.strip()]
    if given.pop("allow_data_change", False):
        allow.append(DATA_CHANGE)
    if allow and not resume:
        raise CommandError(f"{'--allow-change' if allow != [DATA_CHANGE] else '--allow-data-change'} only applies "
                           f"with --resume")

    if preset and resume:
        raise CommandError("--preset starts a run; a resumed run keeps its own options")
    base: Dict[str, Any] = dict(defaults or {})
    if resume:
        run_dir = resume_folder(resume if isinstance(resume, str) else given.get("out") or "")
        from .run_folder import load_run

        config, _ = load_run(run_dir)
        from .upgrade import flatten

        base = flatten(TrainConfig.from_dict(config.get("train", {}), source=f"{run_dir}/config.json",
                                             strict=False).to_nested())
        base["out"] = str(run_dir)
        resume = str(run_dir)
    if preset:
        from ..classification.recipes import load_recipe

        base.update(load_recipe(preset))
    if config_file:
        base.update(load_config_file(config_file))
    # the command line: each setting once (a dedicated option, --set, or a --*-opt entry)
    spelled: Dict[str, str] = {k: f"--{k.replace('_', '-')} {_show(v)}" for k, v in given.items()}
    for key, (value, written) in _set_entries(sets).items():
        if key == "model_options" and "." in written:  # --set model.depth=4: a --model-opt entry
            opts = parse_key_values(given.get("model_opt"), "--model-opt")
            for k, v in value.items():
                if k in opts and opts[k] != v:
                    raise CommandError(f"--set {written}={_show(v)} conflicts with --model-opt {k}={_show(opts[k])}; "
                                       f"give {k} once")
            given["model_opt"] = [*(given.get("model_opt") or []), *(f"{k}={_show(v)}" for k, v in value.items())]
            continue
        if key in given and given[key] != value:
            raise CommandError(f"--set {written}={_show(value)} conflicts with {spelled[key]}; give {key} once")
        given[key], spelled[key] = value, f"--set {written}={_show(value)}"
    if "scaling" in given:  # --scaling METHOD: model_options.resolution_scaling, its scale found when the data are
        method = str(given.pop("scaling"))
        from ..encodings.scaling import SCALING_METHODS

        if method not in SCALING_METHODS or method == "none":
            raise CommandError(f"--scaling {method}: unknown method; known: "
                               f"{', '.join(m for m in SCALING_METHODS if m != 'none')}")
        if "resolution_scaling" in parse_key_values(given.get("model_opt"), "--model-opt"):
            raise CommandError("--scaling conflicts with --model-opt resolution_scaling; give one of them")
        given["model_opt"] = [*(given.get("model_opt") or []), "resolution_scaling=" + json.dumps({"method": method})]
    for opt, fld in _KV_OPTIONS.items():
        if opt in given:
            flag = f"--{opt.replace('_', '-')}"
            entries = parse_key_values(given.pop(opt), flag)
            _check_kv_spelling(flag, entries, given, spelled)
            if isinstance(given.get(fld), dict):
                clash = {k: v for k, v in entries.items() if k in given[fld] and given[fld][k] != v}
                if clash:
                    k = next(iter(clash))
                    raise CommandError(f"{flag} {k}={_show(clash[k])} conflicts with {spelled[fld]}; give {k} once")
            given[fld] = {**base.get(fld, {}), **given.get(fld, {}), **entries}
    _check_per_head(given, spelled)
    if "image_size" in given and given["image_size"] is not None and given["image_size"] < 1:
        raise CommandError(f"--image-size must be positive, got {given['image_size']}")
    merged = {**base, **given}
    if resume and given.get("out") and Path(given["out"]).resolve() != Path(resume).resolve():
        raise CommandError(f"--resume {resume} and --out {given['out']} disagree; give one of them")
    if resume:
        merged["out"] = resume
    if merged.get("data_root") is not None and (not resume or "data_root" in given):
        merged["data_root"] = str(Path(merged["data_root"]).expanduser().resolve())
    cfg = TrainConfig.from_dict(merged, source="options")
    _, request = split_pending_scaling(cfg)
    if request and not cfg.model.init_from and not resume:
        raise CommandError(f"--scaling {request.get('method')} scales from the resolution another run trained at to "
                           f"this run's: name that run with --init-from RUN")

    # cheap name checks before any data is loaded
    from ..data import list_datasets
    from ..nn.vit import ABSOLUTE_PES

    known_pe = list_pes() + list(ABSOLUTE_PES)
    if cfg.model.vit().pe.lower().replace("_", "-") not in known_pe:
        pe = cfg.model.vit().pe
        raise CommandError(f"unknown position encoding {pe!r}{_did_you_mean(pe, known_pe)}; known: "
                           f"{', '.join(known_pe)}")
    from ..data.streaming import is_stream, list_streams

    data = cfg.data.name.strip().lower().replace("_", "-")
    if data not in list_datasets() and not is_stream(data):
        known = list_datasets() + list_streams()
        raise CommandError(f"unknown dataset {cfg.data.name!r}{_did_you_mean(data, known)}; known: {', '.join(known)}")
    if cfg.data.data_root is not None and not Path(cfg.data.data_root).expanduser().exists():
        raise FileNotFoundError(f"data root not found: {cfg.data.data_root}")
    import os

    from .distributed import resolve_device

    resolve_device(cfg.run.device, world_size=int(os.environ.get("WORLD_SIZE", "1")),
                   local_rank=int(os.environ.get("LOCAL_RANK", "0")))
    return cfg, bool(resume), allow


def _set_entries(sets: Optional[List[str]]) -> Dict[str, Any]:
    """The ``--set KEY=VALUE`` entries as ``{flat name: (value, KEY as written)}``: ``KEY`` a flat ``TrainConfig``
    name (``lr``) or ``section.key`` (``optim.lr``, ``data.name``; ``model.NAME`` of another ``ViTConfig`` field is
    ``model_options``), read by the one converter (:mod:`ropekit.train.upgrade`)."""
    from ..classification.config import parse_key_values
    from .upgrade import flatten, undot

    out: Dict[str, Any] = {}
    for key, value in parse_key_values(sets, "--set").items():
        flat = flatten(undot({key: value})) if "." in key else {key: value}
        for name, v in flat.items():
            out[name] = (v, key)
    return out


def resume_folder(target: Any) -> Path:
    """The run folder ``--resume`` names: the folder itself, or a checkpoint file in it (``RUN/checkpoint.pt``).

    Raises:
        CommandError, FileNotFoundError: no folder given, or no such run (one line).
    """
    from .checkpoint import CHECKPOINT_NAME

    text = str(target)
    if not text or text == ".":
        raise CommandError("--resume needs a run folder: --resume RUN_DIR or --out RUN_DIR --resume")
    path = Path(text).expanduser()
    if path.is_file():
        if path.name != CHECKPOINT_NAME or not (path.parent / "config.json").is_file():
            raise CommandError(f"--resume {text}: a run continues from its folder's latest {CHECKPOINT_NAME}; give "
                               f"the run folder (or its {CHECKPOINT_NAME})")
        path = path.parent
    if not path.is_dir():
        raise FileNotFoundError(f"run folder not found: {text}")
    return path


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (bool, type(None), dict, list)) else str(value)


def _check_kv_spelling(flag: str, entries: Dict[str, Any], given: Dict[str, Any], spelled: Dict[str, str]) -> None:
    """A ``--pe-opt`` / ``--model-opt`` entry that is a ``TrainConfig`` setting of its own is refused, pointing to
    the option that sets it (one spelling per setting)."""
    from ..classification.config import POSITION_FIELDS

    if flag == "--pe-opt" and "per_head" in entries:
        raise CommandError("--pe-opt per_head: per-head encoding parameters are asked with --per-head (one spelling "
                           "per setting)")
    if flag == "--model-opt":
        own = sorted(set(entries) & {*POSITION_FIELDS, "patch_size", "image_size", "tubelet_size"})
        if own:
            k = own[0]
            raise CommandError(f"--model-opt {k}: {k} is set with --{k.replace('_', '-')} (one spelling per setting)")


def _check_per_head(given: Dict[str, Any], spelled: Dict[str, str]) -> None:
    """``--pe-sharing head`` is short for ``--pe-sharing layer --per-head``; with per_head false it is refused."""
    if str(given.get("pe_sharing", "")).lower() == "head" and given.get("per_head") is False:
        raise CommandError(f"{spelled['pe_sharing']} means per-head parameters, but {spelled['per_head']} says "
                           f"not; give one")


def _did_you_mean(word: str, choices: Any) -> str:
    import difflib

    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


# options whose flag is not the field's name with dashes
_FLAGS = {"mixup_alpha": "--mixup", "cutmix_alpha": "--cutmix", "progress": "--no-progress", "min_lr": "--set min_lr",
          "tensorboard": "--no-tensorboard", **{f: f"--{o.replace('_', '-')}" for o, f in _KV_OPTIONS.items()}}
# arguments of `ropekit train` that are no TrainConfig field
_NOT_FIELDS = ("command", "debug", "task", "task_opt", "resume", "preset", "config", "set", "allow_change",
               "allow_data_change")


def given_fields(args: argparse.Namespace) -> Dict[str, str]:
    """The ``TrainConfig`` fields a ``ropekit train`` command line gives (dedicated options, ``--set``, the
    ``--*-opt`` options, the keys of ``--config FILE``), each with how it was given (e.g. ``--lr``)."""
    from ..classification.config import load_config_file

    given = vars(args)
    spelled = {_KV_OPTIONS.get(k, k): _FLAGS.get(_KV_OPTIONS.get(k, k), f"--{k.replace('_', '-')}")
               for k in given if k not in _NOT_FIELDS}
    spelled.update({k: f"--set {written}" for k, (_, written) in _set_entries(given.get("set")).items()})
    if given.get("config"):
        spelled.update({k: f"{k} in --config {given['config']}" for k in load_config_file(given["config"])})
    return spelled


def _run_own_trainer(task: Any, args: argparse.Namespace, task_options: Dict[str, Any]) -> int:
    """``ropekit train --task NAME`` of a task with its own trainer (``TaskSpec.options`` set): only the options it
    reads, resumed by giving the run folder again (its trainer checks that the options are the run's)."""
    for flag, what in (("preset", "--preset (the recipes are classification's)"),
                       ("allow_change", "--allow-change"), ("allow_data_change", "--allow-data-change")):
        if flag in vars(args):
            raise CommandError(f"{what} does not apply to the {task.name} task")
    given = given_fields(args)
    for key, how in given.items():
        if key not in task.options:
            hint = " (it trains for a number of steps: --task-opt steps=N)" if key in ("epochs", "warmup_epochs") \
                else ""
            raise CommandError(f"{how} does not apply to the {task.name} task{hint}; it reads "
                               f"{', '.join(sorted(_FLAGS.get(k, '--' + k.replace('_', '-')) for k in task.options))}"
                               f" and --task-opt")
    ns = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "resume"})
    resume = getattr(args, "resume", None)
    if resume:
        folder = resume_folder(resume if isinstance(resume, str) else getattr(args, "out", ""))
        if getattr(args, "out", None) and Path(args.out).resolve() != folder.resolve():
            raise CommandError(f"--resume {resume} and --out {args.out} disagree; give one of them")
        ns.out = str(folder)
    cfg, _, _ = config_from_args(ns, defaults=dict(task.defaults))
    from .tasks import resolve

    fields = frozenset(given) | ({"out"} if resume else frozenset())
    return resolve(task.train)(cfg, task_options, resume=bool(resume), allow_change=(), given=fields)


def run_train(args: argparse.Namespace) -> int:
    from .tasks import lookup_task, resolve

    task = lookup_task(getattr(args, "task", "classification"))
    if task.command is not None:
        raise CommandError(f"task {task.name!r} is trained by `{task.command}`")
    from ..classification.config import parse_key_values

    task_options = parse_key_values(getattr(args, "task_opt", None), "--task-opt")
    if task.train is None and task_options:
        raise CommandError(f"task {task.name!r} takes no --task-opt")
    if task.options is not None:
        return _run_own_trainer(task, args, task_options)
    cfg, resume, allow = config_from_args(args, defaults=dict(task.defaults))
    if task.train is not None:
        return resolve(task.train)(cfg, task_options, resume=resume, allow_change=allow)
    return fit_registered_task(task, cfg, resume=resume)


def fit_registered_task(task: Any, cfg: Any, *, resume: bool = False) -> int:
    """``ropekit train --task NAME`` of a task that registered only its builder: ``task.build(cfg)`` (``cfg``, the
    ``TrainConfig`` of the command line) trained by the engine for ``cfg.optim.epochs`` epochs with ``cfg``'s optimiser,
    schedule and execution options in ``cfg.run.out`` (default ``runs/<task>-s<seed>``); the exit status."""
    from .distributed import DistContext
    from .engine import FitOptions, fit
    from ..classification.trainer import schedule_of

    out = Path(cfg.run.out) if cfg.run.out else Path("runs") / f"{task.name}-s{cfg.run.seed}"
    built = task.build(cfg)
    steps = getattr(built, "steps_per_epoch", None) or len(built.epoch_batches(0, DistContext()))
    res = fit(built, FitOptions(schedule_of(cfg, steps), cfg.optim.epochs, execution=cfg.run.engine_options(),
                                run_dir=out,
                                resume=resume, config_doc={"task": task.name, "train": cfg.to_nested()}))
    if res.interrupted:
        print(f"interrupted; checkpoint saved in {out}. Continue with: ropekit train --task {task.name} --resume "
              f"{out}", file=sys.stderr)
        return 130
    last = res.history[-1] if res.history else {}
    print(f"task {task.name}: " + ", ".join(f"{k} {v:.4g}" for k, v in last.items() if isinstance(v, float))
          + f"; run folder {out}")
    return 0


def train_classification(cfg: Any, task_options: Dict[str, Any], *, resume: bool = False, allow_change: Any = (),
                         **_: Any) -> int:
    """``ropekit train`` of the classification task (and ``--task native-resolution``): the exit status."""
    if task_options:
        name = "native-resolution" if cfg.data.native_resolution else "classification"
        raise CommandError(f"task {name!r} takes no --task-opt")
    if resume and _finished(cfg, allow_change):
        return 0
    from ..classification.config import plural
    from ..classification.trainer import train

    result = train(cfg, resume=resume, allow_change=allow_change)
    if not result.is_main:
        return 130 if result.interrupted else 0
    if result.interrupted:
        last = result.history[-1]["epoch"] if result.history else 0
        print(f"interrupted after {plural(last, 'complete epoch')}; checkpoint saved in {result.run_dir}. Continue with: "
              f"ropekit train --resume {result.run_dir}", file=sys.stderr)
        return 130
    f = result.final
    if f:
        print(f"test accuracy {f['test_acc']:.4f} (test loss {f['test_loss']:.4f}) after "
              f"{plural(int(f['epoch']), 'epoch')}, "
              f"{result.wall_time:.1f} s; run folder {result.run_dir}")
    return 0


def _finished(cfg: Any, allow: Any = ()) -> bool:
    """Whether the run ``--resume`` names has already done its ``cfg.optim.epochs`` epochs; if so says so on stderr
    (with its final accuracy and how to train longer). Options that differ from the run's are refused first, as
    for any resume."""
    from .checkpoint import CHECKPOINT_NAME
    from ..classification.config import DATA_CHANGE, plural
    from .run_folder import load_run
    from ..classification.trainer import resume_changes

    run = Path(cfg.run.out)
    if not (run / CHECKPOINT_NAME).is_file():
        return False
    config, ckpt = load_run(run)
    done = int(ckpt.get("epoch", 0))
    if done != cfg.optim.epochs or int(ckpt.get("step_in_epoch", 0)):
        return False
    resume_changes(config.get("train") or ckpt.get("train_config", {}), cfg, [a for a in allow if a != DATA_CHANGE])
    history = ckpt.get("history") or [{}]
    acc = history[-1].get("test_acc")
    print(f"ropekit train: run {run} already finished ({plural(done, 'epoch')} of {cfg.optim.epochs}"
          f"{f', test accuracy {acc:.4f}' if isinstance(acc, float) else ''}); nothing to do. To train longer: "
          f"ropekit train --resume {run} --epochs {done + 1} --allow-change epochs", file=sys.stderr)
    return True


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder written by `ropekit train` (or a checkpoint file)")
    p.add_argument("--image-size", type=int, metavar="N", default=None,
                   help="evaluate at N x N pixels (more or fewer patches; absolute embeddings are resized)")
    p.add_argument("--scaling", default="none", metavar="METHOD",
                   help="resolution scaling of the encoding's frequencies for a larger --image-size: position "
                        "interpolation (pi), NTK-aware (ntk), YaRN (yarn) or a low-frequency cap (cap); commuting "
                        "rotary encodings on grid coordinates, learned spectra included (docs/native-resolution.md); "
                        "s is measured from the size the encodings first trained at (for a run fine-tuned with "
                        "train --scaling, its source's), and replaces a scaling the run carries; default none: the "
                        "run's model as it is")
    p.add_argument("--offset-std", type=float, metavar="S", default=0.0,
                   help="add one random global coordinate offset per image, drawn from N(0, S^2 I) (coordinate units)")
    p.add_argument("--seed", type=int, default=0, help="seed of the offsets")
    p.add_argument("--data", default=None,
                   help="evaluate on this data set instead of the run's (its test split; classes and channels must "
                        "match the model's)")
    p.add_argument("--data-root", "--data-dir", dest="data_root", metavar="PATH", default=None,
                   help="evaluate on this folder instead of the run's: every image of an image folder (its val/ in "
                        "the train/val layout), at the run's image size; classes and channels must match")
    p.add_argument("--batch-size", type=int, default=None, help="evaluation batch size")
    p.add_argument("--device", default="auto")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run_eval(args: argparse.Namespace) -> int:
    if args.image_size is not None and args.image_size < 1:
        raise CommandError(f"--image-size must be positive, got {args.image_size}")
    if args.offset_std < 0:
        raise CommandError(f"--offset-std must be >= 0, got {args.offset_std}")
    target = Path(args.run_dir).expanduser()
    if not target.exists():
        raise FileNotFoundError(f"run folder not found: {args.run_dir}")
    if target.is_file() and target.suffix.lower() in (".json", ".yaml", ".yml", ".csv", ".png"):
        raise CommandError(f"{args.run_dir} is a file of the run, not a checkpoint: give the run folder "
                           f"({target.parent}) or its checkpoint.pt")
    from ..classification.evaluation import evaluate_run

    res = evaluate_run(args.run_dir, image_size=args.image_size, offset_std=args.offset_std, seed=args.seed,
                       batch_size=args.batch_size, device=args.device, data=args.data, data_root=args.data_root,
                       scaling=args.scaling)
    if args.json:
        print(json.dumps(res))
    else:
        if res["image_size"] is None:  # a native-resolution run, packed as it trained
            at = f"packed at native resolution, up to {res['native_tokens']} tokens per image"
        else:
            at = "x".join(map(str, res["image_size"])) + " pixels"
        on = f"{res['data_root'] or res['data']}: " if args.data or args.data_root else ""
        scaled = "" if res["scaling"] == "none" else \
            f", scaling {res['scaling']} (s {max(res['scale']):.3g})"
        print(f"{on}test_acc {res['test_acc']:.4f}  test_loss {res['test_loss']:.4f}  ({res['num_examples']} examples, "
              f"{at}, offset std {res['offset_std']:g}, pe {res['pe']}{scaled}, epoch {res['epoch']})")
    return 0
