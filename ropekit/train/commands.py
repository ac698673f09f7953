"""``ropekit train`` and ``ropekit eval``: argument parsing on top of :mod:`ropekit.train.trainer`.

Every option defaults to "not given" (``argparse.SUPPRESS``), so the precedence is simply
``TrainConfig`` defaults < ``--config FILE`` < options given on the command line. With ``--resume`` the run
folder's ``config.json`` replaces the defaults and the file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, Optional

from .._errors import CommandError

__all__ = ["add_train_arguments", "run_train", "add_eval_arguments", "run_eval", "config_from_args"]

S = argparse.SUPPRESS

# command-line option -> TrainConfig field (for options whose names differ or need parsing)
_KV_OPTIONS = {"pe_opt": "pe_options", "data_opt": "data_options", "model_opt": "model_options",
               "native_opt": "native_options"}


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    p.epilog = ("Examples: `ropekit train` (MNIST, ViT-tiny, Cayley-STRING); `ropekit train --pe circulant "
                "--pe-opt block_size=16 --epochs 5`; `ropekit train --data rgbd-digits --pe mixed`; "
                "`torchrun --nproc_per_node 2 -m ropekit.cli train` (DDP).")
    from .recipes import list_recipes
    from .tasks import task_names

    g = p.add_argument_group("configuration")
    g.add_argument("--task", default=S,
                   help=f"training task: {', '.join(task_names())} (default classification; the others name the "
                        f"command that trains them)")
    g.add_argument("--preset", metavar="NAME", default=S,
                   help=f"a training recipe to start from ({', '.join(list_recipes())}; see ropekit/train/recipes); "
                        f"--config and command-line options override it")
    g.add_argument("--task-opt", metavar="KEY=VALUE", action="append", default=S,
                   help="an option of the task besides the TrainConfig ones, e.g. text_depth=3 for retrieval "
                        "(repeatable)")
    g.add_argument("--config", metavar="FILE", default=S,
                   help="YAML or JSON file of options (TrainConfig fields); command-line options override it")
    g.add_argument("--set", metavar="KEY=VALUE", action="append", default=S,
                   help="set any TrainConfig field, e.g. --set weight_decay=0.1 (repeatable)")
    d = p.add_argument_group("data")
    d.add_argument("--data", default=S, help="dataset held in memory: mnist (default), digits, moving-digits, "
                                             "rgbd-digits, imagefolder, cifar10, cifar100, mnist-idx; or streamed "
                                             "from disk: folder-stream (DATA_ROOT/<class>/<image>, or its train/ and "
                                             "val/), shards (WebDataset shards of `ropekit data convert`)")
    d.add_argument("--data-root", metavar="PATH", default=S, help="path of user data (imagefolder, cifar*, mnist-idx)")
    d.add_argument("--image-size", type=int, metavar="N", default=S, help="resize (or generate) images at N x N")
    d.add_argument("--data-opt", metavar="KEY=VALUE", action="append", default=S, help="dataset option (repeatable)")
    d.add_argument("--train-fraction", type=float, metavar="F", default=S,
                   help="train on this stratified fraction of the training set")
    d.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=S,
                   help="standardise the colour channels with the training set's statistics (default on)")
    d.add_argument("--workers", type=int, metavar="N", default=S,
                   help="data-loader processes decoding streamed data (default 0: in the training process)")
    d.add_argument("--native-resolution", action="store_true", default=S,
                   help="train on packed batches of images at their own aspect ratio and a sampled number of tokens "
                        "(image folders or in-memory sets, RGB-D too; see docs/native-resolution.md)")
    d.add_argument("--native-opt", metavar="KEY=VALUE", action="append", default=S,
                   help="native resolution option: seq_len, rows, min_tokens, max_tokens, eval_tokens, max_images, "
                        "token_drop, hflip (repeatable)")
    a = p.add_argument_group("augmentation of streamed data (the in-memory sets use --augment-shift)")
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
    m.add_argument("--patch-size", type=int, metavar="P", default=S, help="patch size (default: ~7 patches per side)")
    m.add_argument("--pe", default=S,
                   help="position encoding: none, axial, mixed, cayley (default), circulant, tensor, string, liere, "
                        "liere-commute, comrope-ap, comrope-ld, relaxed; or absolute / sincos (absolute embedding)")
    m.add_argument("--pe-opt", metavar="KEY=VALUE", action="append", default=S,
                   help="encoding option, e.g. block_size=8 (repeatable; see ropekit.pe_options(name))")
    m.add_argument("--per-head", action="store_true", default=S, help="encoding parameters per head")
    m.add_argument("--pe-sharing", default=S,
                   help="auto (as each encoding's paper: mixed per layer and head, liere one set for the model, STRING "
                        "per layer; see docs/presets.md), model (one encoding for all layers), layer, or head")
    m.add_argument("--ape", default=S, help="absolute embedding added besides the rotary one: none, learned, sincos")
    m.add_argument("--cls", default=S, help="none (mean pooling), unrotated or centroid CLS token")
    m.add_argument("--coords", default=S, help="patch coordinates: grid (indices) or normalized ([0, 1])")
    m.add_argument("--jitter", type=float, metavar="SIGMA", default=S, help="position jitter in patches (training)")
    m.add_argument("--depth-input", default=S, help="RGB-D: auto, coord (ViTD z coordinate), channel, ignore")
    m.add_argument("--depth-scale-init", type=float, metavar="A", default=S,
                   help="RGB-D: initial a of z = a * depth + b (0 when fine-tuning a 2-D model)")
    m.add_argument("--model-opt", metavar="KEY=VALUE", action="append", default=S,
                   help="any ViTConfig field, e.g. embed_dim=128 or depth=4 (repeatable)")
    m.add_argument("--init-from", metavar="CKPT", default=S, help="initialise matching weights from a checkpoint")
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
    r.add_argument("--out", metavar="DIR", default=S,
                   help="run folder (default runs/<data>-<pe>-<model>-s<seed>-<time>)")
    r.add_argument("--resume", nargs="?", const=True, metavar="RUN_DIR", default=S,
                   help="continue the run in RUN_DIR (or --out) exactly where its checkpoint stopped")
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
    that replace ``TrainConfig``'s defaults (a task's own, :attr:`~ropekit.train.tasks.TaskSpec.defaults`)."""
    from ..encodings import list_pes
    from .config import TrainConfig, load_config_file, parse_key_values

    given: Dict[str, Any] = {k: v for k, v in vars(args).items()
                             if k not in ("command", "debug", "task", "task_opt")}
    resume = given.pop("resume", None)
    preset = given.pop("preset", None)
    config_file = given.pop("config", None)
    sets = given.pop("set", None)
    allow = [k.strip().replace("-", "_") for item in given.pop("allow_change", None) or [] for k in item.split(",")
             if k.strip()]
    if allow and not resume:
        raise CommandError("--allow-change only applies with --resume")

    if preset and resume:
        raise CommandError("--preset starts a run; a resumed run keeps its own options")
    base: Dict[str, Any] = dict(defaults or {})
    if resume:
        run_dir = Path(resume if isinstance(resume, str) else given.get("out") or "")
        if not str(run_dir) or str(run_dir) == ".":
            raise CommandError("--resume needs a run folder: --resume RUN_DIR or --out RUN_DIR --resume")
        if not run_dir.is_dir():
            raise FileNotFoundError(f"run folder not found: {run_dir}")
        from .run_folder import load_run

        config, _ = load_run(run_dir)
        base = TrainConfig.from_dict(config.get("train", {}), source=f"{run_dir}/config.json", strict=False).to_dict()
        base["out"] = str(run_dir)
    if preset:
        from .recipes import load_recipe

        base.update(load_recipe(preset))
    if config_file:
        base.update(load_config_file(config_file))
    for opt, fld in _KV_OPTIONS.items():
        if opt in given:
            given[fld] = {**base.get(fld, {}), **parse_key_values(given.pop(opt), f"--{opt.replace('_', '-')}")}
    if "image_size" in given and given["image_size"] is not None and given["image_size"] < 1:
        raise CommandError(f"--image-size must be positive, got {given['image_size']}")
    merged = {**base, **given}
    for key, value in parse_key_values(sets, "--set").items():
        merged[key] = value
    if resume and given.get("out") and isinstance(resume, str) and Path(given["out"]) != Path(resume):
        raise CommandError("--resume RUN_DIR and --out disagree; give one of them")
    if resume and isinstance(resume, str):
        merged["out"] = resume
    cfg = TrainConfig.from_dict(merged, source="options")

    # cheap name checks before any data is loaded
    from ..data import list_datasets
    from ..nn.vit import ABSOLUTE_PES

    known_pe = list_pes() + list(ABSOLUTE_PES)
    if cfg.pe.lower().replace("_", "-") not in known_pe:
        raise CommandError(f"unknown position encoding {cfg.pe!r}; known: {', '.join(known_pe)}")
    from ..data.streaming import is_stream, list_streams

    data = cfg.data.strip().lower().replace("_", "-")
    if data not in list_datasets() and not is_stream(data):
        raise CommandError(f"unknown dataset {cfg.data!r}; known: {', '.join(list_datasets() + list_streams())}")
    if cfg.data_root is not None and not Path(cfg.data_root).expanduser().exists():
        raise FileNotFoundError(f"data root not found: {cfg.data_root}")
    import os

    from .distributed import resolve_device

    resolve_device(cfg.device, world_size=int(os.environ.get("WORLD_SIZE", "1")),
                   local_rank=int(os.environ.get("LOCAL_RANK", "0")))
    return cfg, bool(resume), allow


def run_train(args: argparse.Namespace) -> int:
    from .tasks import lookup_task

    task = lookup_task(getattr(args, "task", "classification"))
    if task.command is not None:
        raise CommandError(f"task {task.name!r} is trained by `{task.command}`")
    from .config import parse_key_values

    task_options = parse_key_values(getattr(args, "task_opt", None), "--task-opt")
    if task.train is None and task_options:
        raise CommandError(f"task {task.name!r} takes no --task-opt")
    cfg, resume, allow = config_from_args(args, defaults=dict(task.defaults))
    if task.train is not None:
        return task.train(cfg, task_options, resume=resume, allow_change=allow)
    from .trainer import train

    result = train(cfg, resume=resume, allow_change=allow)
    if not result.is_main:
        return 130 if result.interrupted else 0
    if result.interrupted:
        last = result.history[-1]["epoch"] if result.history else 0
        print(f"interrupted after {last} complete epoch(s); checkpoint saved in {result.run_dir}. Continue with: "
              f"ropekit train --resume {result.run_dir}", file=sys.stderr)
        return 130
    f = result.final
    if f:
        print(f"test accuracy {f['test_acc']:.4f} (test loss {f['test_loss']:.4f}) after {int(f['epoch'])} epochs, "
              f"{result.wall_time:.1f} s; run folder {result.run_dir}")
    return 0


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder written by `ropekit train` (or a checkpoint file)")
    p.add_argument("--image-size", type=int, metavar="N", default=None,
                   help="evaluate at N x N pixels (more or fewer patches; absolute embeddings are resized)")
    p.add_argument("--offset-std", type=float, metavar="S", default=0.0,
                   help="add one random global coordinate offset per image, drawn from N(0, S^2 I) (coordinate units)")
    p.add_argument("--seed", type=int, default=0, help="seed of the offsets")
    p.add_argument("--batch-size", type=int, default=None, help="evaluation batch size")
    p.add_argument("--device", default="auto")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run_eval(args: argparse.Namespace) -> int:
    if args.image_size is not None and args.image_size < 1:
        raise CommandError(f"--image-size must be positive, got {args.image_size}")
    if args.offset_std < 0:
        raise CommandError(f"--offset-std must be >= 0, got {args.offset_std}")
    if not Path(args.run_dir).expanduser().exists():
        raise FileNotFoundError(f"run folder not found: {args.run_dir}")
    from .trainer import evaluate_run

    res = evaluate_run(args.run_dir, image_size=args.image_size, offset_std=args.offset_std, seed=args.seed,
                       batch_size=args.batch_size, device=args.device)
    if args.json:
        print(json.dumps(res))
    else:
        h, w = res["image_size"]
        print(f"test_acc {res['test_acc']:.4f}  test_loss {res['test_loss']:.4f}  ({res['num_examples']} examples, "
              f"{h}x{w} pixels, offset std {res['offset_std']:g}, pe {res['pe']}, epoch {res['epoch']})")
    return 0
