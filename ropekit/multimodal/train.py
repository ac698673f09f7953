"""Contrastive image-text training behind ``ropekit train --task retrieval``: a ViT / ViTD vision tower and a text
tower trained with the SigLIP loss on captioned scenes, evaluated by image<->text recall@1/5/10.

The loop is the shared engine (:func:`ropekit.train.engine.fit`): DDP, precision, ``torch.compile``, exact resume,
the run folder and the learning curves come from it. This module supplies the task (:class:`RetrievalTask`), its
configuration (:class:`RetrievalConfig`: the usual :class:`~ropekit.classification.TrainConfig` for the data, the vision
tower and the schedule, plus :class:`RetrievalOptions` for the text tower and the joint space, ``--task-opt
KEY=VALUE`` on the command line) and :func:`train_retrieval`.

* Data: any dataset whose splits carry captioned scenes (``ds.scenes``, a
  :class:`~ropekit.data.captioned.CaptionedScenes`): ``captioned-scenes``. Each training epoch is one pass over the
  training scenes in a seeded order; each scene contributes one of its captions, drawn from ``(seed, epoch)``.
* Vision tower: the run's ViT with ``num_classes=0`` -- an RGB ViT (``--depth-input ignore``), APE with depth as an
  input channel (``--pe absolute --depth-input channel``), or a rotary encoding with depth as the third coordinate
  (``--depth-input coord``, the default with a rotary encoding) -- mean-pooled and linearly projected.
* Loss: SigLIP (:func:`~ropekit.multimodal.retrieval.siglip_loss`), temperature ``exp(t)`` from ``t = log 10`` and
  bias from ``-10``, both learned. Captions of a batch that are equal are positives for each other's images. Under
  DDP each process's loss uses the negatives of its own share of the batch.
* Evaluation (after every epoch): the first caption of each test scene paired with its image, image->text and
  text->image recall@1/5/10 and their mean (:func:`~ropekit.multimodal.retrieval.retrieval_recall`; equal
  captions count as right answers, ties against the query); and the depth hard negatives
  (:func:`~ropekit.multimodal.hard_negatives.depth_hard_negative_accuracy`): every caption of the evaluated test
  scenes that states a depth relation against the same caption with the relation flipped, ``depth_hn_acc`` the
  share of these pairs where the image scores the true caption higher (chance 0.5; ``nan`` when no caption
  states one), ``depth_hn_pairs`` their number and ``depth_hn_ties`` the pairs scored equal (counted 0.5).
* Run folder: what ``ropekit train`` writes (``config.json`` with ``train``, ``retrieval``, ``model``, ``text``
  sections; ``checkpoint.pt``; ``metrics.csv``; ``summary.json``), with ``curves.png`` showing the loss and the
  recalls, and ``queries.png``: a few test captions with their top-5 images.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .._config_keys import known_keys
from ..data.text import Tokenizer
from ..nn import TextConfig, TextTransformer, VisionTransformer
from ..train import engine
from ..train.checkpoint import CHECKPOINT_NAME, load_checkpoint, load_model_state
from ..classification.config import TrainConfig, build_vit_config, check_type
from ..train.distributed import DistContext, init_distributed
from ..train.engine import seed_everything
from ..train.run_folder import load_run
from ..train.tasks import register_task
from ..classification.trainer import default_run_dir, load_data, resolve_threads, resume_changes, schedule_of
from .hard_negatives import depth_hard_negative_accuracy
from .retrieval import RECALL_KS, DualEncoder, retrieval_recall, siglip_loss

__all__ = ["RetrievalOptions", "RetrievalConfig", "RetrievalTask", "RetrievalResult", "build_retrieval_task",
           "train_retrieval", "load_retrieval_run", "run_retrieval_command", "METRIC_COLUMNS", "TASK_DEFAULTS"]

#: ``metrics.csv`` columns of a retrieval run.
METRIC_COLUMNS = ("epoch", "train_loss", *(f"{d}_r{k}" for d in ("i2t", "t2i") for k in RECALL_KS), "mean_recall",
                  "depth_hn_acc", "depth_hn_pairs", "depth_hn_ties", "logit_scale", "logit_bias", "lr", "epoch_time",
                  "elapsed_time")
#: ``TrainConfig`` values the retrieval task starts from instead of classification's (the data, no shift).
TASK_DEFAULTS: Dict[str, Any] = {"data": "captioned-scenes", "augment_shift": 0, "epochs": 8, "batch_size": 64}


@dataclass
class RetrievalOptions:
    """The parts of a retrieval run that ``TrainConfig`` does not describe (``--task-opt KEY=VALUE``).

    Attributes:
        embed_dim: ``E``, the joint embedding width.
        text_width, text_depth, text_heads, text_mlp_ratio: the text transformer.
        text_pe: its position encoding (a ``create_pe`` name with one coordinate, ``absolute`` or ``none``).
        context_length: the most words of a caption.
        logit_scale_init, logit_bias_init: SigLIP's initial ``t`` and ``b``.
        eval_limit: test pairs to evaluate (``None``: every test scene).
        num_queries: captions shown in ``queries.png`` (0: no figure).
    """

    embed_dim: int = 64
    text_width: int = 64
    text_depth: int = 2
    text_heads: int = 2
    text_mlp_ratio: float = 2.0
    text_pe: str = "axial"
    context_length: int = 32
    logit_scale_init: float = math.log(10.0)
    logit_bias_init: float = -10.0
    eval_limit: Optional[int] = None
    num_queries: int = 4

    @classmethod
    def from_dict(cls, d: Dict[str, Any], *, source: str = "--task-opt", strict: bool = True) -> "RetrievalOptions":
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**known_keys(d, names, {}, source=source, strict=strict)).validate(source)

    def validate(self, source: str = "--task-opt") -> "RetrievalOptions":
        import typing

        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            check_type(f.name, getattr(self, f.name), hints[f.name], source)
        for name in ("embed_dim", "text_width", "text_depth", "text_heads", "context_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{source}: {name} must be a positive integer, got {getattr(self, name)}")
        if self.eval_limit is not None and self.eval_limit < 2:
            raise ValueError(f"{source}: eval_limit must be >= 2 (or null for all), got {self.eval_limit}")
        if self.num_queries < 0:
            raise ValueError(f"{source}: num_queries must be >= 0, got {self.num_queries}")
        self.text_config(2)  # the tower's own checks (pe name, even head width)
        return self

    def text_config(self, vocab_size: int) -> TextConfig:
        return TextConfig(vocab_size, context_length=self.context_length, embed_dim=self.text_width,
                          depth=self.text_depth, num_heads=self.text_heads, mlp_ratio=self.text_mlp_ratio,
                          pe=self.text_pe).validate()

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class RetrievalConfig:
    """What builds a :class:`RetrievalTask`: the run's ``TrainConfig`` (data, vision tower, schedule, run) and
    the :class:`RetrievalOptions`."""

    train: TrainConfig = field(default_factory=lambda: TrainConfig.from_dict(TASK_DEFAULTS))
    options: RetrievalOptions = field(default_factory=RetrievalOptions)


# ---------------------------------------------------------------------------------------------------------
# the task
# ---------------------------------------------------------------------------------------------------------


class RetrievalTask:
    """SigLIP training of a :class:`DualEncoder` on captioned scenes: what :func:`ropekit.train.engine.fit` needs.

    Args:
        cfg: the run's configuration.
        model: the dual encoder.
        train_scenes, test_scenes: :class:`~ropekit.data.captioned.CaptionedScenes` (``images`` as the datasets
            hold them, normalised colour and metric depth).
        tokenizer: the word tokenizer of the captions.
        ctx: this process's place in the run.
    """

    name = "retrieval"

    def __init__(self, cfg: RetrievalConfig, model: DualEncoder, train_scenes: Any, test_scenes: Any,
                 tokenizer: Tokenizer, ctx: DistContext, run_dir: Optional[Path] = None, info: Any = None) -> None:
        self.cfg, self.model, self.tokenizer, self.run_dir, self.info = cfg, model, tokenizer, run_dir, info
        self.train_scenes, self.test_scenes = train_scenes, test_scenes
        tc = cfg.train
        if len(train_scenes) == 0:
            raise ValueError("retrieval: no training scenes")
        # every caption tokenised once: (N, C, L) for training, (N_test, L) for evaluation
        self.train_ids = torch.stack([tokenizer([c for c in caps]) for caps in train_scenes.captions])
        self.train_keys = [[" ".join(c) for c in caps] for caps in train_scenes.captions]
        limit = cfg.options.eval_limit
        n_test = len(test_scenes) if limit is None else min(len(test_scenes), int(limit))
        if n_test < 2:
            raise ValueError(f"retrieval: evaluation needs at least 2 test scenes, got {n_test}")
        self.test_index = list(range(n_test))
        self.test_ids = tokenizer([test_scenes.captions[i][0] for i in self.test_index])
        self.test_keys = [" ".join(test_scenes.captions[i][0]) for i in self.test_index]
        self.world = ctx.world_size
        self.per_rank_bs = max(1, tc.optim.batch_size // ctx.world_size)
        n = len(train_scenes)
        self.steps_per_epoch = math.ceil(math.ceil(n / ctx.world_size) / self.per_rank_bs)

    # ------------------------------------------------------------------ batches and loss
    def epoch_batches(self, epoch: int, ctx: DistContext) -> List[List[Tuple[int, int]]]:
        """This rank's batches of ``(scene, caption)`` pairs: a seeded permutation of the scenes (padded to a
        multiple of the ranks by wrapping round), one caption per scene drawn from ``(seed, epoch)``."""
        g = torch.Generator().manual_seed(int(self.cfg.train.run.seed) * 1_000_003 + epoch)
        n = len(self.train_scenes)
        order = torch.randperm(n, generator=g).tolist()
        caps = torch.randint(0, self.train_ids.shape[1], (n,), generator=g).tolist()
        total = math.ceil(n / ctx.world_size) * ctx.world_size
        order = (order * (total // n + 1))[:total]
        mine = order[ctx.rank::ctx.world_size]
        pairs = [(i, caps[i]) for i in mine]
        return [pairs[s:s + self.per_rank_bs] for s in range(0, len(pairs), self.per_rank_bs)]

    def loss(self, model: nn.Module, batch: List[Tuple[int, int]], device: torch.device) -> Tuple[Tensor, Dict]:
        scene = torch.as_tensor([i for i, _ in batch])
        cap = torch.as_tensor([c for _, c in batch])
        images = self.train_scenes.images[scene].to(device, non_blocking=True)
        ids = self.train_ids[scene, cap].to(device, non_blocking=True)
        keys = [self.train_keys[i][c] for i, c in batch]
        codes: Dict[str, int] = {}
        key = torch.as_tensor([codes.setdefault(k, len(codes)) for k in keys], device=device)
        img, txt = model(images, ids)
        loss = siglip_loss(img, txt, model.logit_scale, model.logit_bias, key[:, None] == key[None, :])
        n = len(batch)
        return loss, {"loss_sum": loss.item() * n, "count": n}

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def embed_test(self, device: Any, batch_size: int = 250) -> Tuple[Tensor, Tensor]:
        """``(image_emb (N, E), text_emb (N, E))`` of the evaluated test pairs (on the CPU)."""
        model = self.model
        was = model.training
        model.eval()
        img, txt = [], []
        for s in range(0, len(self.test_index), batch_size):
            idx = torch.as_tensor(self.test_index[s:s + batch_size])
            img.append(model.encode_image(self.test_scenes.images[idx].to(device)).cpu())
            txt.append(model.encode_text(self.test_ids[s:s + batch_size].to(device)).cpu())
        model.train(was)
        return torch.cat(img), torch.cat(txt)

    def evaluate(self, device: Any) -> Dict[str, float]:
        """Recall@1/5/10 both ways and their mean on the evaluated test pairs, and the depth hard negatives
        (``depth_hn_acc``, ``depth_hn_pairs``: see the module docstring)."""
        img, txt = self.embed_test(device, self.cfg.train.run.eval_batch_size)
        return {**retrieval_recall(img, txt, self.test_keys), **self.depth_hard_negatives(device)}

    def depth_hard_negatives(self, device: Any) -> Dict[str, float]:
        """``{"depth_hn_acc", "depth_hn_pairs", "depth_hn_ties"}`` over every caption of the evaluated test scenes
        (``ties``: pairs scored equal, counted 0.5; with the accuracy and the pairs they give every outcome)."""
        idx = torch.as_tensor(self.test_index)
        res = depth_hard_negative_accuracy(self.model, self.tokenizer, self.test_scenes.images[idx].to(device),
                                           [self.test_scenes.captions[i] for i in self.test_index],
                                           batch_size=self.cfg.train.run.eval_batch_size)
        ties = sum(1 for x in res["per_caption"] if x == 0.5)
        return {"depth_hn_acc": res["accuracy"], "depth_hn_pairs": res["n"], "depth_hn_ties": ties}

    def epoch_row(self, epoch: int, sums: Dict[str, float], info: Dict[str, Any], ctx: DistContext) -> Dict[str, Any]:
        loss_sum, count = ctx.all_reduce_sum([sums.get("loss_sum", 0.0), sums.get("count", 0.0)])
        t0 = time.time()
        rec = self.evaluate(ctx.device)  # (every rank evaluates the same pairs: the model is replicated)
        t_eval = time.time() - t0
        return {"epoch": epoch + 1, "train_loss": loss_sum / max(count, 1), **rec,
                "logit_scale": float(self.model.logit_scale.detach()), "logit_bias": float(self.model.logit_bias.detach()),
                "lr": info["lr"], "epoch_time": info["epoch_time"] + t_eval, "elapsed_time": info["elapsed"] + t_eval}

    def describe(self, row: Dict[str, Any]) -> str:
        return (f"epoch {row['epoch']}/{self.cfg.train.optim.epochs}  loss {row['train_loss']:.4f}  i2t R@1/5/10 "
                f"{row['i2t_r1']:.3f}/{row['i2t_r5']:.3f}/{row['i2t_r10']:.3f}  t2i {row['t2i_r1']:.3f}/"
                f"{row['t2i_r5']:.3f}/{row['t2i_r10']:.3f}  mean {row['mean_recall']:.4f}  ({row['epoch_time']:.1f}s)")

    # ------------------------------------------------------------------ outputs
    def plot(self, history: List[Dict[str, Any]], path: Path) -> None:
        """``curves.png`` (loss and recalls) and, beside it, ``queries.png`` (a few test captions, top-5 images)."""
        from .plot import plot_retrieval_curves

        vit = self.model.vision.cfg
        plot_retrieval_curves(history, path, title=f"{self.cfg.train.data.name} retrieval, pe={vit.pe}, depth "
                                                   f"{vit.resolved_depth_input or 'none'}")
        if self.cfg.options.num_queries:
            self.plot_queries(Path(path).with_name("queries.png"))

    def plot_queries(self, path: Path, num: Optional[int] = None) -> Path:
        """The figure of ``num`` test captions (the first ones with a relation, else the first ones) and their
        top-5 test images."""
        from .plot import plot_queries

        num = self.cfg.options.num_queries if num is None else num
        img, txt = self.embed_test(self.model.logit_scale.device, self.cfg.train.run.eval_batch_size)
        with_rel = [i for i, k in enumerate(self.test_keys) if " . " in k]
        pick = (with_rel + [i for i in range(len(self.test_keys)) if i not in set(with_rel)])[:num]
        scores = txt[pick] @ img.T  # (Q, N)
        truth = [[j for j, k in enumerate(self.test_keys) if k == self.test_keys[i]] for i in pick]
        images = self.test_scenes.images[torch.as_tensor(self.test_index)]
        info = self.info
        vit = self.model.vision.cfg
        return plot_queries([self.test_keys[i] for i in pick], scores, images, truth, path,
                            mean=getattr(info, "mean", None), std=getattr(info, "std", None),
                            title=f"text → image, pe={vit.pe}, depth {vit.resolved_depth_input or 'none'}: top-5 "
                                  f"of {len(self.test_index)} test scenes (green: a right answer)")

    def summary(self, history: List[Dict[str, Any]]) -> Dict[str, Any]:
        final = history[-1] if history else {}
        vit = self.model.vision.cfg
        return {"run_dir": str(self.run_dir) if self.run_dir is not None else None, "task": "retrieval",
                "data": self.cfg.train.data.name, "pe": vit.pe, "depth_input": vit.resolved_depth_input,
                "seed": self.cfg.train.run.seed, "num_test_pairs": len(self.test_index),
                **{k: final.get(k) for k in METRIC_COLUMNS if k not in ("lr", "epoch_time", "elapsed_time")}}


# ---------------------------------------------------------------------------------------------------------
# building and training
# ---------------------------------------------------------------------------------------------------------


def _scenes_of(ds: Any, split: str, data: str) -> Any:
    scenes = getattr(ds, "scenes", None)
    if scenes is None:
        raise ValueError(f"retrieval needs captioned data (--data captioned-scenes); dataset {data!r} has no "
                         f"captions in its {split} split")
    return scenes


def build_model(cfg: RetrievalConfig, info: Any, vocab_size: int) -> DualEncoder:
    """The dual encoder of ``cfg`` for data described by ``info`` (the vision tower is the run's ViT with
    ``num_classes=0``), initialised from the current random state."""
    vit_cfg = dataclasses.replace(build_vit_config(cfg.train, info), num_classes=0)
    o = cfg.options
    return DualEncoder(VisionTransformer(vit_cfg), TextTransformer(o.text_config(vocab_size)), o.embed_dim,
                       o.logit_scale_init, o.logit_bias_init)


def _refuse_classification_only(tc: TrainConfig, shift: bool = False) -> None:
    """One-line ``ValueError`` naming the ``TrainConfig`` fields only classification reads that ``tc`` sets
    (they would be recorded and not read); ``shift``: ``augment_shift`` too (the command line, whose task default
    is 0; ``TrainConfig``'s own is classification's 1)."""
    d, o = tc.data, tc.optim
    fields = [("augment_sizes", list(d.augment_sizes), []), ("--mixup", d.mixup_alpha, 0.0),
              ("--cutmix", d.cutmix_alpha, 0.0), ("--label-smoothing", o.label_smoothing, 0.0),
              ("--native-resolution", d.native_resolution, False), ("--native-opt", dict(d.native_options), {})]
    if shift:
        fields.insert(0, ("--augment-shift", d.augment_shift, TASK_DEFAULTS["augment_shift"]))
    unread = [flag for flag, value, off in fields if value != off]
    if unread:
        raise ValueError(f"{', '.join(unread)}: classification options the retrieval task does not read (its images "
                         f"are not shifted, mixed or packed; its loss is SigLIP's)")


@register_task("retrieval", "image-text retrieval: a ViT / ViTD and a text tower trained with the SigLIP loss on "
                            "captioned RGB-D scenes", config=RetrievalConfig, defaults=TASK_DEFAULTS,
               train=lambda cfg, options, **kw: run_retrieval_command(cfg, options, **kw))
def build_retrieval_task(cfg: RetrievalConfig, ctx: Optional[DistContext] = None, *,
                         run_dir: Optional[Path] = None) -> RetrievalTask:
    """The :class:`RetrievalTask` of ``cfg``: its data loaded (``cfg.train.data.name``; captions required), its
    tokenizer and its dual encoder built (seeded by ``cfg.train.run.seed``, identical on every rank)."""
    ctx = ctx or DistContext()
    cfg.train.validate()
    cfg.options.validate()
    if cfg.train.model.init_from:  # (it would be recorded and not read)
        raise ValueError(f"--init-from {cfg.train.model.init_from}: the retrieval task trains both towers from their "
                         f"initialisation and reads no checkpoint into them")
    _refuse_classification_only(cfg.train)
    train_ds, test_ds, info = load_data(cfg.train)
    train_scenes = _scenes_of(train_ds, "train", cfg.train.data.name)
    test_scenes = _scenes_of(test_ds, "test", cfg.train.data.name)
    tokenizer = Tokenizer(context_length=cfg.options.context_length)
    seed_everything(cfg.train.run.seed)
    model = build_model(cfg, info, tokenizer.vocab_size)
    return RetrievalTask(cfg, model, train_scenes, test_scenes, tokenizer, ctx, run_dir=run_dir, info=info)


@dataclass
class RetrievalResult:
    """What :func:`train_retrieval` returns (on rank 0 the files are in ``run_dir``)."""

    run_dir: Path
    history: List[Dict[str, Any]]
    interrupted: bool
    wall_time: float
    model: DualEncoder
    final: Dict[str, Any] = field(default_factory=dict)
    is_main: bool = True


def train_retrieval(cfg: RetrievalConfig, *, resume: bool = False, quiet: bool = False,
                    allow_change: Sequence[str] = (),
                    on_step: Optional[Callable[[int], Optional[bool]]] = None) -> RetrievalResult:
    """Train the dual encoder of ``cfg`` in the run folder ``cfg.train.run.out`` (default
    ``runs/<data>-<pe>-<model>-s<seed>-<time>``); see the module docstring for what it holds.

    ``resume`` continues the run's checkpoint exactly (the same rules as ``ropekit train --resume``: the options
    must equal the run's, except those that never change results and, with ``allow_change``, epochs, precision
    and eval_batch_size; the retrieval options must be equal). ``on_step(global_step)`` is called after every
    step; returning ``True`` stops the run as Ctrl-C does (a checkpoint is saved, mid-epoch if need be).

    Raises:
        ValueError: bad options, data without captions, a folder that already holds a run (without ``resume``);
        RunLockedError, NonFiniteLossError, SaveError, CheckpointError: as :func:`ropekit.classification.train`.
    """
    tc = cfg.train.validate()
    cfg.options.validate()
    ctx = init_distributed(tc.run.device)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(resolve_threads(tc.run.threads, ctx.world_size))
    try:
        run_dir = Path(tc.run.out) if tc.run.out else Path(ctx.gather_objects(str(default_run_dir(tc)))[0])
        tc = tc.replace(**{"run.out": str(run_dir)})
        cfg = dataclasses.replace(cfg, train=tc)
        ckpt = None
        changes: Dict[str, Any] = {}
        if resume:
            ckpt = load_checkpoint(run_dir / CHECKPOINT_NAME)
            previous, _ = load_run(run_dir)
            changes = resume_changes(previous.get("train", {}), tc, allow_change)
            old = RetrievalOptions.from_dict(previous.get("retrieval", {}), source="the run's config", strict=False)
            if old != cfg.options:
                raise ValueError(f"--resume: retrieval options differ from the run's: {old.to_dict()} -> "
                                 f"{cfg.options.to_dict()}")
        task = build_retrieval_task(cfg, ctx, run_dir=run_dir)
        if ckpt is not None:
            load_model_state(task.model, ckpt["model"], source=f"checkpoint {ckpt['path']}")
        schedule = schedule_of(tc, task.steps_per_epoch)
        vit = task.model.vision.cfg
        if ctx.is_main and not quiet:
            print(f"ropekit train --task retrieval: {tc.data.name} ({len(task.train_scenes)} train scenes, "
                  f"{len(task.test_index)} test pairs), ViT-{tc.model.size} pe={vit.pe} depth "
                  f"{vit.resolved_depth_input or 'none'}, text tower {cfg.options.text_depth}x"
                  f"{cfg.options.text_width} ({cfg.options.text_pe}), {tc.optim.epochs} epochs, "
                  f"batch {tc.optim.batch_size}, run "
                  f"folder {run_dir}" + (f"; resumed with {changes}" if changes else ""), file=sys.stderr)

        def fresh_start(c: DistContext) -> None:
            seed_everything(tc.run.seed + 1_000_003 * (c.rank + 1))

        config_doc = {"task": "retrieval", "train": tc.to_nested(), "retrieval": cfg.options.to_dict(),
                      "model": vit.to_dict(), "text": task.model.text.cfg.to_dict(),
                      "data": {"name": tc.data.name, "num_train": len(task.train_scenes),
                               "num_test_pairs": len(task.test_index)}}
        res = engine.fit(task, engine.FitOptions(
            schedule, tc.optim.epochs, execution=tc.run.engine_options(), run_dir=run_dir,
            checkpoint_name=CHECKPOINT_NAME,
            resume=ckpt is not None, ctx=ctx, quiet=quiet, config_doc=config_doc, on_step=on_step,
            checkpoint_extra={"vit_config": vit.to_dict(), "train_config": tc.to_nested(),
                              "retrieval_options": cfg.options.to_dict(), "text_config": task.model.text.cfg.to_dict()},
            metric_columns=METRIC_COLUMNS, fresh_start=fresh_start))
        final = dict(res.history[-1]) if res.history else {}
        return RetrievalResult(run_dir, res.history, res.interrupted, res.wall_time, task.model, final, ctx.is_main)
    finally:
        torch.set_num_threads(previous_threads)
        ctx.close()


def load_retrieval_run(run_dir: Any, device: Any = "cpu") -> Tuple[DualEncoder, Tokenizer, RetrievalConfig]:
    """The trained dual encoder of a retrieval run folder (or its checkpoint file), its tokenizer and its
    configuration -- e.g. to embed images and texts, or to start another model from its towers.

    >>> model, tok, cfg = load_retrieval_run("runs/retrieval-cayley")                   # doctest: +SKIP
    >>> model.encode_text(tok(["a big red 3"]))                                        # (1, E), unit norm

    Raises:
        FileNotFoundError, CheckpointError: no such run, or no readable checkpoint; ValueError: not a retrieval run.
    """
    config, ckpt = load_run(run_dir)
    if "retrieval_options" not in ckpt or "text_config" not in ckpt:
        raise ValueError(f"{run_dir} is not a retrieval run (its checkpoint has no text tower)")
    from ..nn import ViTConfig

    tc = TrainConfig.from_dict(ckpt.get("train_config", {}), source="the run's config", strict=False)
    options = RetrievalOptions.from_dict(ckpt["retrieval_options"], source="the run's config", strict=False)
    vit = VisionTransformer(ViTConfig.from_dict(ckpt["vit_config"], source="the run's config", strict=False))
    text_cfg = TextConfig(**ckpt["text_config"])
    model = DualEncoder(vit, TextTransformer(text_cfg), options.embed_dim)
    load_model_state(model, ckpt["model"], source=f"checkpoint {ckpt['path']}")
    model.to(device).eval()
    return model, Tokenizer(context_length=text_cfg.context_length), RetrievalConfig(tc, options)


def run_retrieval_command(cfg: TrainConfig, task_options: Dict[str, Any], *, resume: bool = False,
                          allow_change: Sequence[str] = ()) -> int:
    """``ropekit train --task retrieval``: train, print the final recalls; the exit status."""
    if resume:
        previous, _ = load_run(cfg.run.out)
        task_options = {**previous.get("retrieval", {}), **task_options}
    options = RetrievalOptions.from_dict(task_options)
    _refuse_classification_only(cfg, shift=True)
    result = train_retrieval(RetrievalConfig(cfg, options), resume=resume, allow_change=allow_change)
    if not result.is_main:
        return 130 if result.interrupted else 0
    if result.interrupted:
        print(f"interrupted; checkpoint saved in {result.run_dir}. Continue with: ropekit train --task retrieval "
              f"--resume {result.run_dir}", file=sys.stderr)
        return 130
    f = result.final
    if f:
        print(f"mean recall {f['mean_recall']:.4f} (i2t R@1/5/10 {f['i2t_r1']:.3f}/{f['i2t_r5']:.3f}/"
              f"{f['i2t_r10']:.3f}, t2i {f['t2i_r1']:.3f}/{f['t2i_r5']:.3f}/{f['t2i_r10']:.3f}) after "
              f"{int(f['epoch'])} epochs, {result.wall_time:.1f} s; run folder {result.run_dir}")
    return 0
