"""Open-vocabulary detection on captioned RGB-D scenes (``ropekit train --task owl``): an
:class:`~ropekit.detection.owl.OwlDetector` whose towers come from a contrastive (retrieval) run, trained on the
scenes' 2-D or 3-D boxes with the seen classes' names as text queries, and evaluated with every class's name as a
query -- AP on the classes held out of detection training (seen only in the contrastive captions) beside AP on
the seen ones.

Data (:mod:`ropekit.data.captioned`).  Scenes of MNIST digits and shapes with colours, true sizes and metric
depths; per object a class, a 2-D box (full and clipped to the image) with the visible fraction, and a 3-D box.
The text query of class ``c`` is its name, one word (``"3"``, ``"square"``).  Targets:

* 2-D: the box clipped to the image (a box outside the image is cut at its border), in normalised
  ``(cx, cy, w, h)``; objects less than ``min_visible`` visible or with a clipped box under one pixel wide or
  high are no targets (they are absent from training targets and from the evaluation's ground truth).
* 3-D: the object's 12-vector camera-frame box (same selection).
* Held-out classes (``unseen``): their objects are in the training images but not in the training targets, and
  their names are not among the training queries (OWL-ViT's protocol for LVIS rare classes); evaluation queries
  every class.

An image may have no target (every object hidden or held out): it contributes negatives only.

Metrics.  2-D: COCO ``AP``, ``AP50``, ``AP75``, ``AP_small`` / ``_medium`` / ``_large`` (area split at
``(S/6)²`` and ``(S/3)²`` pixels² for images of side ``S``, :mod:`ropekit.detection.coco`), ``AP_seen`` and
``AP_unseen`` (means of the per-class APs), from each image's top ``max_dets`` (token, query) pairs.  3-D:
``mean_iou``, the mean 3-D IoU (:func:`~ropekit.detection.box_iou_3d`, Monte Carlo) of the Hungarian-matched
pairs, every object counted (an unmatched one as 0), with every class queried; ``mean_iou_seen`` /
``mean_iou_unseen`` over the objects of each group; ``iou25``, the fraction of objects whose matched box has a 3-D
IoU above 0.25 (unmatched: not); ``depth_err`` and ``depth_err_rel``, the median over matched pairs of the error
of the box centre's depth, ``|z_pred - z_true|`` in metres and divided by ``z_true`` (whether depth was learnt:
with 2 cm cards the IoU is near 0 unless depth is right to about a centimetre, :func:`summarise_3d`).

Towers.  ``init_from`` names a run folder or checkpoint of the ``retrieval`` task (:func:`load_towers`); a
checkpoint of another task is refused with a one-line error.  With ``init_from=None`` both towers start from
scratch (the no-pretraining control): a ViT, the text transformer and their projections built from ``towers``
(:func:`~ropekit.detection.owl_towers.towers_from_config`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor, nn

from ..train import engine
from ..train.engine import seed_everything
from ..train.tasks import register_task
from .boxes import box_iou_3d
from .coco import coco_ap
from .owl import OwlDetector, OwlLossConfig, owl_loss, owl_match, top_detections
from .owl_towers import Towers, build_detector, load_towers, scratch_towers
from .plot import save_figure
from .train import batch_indices

__all__ = ["OwlTrainConfig", "OwlDataConfig", "OwlTaskConfig", "OwlTask", "OwlTargets", "owl_targets", "class_split",
           "vocabulary_names", "VOCABULARIES", "load_scenes", "build_owl_task", "train_owl", "evaluate_owl",
           "plot_owl_examples", "summarise_3d", "owl_config_from_train", "run_owl_command", "DEFAULT_UNSEEN",
           "TASK_DEFAULTS",
           "TASK_OPTIONS"]

#: Classes held out of detection training by default: two digits and a shape.
DEFAULT_UNSEEN: Tuple[str, ...] = ("7", "9", "triangle")


@dataclass
class OwlTrainConfig:
    """Optimisation and evaluation settings of one open-vocabulary detection run (saved with it)."""

    steps: int = 300
    batch_size: int = 32
    lr: float = 3e-4
    min_lr: float = 1e-5
    weight_decay: float = 0.05
    warmup_steps: int = 30
    grad_clip: float = 1.0
    class_weight: float = 2.0
    box_weight: float = 5.0
    giou_weight: float = 2.0
    corner_weight: float = 5.0
    max_dets: int = 100  # detections per image scored by the COCO AP
    iou_samples: int = 512  # Monte Carlo points per predicted 3-D box
    eval_batch_size: int = 100
    log_every: int = 25
    seed: int = 0

    def loss_config(self) -> OwlLossConfig:
        return OwlLossConfig(class_weight=self.class_weight, box_weight=self.box_weight,
                             giou_weight=self.giou_weight, corner_weight=self.corner_weight)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


@dataclass
class OwlDataConfig:
    """The captioned scenes of a run: counts, image side, objects per scene, the generation seed (training scenes
    use ``[seed, 0]``, test scenes ``[seed, 1]``, and they are drawn from disjoint MNIST digits), what a query
    names (``vocabulary``: ``"class"``, the object's class name, or ``"colour"``, its colour name), the categories
    held out of detection training (``unseen``, words of that vocabulary), the least visible fraction of an
    object that makes it a target, and whether objects are blocks as deep as their true size (``solid``: only
    the 3-D boxes change, see :class:`~ropekit.data.captioned.SceneConfig`) or 2 cm cards."""

    num_train: int = 2000
    num_test: int = 500
    image_size: int = 32
    min_objects: int = 1
    max_objects: int = 3
    shape_fraction: float = 0.4
    seed: int = 0
    unseen: Tuple[str, ...] = DEFAULT_UNSEEN
    min_visible: float = 0.25
    vocabulary: str = "class"
    solid: bool = False

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["unseen"] = list(self.unseen)
        return d


@dataclass
class OwlTaskConfig:
    """What builds an :class:`OwlTask`: ``init_from`` (a retrieval run folder or checkpoint; ``None``: towers
    from scratch, built from ``towers``, the retrieval task's configuration), ``boxes`` (``"2d"`` / ``"3d"``),
    the data and the training settings."""

    init_from: Optional[str] = None
    boxes: str = "2d"
    towers: Optional[Dict[str, Any]] = None
    data: OwlDataConfig = field(default_factory=OwlDataConfig)
    train: OwlTrainConfig = field(default_factory=OwlTrainConfig)
    head_hidden: int = 0


# --------------------------------------------------------------------------------------------- data


@dataclass
class OwlTargets:
    """Per-scene targets of a :class:`CaptionedScenes`: ``classes (N, T)`` class id (-1 padding), ``boxes2d
    (N, T, 4)`` normalised ``(cx, cy, w, h)`` of the clipped box, ``boxes3d (N, T, 12)``, ``mask (N, T)`` (the
    objects that are targets: visible enough and with a clipped box of at least one pixel)."""

    classes: Tensor
    boxes2d: Tensor
    boxes3d: Tensor
    mask: Tensor


def owl_targets(scenes: Any, min_visible: float = 0.25, vocabulary: str = "class") -> OwlTargets:
    """The :class:`OwlTargets` of ``scenes`` (a :class:`ropekit.data.captioned.CaptionedScenes`); the category of
    an object is its class or its colour (``vocabulary``).

    Boxes are clipped to the image (a box reaching outside is cut at the border); an object becomes no target
    when less than ``min_visible`` of it is seen or its clipped box is under one pixel wide or high.
    """
    H, W = scenes.images.shape[-2:]
    b = scenes.box2d_clipped.float().clone()  # (N, T, 4) xyxy pixels
    b[..., 0::2] = b[..., 0::2].clamp(0, W)
    b[..., 1::2] = b[..., 1::2].clamp(0, H)
    w, h = b[..., 2] - b[..., 0], b[..., 3] - b[..., 1]
    mask = scenes.valid.bool() & (scenes.visible >= min_visible) & (w >= 1) & (h >= 1)
    cxcywh = torch.stack([(b[..., 0] + b[..., 2]) / (2 * W), (b[..., 1] + b[..., 3]) / (2 * H), w / W, h / H], -1)
    cat = (scenes.classes if vocabulary == "class" else scenes.colours).long()
    classes = torch.where(mask, cat, torch.full_like(cat, -1))
    return OwlTargets(classes, cxcywh, scenes.box3d.float(), mask)


#: What a query names: an object's class (``"3"``, ``"square"``) or its colour (``"red"``).
VOCABULARIES = ("class", "colour")


def vocabulary_names(vocabulary: str = "class") -> Tuple[str, ...]:
    """The query words of ``vocabulary``: the captioned scenes' class names or colour names (one word each;
    a category id is an index into them)."""
    from ..data.captioned import CLASS_NAMES, COLOUR_NAMES

    if vocabulary not in VOCABULARIES:
        raise ValueError(f"vocabulary must be one of {', '.join(VOCABULARIES)}; got {vocabulary!r}")
    return CLASS_NAMES if vocabulary == "class" else COLOUR_NAMES


def class_split(unseen: Sequence[str], vocabulary: str = "class") -> Tuple[List[int], List[int]]:
    """``(seen, unseen)`` category ids of ``vocabulary``; ``ValueError`` for an unknown name or when no category
    is left to train on."""
    names = vocabulary_names(vocabulary)
    bad = [u for u in unseen if u not in names]
    if bad:
        raise ValueError(f"unknown held-out {vocabulary} {', '.join(map(repr, bad))}; known: {', '.join(names)}")
    out = [i for i, c in enumerate(names) if c in set(unseen)]
    seen = [i for i in range(len(names)) if i not in out]
    if not seen:
        raise ValueError("every class is held out: nothing is left for detection training")
    return seen, out


def load_scenes(data: OwlDataConfig) -> Tuple[Any, Any]:
    """The ``(train, test)`` :class:`~ropekit.data.captioned.CaptionedScenes` of ``data`` (test scenes show
    other MNIST digits than the training ones)."""
    from ..data._common import stratified_split
    from ..data.builtin import load_mnist5k
    from ..data.captioned import SceneConfig, make_captioned_scenes

    cfg = SceneConfig(image_size=data.image_size, min_objects=data.min_objects, max_objects=data.max_objects,
                      shape_fraction=data.shape_fraction, solid=bool(data.solid))
    images, labels = load_mnist5k(None)
    out = []
    for part, (idx, count) in enumerate(zip(stratified_split(labels, 0.2, data.seed), (data.num_train,
                                                                                       data.num_test))):
        idx = torch.from_numpy(np.asarray(idx))
        out.append(make_captioned_scenes(images[idx], labels[idx], int(count), cfg, seed=[data.seed, part]))
    return out[0], out[1]


# --------------------------------------------------------------------------------------------- the task


class OwlTask:
    """OWL-ViT's set loss on captioned scenes, for :func:`ropekit.train.engine.fit`: each step a batch of
    training scenes (:func:`~ropekit.detection.train.batch_indices`), the seen classes' names as queries, the
    seen objects as targets.  An epoch is ``cfg.log_every`` steps."""

    name = "owl"
    find_unused_parameters = True

    def __init__(self, model: OwlDetector, scenes: Any, tokenize: Callable[[List[str]], Tensor],
                 cfg: OwlTrainConfig, data: OwlDataConfig,
                 log: Optional[Callable[[Dict[str, float]], None]] = None) -> None:
        if len(scenes) == 0:
            raise ValueError("no training scenes")
        self.model, self.scenes, self.cfg, self.data, self.log = model, scenes, cfg, data, log
        names = vocabulary_names(data.vocabulary)
        self.seen, self.unseen = class_split(data.unseen, data.vocabulary)
        self.query_ids = tokenize([names[c] for c in self.seen])  # (Qs, L)
        remap = torch.full((len(names),), -1, dtype=torch.long)
        remap[torch.tensor(self.seen)] = torch.arange(len(self.seen))
        tg = owl_targets(scenes, data.min_visible, data.vocabulary)
        labels = torch.where(tg.mask, remap[tg.classes.clamp_min(0)], torch.full_like(tg.classes, -1))
        self.labels, self.mask = labels, labels >= 0  # held-out objects are no training target
        self.boxes = tg.boxes2d if model.boxes == "2d" else tg.boxes3d
        self.loss_cfg = cfg.loss_config()
        self.index = batch_indices(len(scenes), cfg)
        self.epochs = math.ceil(cfg.steps / cfg.log_every)
        self.K = scenes.K.float()
        self.towers: Optional[Towers] = None  # (set by build_owl_task)

    def epoch_batches(self, epoch: int, ctx: Any) -> List[List[int]]:
        lo, hi = epoch * self.cfg.log_every, min((epoch + 1) * self.cfg.log_every, self.cfg.steps)
        return [self.index[s][ctx.rank::ctx.world_size] for s in range(lo, hi)]

    def loss(self, model: nn.Module, batch: List[int], device: torch.device) -> Tuple[Tensor, Dict[str, float]]:
        idx = torch.as_tensor(batch, dtype=torch.long)
        x = self.scenes.images[idx].to(device)
        K = self.K.expand(len(idx), 3, 3).to(device)
        out = model(x, self.query_ids.to(device), K)
        losses = owl_loss(out["logits"], out["boxes"], self.labels[idx].to(device), self.boxes[idx].to(device),
                          self.mask[idx].to(device), self.loss_cfg)
        keys = [k for k in losses if k != "loss"]
        return losses["loss"], {"loss": float(losses["loss"].detach()),
                                **{k: float(losses[k].detach()) for k in keys}, "count": 1.0}

    def epoch_row(self, epoch: int, sums: Dict[str, float], info: Dict[str, Any], ctx: Any) -> Dict[str, float]:
        keys = sorted(sums)
        totals = dict(zip(keys, ctx.all_reduce_sum([sums[k] for k in keys])))
        count = max(totals.pop("count", 1.0), 1.0)
        row = {"step": info["global_step"], **{k: v / count for k, v in totals.items()}, "lr": info["lr"],
               "seconds": info["elapsed"]}
        if self.log is not None and ctx.is_main:
            self.log(row)
        return row

    def summary(self, history: List[Dict[str, Any]]) -> Dict[str, Any]:
        return {"steps": history[-1]["step"] if history else 0, "loss": history[-1]["loss"] if history else None}


def _towers(cfg: OwlTaskConfig) -> Towers:
    return load_towers(cfg.init_from) if cfg.init_from else scratch_towers(cfg.towers)


def _init_3d_prior(model: OwlDetector, scenes: Any, min_visible: float) -> None:
    tg = owl_targets(scenes, min_visible)
    mean = tg.boxes3d[tg.mask].mean(0) if tg.mask.any() else torch.tensor([0, 0, 3.0, 1, 0, 0, 0, 1, 0, .5, .5, .02])
    model.init_box_prior(mean)


#: ``TrainConfig`` values ``ropekit train --task owl`` starts from instead of classification's.
TASK_DEFAULTS: Dict[str, Any] = {"data": "captioned-scenes", "batch_size": 32, "lr": 2e-3, "augment_shift": 0,
                                 "grad_clip": 1.0}
#: ``--task-opt`` keys: the task's own (``init_from``, ``boxes``, ``head_hidden``), the data's (:class:`OwlDataConfig`
#: ``vocabulary``, ``unseen`` as a comma-separated string, ``min_visible``) and the schedule's (steps, warm-up,
#: logging, loss weights, ``max_dets``, ``iou_samples``).
TASK_OPTIONS = ("init_from", "boxes", "head_hidden", "vocabulary", "unseen", "min_visible", "steps", "warmup_steps",
                "log_every", "class_weight", "box_weight", "giou_weight", "corner_weight", "max_dets", "iou_samples")


def owl_config_from_train(cfg: Any, options: Dict[str, Any]) -> OwlTaskConfig:
    """The :class:`OwlTaskConfig` of a ``ropekit train --task owl`` command line: ``cfg`` (a ``TrainConfig``) gives
    the scenes (``--image-size``; ``--data-opt`` ``num_train``, ``num_test``, ``min_objects``, ``max_objects``,
    ``shape_fraction``, ``seed``, ``solid``), the seed and the optimiser (``--batch-size``, ``--lr``,
    ``--weight-decay``, ``--min-lr``, ``--grad-clip``); ``options`` (``--task-opt``) the rest, :data:`TASK_OPTIONS`.

    Raises:
        ValueError: another dataset than ``captioned-scenes``, an unknown option (one line, naming the known ones).
    """
    if cfg.data.name != "captioned-scenes":
        raise ValueError(f"the owl task trains on --data captioned-scenes, got {cfg.data.name!r}")
    bad = sorted(set(options) - set(TASK_OPTIONS))
    if bad:
        raise ValueError(f"unknown --task-opt {', '.join(bad)} for the owl task; known: {', '.join(TASK_OPTIONS)}")
    data_keys = ("num_train", "num_test", "min_objects", "max_objects", "shape_fraction", "seed", "solid")
    bad = sorted(set(cfg.data.data_options) - set(data_keys))
    if bad:
        raise ValueError(f"unknown --data-opt {', '.join(bad)} for the owl task; known: {', '.join(data_keys)}")
    size = cfg.data.image_size if cfg.data.image_size is not None else 32
    if str(cfg.data.data_options.get("solid", False)).lower() not in ("true", "false", "1", "0"):
        raise ValueError(f"--data-opt solid must be true or false, got {cfg.data.data_options['solid']!r}")
    data = OwlDataConfig(image_size=int(size if isinstance(size, int) else size[0]),
                         **{k: cfg.data.data_options[k] for k in data_keys[:-1] if k in cfg.data.data_options},
                         solid=str(cfg.data.data_options.get("solid", False)).lower() in ("true", "1"),
                         **{k: options[k] for k in ("vocabulary", "min_visible") if k in options})
    if "unseen" in options:
        data.unseen = tuple(w.strip() for w in str(options["unseen"]).split(",") if w.strip())
    elif data.vocabulary == "colour":
        data.unseen = ("purple", "cyan")
    train = OwlTrainConfig(batch_size=cfg.optim.batch_size, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay,
                           min_lr=cfg.optim.min_lr,
                           grad_clip=cfg.optim.grad_clip, seed=cfg.run.seed,
                           **{k: options[k] for k in TASK_OPTIONS[6:] if k in options})
    return OwlTaskConfig(init_from=options.get("init_from"), boxes=str(options.get("boxes", "2d")), data=data,
                         train=train, head_hidden=int(options.get("head_hidden", 0)))


def run_owl_command(cfg: Any, options: Dict[str, Any], *, resume: bool = False, allow_change: Any = ()) -> int:
    """``ropekit train --task owl``: train in ``--out`` (default ``runs/owl-<boxes>-s<seed>``), evaluate on the
    test scenes, write ``metrics.json`` and ``examples.png`` there and print the headline metrics; the exit
    status."""
    import json

    from ..train.engine import EngineOptions

    if resume:
        raise ValueError("owl runs are not resumed: start the run again (it takes minutes)")
    ocfg = owl_config_from_train(cfg, options)
    out = Path(cfg.run.out or f"runs/owl-{ocfg.boxes}-s{cfg.run.seed}")
    train_set, test_set = load_scenes(ocfg.data)
    opts = EngineOptions(device=cfg.run.device, precision=cfg.run.precision, threads=cfg.run.threads,
                         progress=cfg.run.progress,
                         tensorboard=cfg.run.tensorboard)
    model, towers, _ = train_owl(ocfg, train_set, out_dir=out, options=opts)
    metrics = evaluate_owl(model, test_set, towers.tokenize, ocfg.data, ocfg.train)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    plot_owl_examples(model, test_set, towers.tokenize, out / "examples.png", data=ocfg.data)
    keys = ("AP", "AP50", "AP_seen", "AP_unseen") if ocfg.boxes == "2d" else ("mean_iou", "mean_iou_seen",
                                                                            "mean_iou_unseen", "iou25", "depth_err")
    print("  ".join(f"{k} {metrics[k]:.4f}" for k in keys) + f"; run folder {out}")
    return 0


@register_task("owl", "open-vocabulary 2-D / 3-D boxes by text query (OWL-ViT) from a contrastive run's towers",
               config=OwlTaskConfig, defaults=TASK_DEFAULTS,
               train=lambda cfg, options, **kw: run_owl_command(cfg, options, **kw))
def build_owl_task(cfg: OwlTaskConfig, scenes: Any = None) -> OwlTask:
    """The :class:`OwlTask` of ``cfg``: towers from ``cfg.init_from`` (or scratch), the detector seeded by
    ``cfg.train.seed``, the training scenes generated from ``cfg.data`` (or ``scenes``)."""
    if cfg.boxes not in ("2d", "3d"):
        raise ValueError(f"boxes must be '2d' or '3d'; got {cfg.boxes!r}")
    class_split(cfg.data.unseen, cfg.data.vocabulary)
    towers = _towers(cfg)
    seed_everything(cfg.train.seed)
    model = build_detector(towers, cfg.boxes, cfg.head_hidden)
    train_set = scenes if scenes is not None else load_scenes(cfg.data)[0]
    if cfg.boxes == "3d":
        _init_3d_prior(model, train_set, cfg.data.min_visible)
    task = OwlTask(model, train_set, towers.tokenize, cfg.train, cfg.data)
    task.towers = towers
    return task


def train_owl(cfg: OwlTaskConfig, train_set: Any, *, out_dir: Optional[Union[str, Path]] = None,
              options: Optional[engine.EngineOptions] = None,
              log: Optional[Callable[[Dict[str, float]], None]] = None) -> Tuple[OwlDetector, Towers,
                                                                                  List[Dict[str, float]]]:
    """Build and train the detector of ``cfg`` on ``train_set`` through the shared engine; returns the trained
    model (on its original device, in eval mode), its towers and the metrics rows."""
    task = build_owl_task(cfg, train_set)
    task.log = log
    towers = task.towers
    t = cfg.train
    schedule = engine.Schedule(lr=t.lr, total_steps=t.steps, warmup_steps=t.warmup_steps, min_lr=t.min_lr,
                               weight_decay=t.weight_decay, grad_clip=t.grad_clip)
    doc = {"task": "owl", "init_from": cfg.init_from, "boxes": cfg.boxes, "data": cfg.data.to_dict(),
           "train": t.to_dict(), "towers_source": towers.source}
    opts = options or engine.EngineOptions(device="cpu", progress=False, tensorboard=False)
    res = engine.fit(task, engine.FitOptions(schedule, task.epochs, execution=opts, run_dir=out_dir,
                                             config_doc=doc, checkpoint_extra={"task": "owl", "owl_config": doc},
                                             quiet=True))
    task.model.cpu().eval()
    if res.interrupted:
        raise KeyboardInterrupt(f"owl training interrupted; checkpoint saved in {out_dir}")
    return task.model, towers, res.history


# --------------------------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate_owl(model: OwlDetector, scenes: Any, tokenize: Callable[[List[str]], Tensor], data: OwlDataConfig,
                 cfg: OwlTrainConfig) -> Dict[str, float]:
    """The metrics of the module docstring on ``scenes``, every class queried by its name; the model runs on its
    own device, the metrics on the CPU."""
    names = vocabulary_names(data.vocabulary)
    model.eval()
    device = next(model.parameters()).device
    seen, unseen = class_split(data.unseen, data.vocabulary)
    q = tokenize(list(names)).to(device)
    tg = owl_targets(scenes, data.min_visible, data.vocabulary)
    H, W = scenes.images.shape[-2:]
    gts, dets, ious, groups_of, z_pairs = [], [], [], [], []
    gen = torch.Generator().manual_seed(0)
    unseen_set = set(unseen)
    for lo in range(0, len(scenes), cfg.eval_batch_size):
        idx = torch.arange(lo, min(lo + cfg.eval_batch_size, len(scenes)))
        K = scenes.K.float().expand(len(idx), 3, 3)
        out = model(scenes.images[idx].to(device), q, K.to(device))
        logits, boxes = out["logits"].float().cpu(), out["boxes"].float().cpu()
        if model.boxes == "2d":
            scale = torch.tensor([W, H, W, H], dtype=torch.float32)
            for b, d in enumerate(top_detections(logits, boxes, cfg.max_dets)):
                i = int(idx[b])
                m = tg.mask[i]
                gts.append({"boxes": _xyxy(tg.boxes2d[i][m]) * scale, "labels": tg.classes[i][m]})
                dets.append({"boxes": _xyxy(d["boxes"]) * scale, "labels": d["labels"], "scores": d["scores"]})
        else:
            labels, target, mask = tg.classes[idx], tg.boxes3d[idx], tg.mask[idx]
            for b, (src, obj) in enumerate(owl_match(logits, boxes, labels, target, mask, cfg.loss_config())):
                iou = box_iou_3d(boxes[b, src], target[b, obj], cfg.iou_samples, gen) if len(src) else torch.zeros(0)
                got = dict(zip(obj.tolist(), iou.tolist()))
                z_pairs += list(zip(boxes[b, src, 2].tolist(), target[b, obj, 2].tolist()))
                for t in torch.nonzero(mask[b]).flatten().tolist():
                    ious.append(got.get(t, 0.0))
                    groups_of.append(int(labels[b, t]) in unseen_set)
    if model.boxes == "2d":
        m = coco_ap([{k: v.numpy() for k, v in g.items()} for g in gts],
                    [{k: v.numpy() for k, v in d.items()} for d in dets], len(names), (H, W),
                    groups={"seen": seen, "unseen": unseen}, max_dets=cfg.max_dets)
        return {k: v for k, v in m.items() if not k.startswith("AP/")} | {
            f"AP/{names[c]}": m[f"AP/{c}"] for c in range(len(names))}
    z = np.asarray(z_pairs, float).reshape(-1, 2)
    return summarise_3d(np.asarray(ious, float), np.asarray(groups_of, bool), z[:, 0], z[:, 1])


def summarise_3d(ious: np.ndarray, unseen: np.ndarray, z_pred: np.ndarray, z_true: np.ndarray) -> Dict[str, float]:
    """The 3-D metrics of the module docstring.

    Args:
        ious: float ``(T,)`` the 3-D IoU of every target object with its matched box (0 when unmatched).
        unseen: bool ``(T,)`` whether the object's category was held out.
        z_pred, z_true: float ``(P,)`` the box centres' depths (metres) of the ``P`` matched pairs.

    Returns:
        ``mean_iou``, ``mean_iou_seen``, ``mean_iou_unseen``, ``iou25`` (fraction of objects with IoU > 0.25),
        ``depth_err`` (median ``|z_pred - z_true|``, metres), ``depth_err_rel`` (median of that over ``z_true``),
        ``num_targets``; NaN where a group is empty.
    """
    a, g = np.asarray(ious, float), np.asarray(unseen, bool)
    zp, zt = np.asarray(z_pred, float), np.asarray(z_true, float)
    if a.shape != g.shape or zp.shape != zt.shape:
        raise ValueError(f"summarise_3d: shapes differ: ious {a.shape}, unseen {g.shape}, z_pred {zp.shape}, "
                         f"z_true {zt.shape}")
    nan = float("nan")
    err = np.abs(zp - zt)
    return {"mean_iou": float(a.mean()) if len(a) else nan,
            "mean_iou_seen": float(a[~g].mean()) if (~g).any() else nan,
            "mean_iou_unseen": float(a[g].mean()) if g.any() else nan,
            "iou25": float((a > 0.25).mean()) if len(a) else nan,
            "depth_err": float(np.median(err)) if len(err) else nan,
            "depth_err_rel": float(np.median(err / zt)) if len(err) else nan, "num_targets": float(len(a))}


def _xyxy(b: Tensor) -> Tensor:
    from torchvision.ops import box_convert

    return box_convert(b.reshape(-1, 4), "cxcywh", "xyxy")


# --------------------------------------------------------------------------------------------- figure


@torch.no_grad()
def plot_owl_examples(model: OwlDetector, scenes: Any, tokenize: Callable[[List[str]], Tensor], path: Union[str, Path],
                      index: Sequence[int] = (0, 1, 2, 3), queries: Optional[Sequence[str]] = None,
                      data: Optional[OwlDataConfig] = None) -> Path:
    """A PNG of scenes ``index``, each with its text queries and the best box of each: the queries are
    ``queries`` or, by default, the names of the classes in the scene (held-out ones included); for each, the
    token with the highest score for it gives the drawn box, labelled with the query and the score.  True boxes
    dashed; held-out classes in orange, seen ones in cyan.  3-D boxes are drawn as the image rectangle their 8
    corners project to."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .boxes import box12_to_corners

    data = data or OwlDataConfig()
    model.eval()
    device = next(model.parameters()).device
    names = list(vocabulary_names(data.vocabulary))
    idx = torch.as_tensor(list(index), dtype=torch.long)
    K = scenes.K.float().expand(len(idx), 3, 3)
    out = model(scenes.images[idx].to(device), tokenize(names).to(device), K.to(device))
    logits, boxes = out["logits"].float().cpu(), out["boxes"].float().cpu()
    H, W = scenes.images.shape[-2:]
    tg = owl_targets(scenes, data.min_visible, data.vocabulary)
    unseen = {names[c] for c in class_split(data.unseen, data.vocabulary)[1]}

    def rect(b: Tensor) -> Tuple[float, float, float, float]:
        if b.numel() == 4:
            cx, cy, w, h = (b * torch.tensor([W, H, W, H])).tolist()
            return cx - w / 2, cy - h / 2, w, h
        uvw = box12_to_corners(b[None])[0] @ scenes.K.float().t()  # (8, 3)
        uv = uvw[:, :2] / uvw[:, 2:].clamp_min(1e-6)
        lo, hi = uv.min(0).values, uv.max(0).values
        return float(lo[0]), float(lo[1]), float(hi[0] - lo[0]), float(hi[1] - lo[1])

    fig, axes = plt.subplots(1, len(idx), figsize=(3.2 * len(idx), 3.5), squeeze=False)
    for ax, b, i in zip(axes[0], range(len(idx)), idx.tolist()):
        ax.imshow(scenes.images[i, :3].permute(1, 2, 0).clamp(0, 1).numpy(), extent=(0, W, H, 0))
        for t in torch.nonzero(tg.mask[i]).flatten().tolist():
            x0, y0, w, h = rect(tg.boxes2d[i, t] if model.boxes == "2d" else tg.boxes3d[i, t])
            ax.add_patch(plt.Rectangle((x0, y0), w, h, fill=False, ls="--", lw=1, ec="white"))
        wanted = list(queries) if queries is not None else \
            list(dict.fromkeys(names[int(c)] for c in tg.classes[i][tg.mask[i]]))
        for name in wanted:
            s = logits[b, :, names.index(name)].sigmoid()  # (M,)
            m = int(s.argmax())
            col = "orange" if name in unseen else "cyan"
            x0, y0, w, h = rect(boxes[b, m])
            ax.add_patch(plt.Rectangle((x0, y0), w, h, fill=False, lw=1.5, ec=col))
            ax.text(x0, y0 - 0.3, f'"{name}" {float(s[m]):.2f}', color=col, fontsize=7, va="bottom",
                    bbox=dict(facecolor="black", alpha=0.5, pad=0.5, lw=0))
        words = " ".join(scenes.captions[i][0])
        ax.set_title(words if len(words) < 50 else words[:47] + "...", fontsize=6)
        ax.set_xlim(0, W)
        ax.set_ylim(H, 0)
        ax.axis("off")
    fig.suptitle(f"{model.boxes.upper()} boxes by text query: the best box for each query (cyan: word seen in "
                 f"detection training, orange: held out; dashed: truth)", fontsize=7)
    return save_figure(fig, path)
