"""``ropekit experiment detect3d``: 3-D box detection from RGB (ViT) vs RGB-D (ViTD) for each position encoding.

The STRING paper's comparison: a ViT on colour against a ViTD that feeds depth into the network as a fourth
input channel and -- for a rotary encoding -- also uses it as the third coordinate ``z`` of a 3-D encoding of
``(y, x, z)``; encodings without a coordinate path (APE, NoPE) get depth as a channel only.  Beside it, the
ablation for the rotary encodings: depth as an input channel only (``rgbd-channel``) against input and
coordinate (``rgbd``); depth as a coordinate only (``rgbd-coord``, blind to absolute distance with a commuting
encoding) is available as an input but not trained by default.

For every encoding × input × seed the same detector (:mod:`ropekit.detection.model`) is trained on the same
cached scenes with the same schedule -- only the encoding, the input and the seed change -- and evaluated on a
held-out scene stream (every object; mean 3-D IoU of Hungarian-matched pairs and mAP at 3-D IoU 0.25 / 0.5,
Monte Carlo IoU).  Every setting comes from a pinned recipe (:mod:`ropekit_studies.recipes.detect3d`: ``default``
for a 2-core CPU, ``gpu``, ``quick``).  The output directory gets:

* ``runs/<encoding>-<input>-s<seed>/``: ``config.json`` (the run's settings and resolved detector),
  ``curve.csv`` (training losses and, every ``log_every`` steps, ``val_mean_iou``: the mean IoU on the first
  ``val_scenes`` test scenes -- the learning curve), ``metrics.json``, ``errors.json``, ``model.pt`` (state dict;
  git-ignored);
* ``detect3d.csv`` (one row per run), ``detect3d.json`` (rows, summary, paired differences, settings),
  ``summary.csv``, ``table.md`` (per encoding × input: mean ± sample standard deviation over seeds and the best
  seed; differences paired by seed; the error breakdown; how far each learning curve had levelled off),
  ``detect3d.png`` (bars of the three metrics), ``iou_curve.png`` (held-out mean IoU against step),
  ``training.png`` (loss curves), ``examples.png`` (test scenes with predicted (blue) and true (green) boxes),
  ``config.json`` (study, preset, the complete recipe, the command and every run's settings: what
  :func:`ropekit_studies.recipes.compare_with_committed` checks) and ``command.txt``.

A run whose ``metrics.json`` holds the same settings is not trained again, so an interrupted study resumes
where it stopped.  Each run is trained under a lock on its folder, and the scenes are rendered under a lock on
the cache: two processes started on the same ``--out`` share the runs between them (a run the other process
holds is taken up at the end, read back once it is done), and both finish with the complete report.

Python entry point::

    from ropekit_studies.detection import preset_config, run_detect3d
    summary = run_detect3d(preset_config("quick", out="runs/d3"))
"""

from __future__ import annotations

import argparse
import copy
import csv
import dataclasses
import hashlib
import json
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from filelock import FileLock

from ropekit._io import atomic_write
from ropekit.encodings.counting import count_parameters
from .recipes import PRESETS
from ropekit.detection.model import BOX_PARAMS, INPUTS, INTRINSICS, Detector3D, depth_input_of, detector_config, is_rotary
from .recipes.detect3d import check_recipe, recipe
from .detection_summary import (INPUT_LABELS, METRICS, depth_label, markdown_table,
                                paired_differences, summarise)
from ropekit.detection.scenes import CLASS_NAMES, SceneConfig, SceneSet, generate_scenes
from ropekit.detection.train import DetTrainConfig, evaluate_detector, matched_errors, mean_box, predict, seed_everything, train_detector

__all__ = ["Detect3DConfig", "config_from_recipe", "preset_config", "quick_config", "planned_runs", "run_settings",
           "build_detector", "run_detect3d", "run_study", "compare_recipe", "add_arguments", "run", "main", "INPUT_LABELS"]

@dataclass
class Detect3DConfig:
    """Settings of the whole study: the pinned recipe of a preset (:mod:`ropekit_studies.recipes.detect3d`) plus how
    it runs.  Build it with :func:`config_from_recipe`; nothing here has a default that could change what is
    learned.

    Recipe (saved with each run): ``encodings``, ``inputs`` (:data:`~ropekit.detection.model.INPUTS`),
    ``seeds``; the data (``n_train``, ``n_test``, ``image_size``, ``scene_seed``: training scenes use this stream,
    test scenes the stream ``scene_seed + 1``; ``scenes``: every :class:`SceneConfig` field); the detector
    (``intrinsics``, ``box_param``, ``head_hidden``, ``backbone``: every architecture and position field of
    :class:`~ropekit.nn.ViTConfig` but ``pe`` and ``depth_input``, ``pe_overrides``: backbone fields per
    encoding); ``train`` and ``precision``.
    Running (not saved as recipe): ``preset`` (its name, recorded), ``out``, ``cache_dir`` (rendered scenes),
    ``workers`` (rendering processes), ``num_examples``, ``threads`` (torch CPU threads, 0: leave as is),
    ``device`` (``"auto"``: CUDA when available).
    """

    encodings: Tuple[str, ...]
    inputs: Tuple[str, ...]
    seeds: Tuple[int, ...]
    n_train: int
    n_test: int
    image_size: int
    scene_seed: int
    scenes: Dict[str, Any]
    intrinsics: str
    box_param: str
    head_hidden: int
    backbone: Dict[str, Any]
    pe_overrides: Dict[str, Dict[str, Any]]
    train: DetTrainConfig
    precision: str
    preset: str = "custom"
    out: str = "runs/detect3d"
    cache_dir: str = ".cache/scenes"
    workers: int = 2
    num_examples: int = 4
    threads: int = 0
    device: str = "auto"

    def validate(self) -> "Detect3DConfig":
        from ropekit import list_pes

        known = list_pes() + ["absolute", "sincos"]
        for enc in self.encodings:
            if enc not in known:
                raise ValueError(f"unknown encoding {enc!r}; known: {', '.join(known)}")
        for inp in self.inputs:
            if inp not in INPUTS:
                raise ValueError(f"unknown input {inp!r}; known: {', '.join(INPUTS)}")
        if self.intrinsics not in INTRINSICS:
            raise ValueError(f"intrinsics must be one of {', '.join(INTRINSICS)}")
        if self.box_param not in BOX_PARAMS:
            raise ValueError(f"box_param must be one of {', '.join(BOX_PARAMS)}")
        if not self.seeds:
            raise ValueError("need at least one seed")
        if self.n_train < 1 or self.n_test < 1:
            raise ValueError("n_train and n_test must be >= 1")
        if not planned_runs(self):
            raise ValueError(f"no run: inputs {', '.join(self.inputs)} do not apply to encodings "
                             f"{', '.join(self.encodings)}")
        return self

    def recipe(self) -> Dict[str, Any]:
        """The recipe this configuration runs (the format of :func:`ropekit_studies.recipes.detect3d.recipe`)."""
        train = self.train.to_dict()
        for k in ("seed", "eval_batch_size"):
            train.pop(k)
        return json.loads(json.dumps({
            "encodings": list(self.encodings), "inputs": list(self.inputs), "seeds": list(self.seeds),
            "n_train": self.n_train, "n_test": self.n_test, "image_size": self.image_size,
            "scene_seed": self.scene_seed, "scenes": self.scenes, "intrinsics": self.intrinsics,
            "box_param": self.box_param, "head_hidden": self.head_hidden, "backbone": self.backbone,
            "pe_overrides": self.pe_overrides, "train": {**train, "precision": self.precision}}))

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["train"] = self.train.to_dict()
        for k in ("encodings", "inputs", "seeds"):
            d[k] = list(d[k])
        return d

    def scene_config(self) -> SceneConfig:
        """The :class:`SceneConfig` of ``scenes`` (lists become the tuples the dataclass holds)."""
        return SceneConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in self.scenes.items()})


def config_from_recipe(r: Dict[str, Any], **running: Any) -> Detect3DConfig:
    """The :class:`Detect3DConfig` of recipe ``r`` (checked complete) with the running settings ``running``
    (``preset``, ``out``, ``cache_dir``, ``workers``, ``num_examples``, ``threads``, ``device``).

    Raises:
        ValueError: an incomplete recipe, an unknown encoding or input, or no run to train.
    """
    r = check_recipe(copy.deepcopy(r))
    train = dict(r["train"])
    precision = train.pop("precision")
    train["iou_thresholds"] = tuple(train["iou_thresholds"])
    return Detect3DConfig(
        encodings=tuple(r["encodings"]), inputs=tuple(r["inputs"]), seeds=tuple(int(s) for s in r["seeds"]),
        n_train=r["n_train"], n_test=r["n_test"], image_size=r["image_size"], scene_seed=r["scene_seed"],
        scenes=r["scenes"], intrinsics=r["intrinsics"], box_param=r["box_param"], head_hidden=r["head_hidden"],
        backbone=r["backbone"], pe_overrides=r["pe_overrides"], train=DetTrainConfig(seed=0, **train),
        precision=precision, **running).validate()


def preset_config(preset: str = "default", **running: Any) -> Detect3DConfig:
    """:func:`config_from_recipe` of the pinned recipe of ``preset`` (``default``, ``gpu``, ``quick``)."""
    return config_from_recipe(recipe(preset), preset=preset, **running)


def quick_config(out: str = "runs/detect3d-quick", cache_dir: str = ".cache/scenes") -> Detect3DConfig:
    """The ``quick`` preset (tests and CI): 32 + 8 scenes of 32×32, 2 encodings × 3 inputs × 1 seed, 3 steps."""
    return preset_config("quick", out=out, cache_dir=cache_dir, workers=1, num_examples=2)


def planned_runs(cfg: Detect3DConfig) -> List[Tuple[str, str]]:
    """The ``(encoding, input)`` pairs the study trains, inputs outer: every input applies to a rotary encoding;
    an encoding without a coordinate path (``none``, ``absolute``) has no ``rgbd-coord`` model, and its
    ``rgbd-channel`` model is its ``rgbd`` one (depth as a channel either way), so it is trained once."""
    out = []
    for inp in cfg.inputs:
        for enc in cfg.encodings:
            if inp in ("rgbd-channel", "rgbd-coord") and not is_rotary(enc):
                continue
            out.append((enc, inp))
    return out


def run_settings(cfg: Detect3DConfig, enc: str, inp: str, seed: int) -> Dict[str, Any]:
    """Everything that defines run ``(enc, inp, seed)`` -- what its ``metrics.json`` must match to be reused and
    what the committed ``config.json`` records for it."""
    r = cfg.recipe()
    return {"encoding": enc, "input": inp, "seed": int(seed), "depth_input": depth_input_of(enc, inp),
            "data": {k: r[k] for k in ("n_train", "n_test", "image_size", "scene_seed", "scenes")},
            "detector": {k: r[k] for k in ("intrinsics", "box_param", "head_hidden")},
            "backbone": {**r["backbone"], **r["pe_overrides"].get(enc, {})},
            "train": {**r["train"], "seed": int(seed)}}


# --------------------------------------------------------------------------------------------- helpers


def _write_json(path: Path, obj: Any) -> None:
    atomic_write(path, json.dumps(obj, indent=1, default=_json_default) + "\n")


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, tuple):
        return list(o)
    raise TypeError(f"not JSON serialisable: {type(o)}")


def _write_csv(path: Path, rows: Sequence[Dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    cols: List[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})


def _run_name(enc: str, inp: str, seed: int) -> str:
    return f"{enc}-{inp}-s{seed}"


def _wait_lock(path: Path) -> FileLock:
    """A blocking lock on ``path``: two study processes render a scene set once (the second waits, then loads the
    shards the first wrote) and write the report one after the other."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(path))


def load_scenes(cfg: Detect3DConfig, progress: bool = True) -> Tuple[SceneSet, SceneSet]:
    """The training and test scenes (rendered once into ``cfg.cache_dir``, one process at a time)."""
    kw = dict(size=cfg.image_size, workers=cfg.workers, cache_dir=cfg.cache_dir, progress=progress,
              config=cfg.scene_config())
    with _wait_lock(Path(cfg.cache_dir) / ".render.lock"):  # two processes render a scene set once
        train = generate_scenes(cfg.n_train, seed=cfg.scene_seed, **kw)
        test = generate_scenes(cfg.n_test, seed=cfg.scene_seed + 1, **kw)
    return train, test


def build_detector(cfg: Detect3DConfig, enc: str, inp: str) -> Detector3D:
    """The (untrained) detector of encoding ``enc`` and input ``inp``: every backbone field from the recipe
    (``backbone`` with the encoding's ``pe_overrides``), ``pe`` and ``depth_input`` from the run."""
    bb = {**cfg.backbone, **cfg.pe_overrides.get(enc, {})}
    rest = {k: copy.deepcopy(v) for k, v in bb.items() if k not in ("patch_size", "depth_scale_init")}
    dcfg = detector_config(enc, inp, num_classes=len(CLASS_NAMES), image_size=cfg.image_size,
                           patch_size=bb["patch_size"], intrinsics=cfg.intrinsics, box_param=cfg.box_param,
                           head_hidden=cfg.head_hidden, depth_scale_init=bb["depth_scale_init"], **rest)
    return Detector3D(dcfg)


def _load_trained(cfg: Detect3DConfig, enc: str, inp: str, seed: int) -> Detector3D:
    """The detector of a finished run, its weights read from ``runs/<name>/model.pt``.

    ``weights_only=True``: the file is read as tensors only, so a tampered ``model.pt`` cannot run code.
    """
    model = build_detector(cfg, enc, inp)
    model.load_state_dict(torch.load(_checkpoint(cfg, enc, inp, seed), map_location="cpu", weights_only=True))
    return model.to(_device(cfg))


def _checkpoint(cfg: Detect3DConfig, enc: str, inp: str, seed: int) -> Path:
    """``runs/<name>/model.pt`` of run ``(enc, inp, seed)`` (git-ignored: absent on a fresh clone)."""
    return Path(cfg.out) / "runs" / _run_name(enc, inp, seed) / "model.pt"


def _device(cfg: Detect3DConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


def _log(msg: str) -> None:
    print(f"[detect3d {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------------------------- one run


def train_one(cfg: Detect3DConfig, enc: str, inp: str, seed: int, train_set: SceneSet, test_set: SceneSet,
              run_dir: Path) -> Dict[str, Any]:
    """Train and evaluate one detector; write its run directory; return its result row.

    A run whose ``metrics.json`` holds the same :func:`run_settings` is read back instead.  The learning curve
    (``val_mean_iou`` in ``curve.csv``) is measured on the first ``train.val_scenes`` test scenes.
    """
    from ropekit.train import engine

    tcfg = dataclasses.replace(cfg.train, seed=seed)
    settings = json.loads(json.dumps(run_settings(cfg, enc, inp, seed), default=_json_default))
    metrics_path = run_dir / "metrics.json"
    if metrics_path.exists():
        old = json.loads(metrics_path.read_text())
        if old.get("settings") == settings:
            _log(f"{run_dir.name}: done before, skipped")
            return old["row"]
    seed_everything(seed)
    model = build_detector(cfg, enc, inp)
    model.init_box_prior(mean_box(train_set))
    n_params = count_parameters(model)  # encodings by their effective count
    _write_json(run_dir / "config.json", {"detector": model.cfg.to_dict(), "settings": settings,
                                          "parameters": n_params})
    device = _device(cfg)
    opts = engine.EngineOptions(device=str(device), precision=cfg.precision, progress=False, tensorboard=False)
    t0 = time.perf_counter()
    rows = train_detector(model, train_set, tcfg, options=opts, val_scenes=test_set)
    train_s = time.perf_counter() - t0
    _write_csv(run_dir / "curve.csv", rows)
    torch.save(model.state_dict(), run_dir / "model.pt")
    t1 = time.perf_counter()
    metrics = evaluate_detector(model.to(device), test_set, tcfg, seed=0)
    eval_s = time.perf_counter() - t1
    row = {"encoding": enc, "input": inp, "depth_as": depth_label(enc, inp), "seed": seed,
           "mean_iou": metrics["mean_iou"], "mAP@0.25": metrics["mAP@0.25"], "mAP@0.5": metrics["mAP@0.5"],
           "test_loss": metrics["loss"], "final_train_loss": rows[-1]["loss"] if rows else float("nan"),
           **curve_summary(rows), "train_seconds": train_s, "eval_seconds": eval_s, "parameters": n_params,
           "device": str(device)}
    if model.backbone.depth_lift is not None:
        row["depth_scale"] = float(model.backbone.depth_lift.scale.detach())
    _write_json(metrics_path, {"row": row, "metrics": metrics, "curve": rows, "settings": settings})
    _log(f"{run_dir.name}: mean IoU {row['mean_iou']:.4f}, mAP@0.25 {row['mAP@0.25']:.4f}, "
         f"mAP@0.5 {row['mAP@0.5']:.4f} (train {train_s:.0f}s, eval {eval_s:.0f}s)")
    return row


def curve_summary(rows: Sequence[Dict[str, Any]]) -> Dict[str, float]:
    """How far the learning curve had levelled off: ``val_iou_final`` (the last ``val_mean_iou``) and
    ``val_iou_last_quarter`` (its change over the last quarter of the steps: the last value minus the one
    logged closest to 75 % of the run; NaN without a curve)."""
    pts = [(r["step"], r["val_mean_iou"]) for r in rows if "val_mean_iou" in r]
    if not pts:
        return {"val_iou_final": float("nan"), "val_iou_last_quarter": float("nan")}
    last_step, last = pts[-1]
    ref = min(pts, key=lambda p: abs(p[0] - 0.75 * last_step))[1]
    return {"val_iou_final": float(last), "val_iou_last_quarter": float(last - ref)}


# --------------------------------------------------------------------------------------------- summary


def render_examples(cfg: Detect3DConfig, test_set: SceneSet, configs: Sequence[Tuple[str, str, int]],
                    path: Path) -> Optional[Path]:
    """One row per ``(encoding, input, seed)`` model, one column per test scene: the true boxes in green and,
    in blue, the model's ``n`` highest-scoring predictions (score = best real-class probability) with ``n``
    the number of true objects in the scene -- what the detector outputs when told how many objects there
    are, duplicates included."""
    from ropekit.detection.matching import postprocess
    from ropekit.detection.plot import draw_boxes, example_grid

    n = min(cfg.num_examples, len(test_set))
    if n == 0 or not configs:
        return None
    # scenes with several objects make more informative examples
    counts = test_set.valid.sum(1)
    idx = [int(i) for i in np.flatnonzero(counts >= 2)[:n]]
    idx += [i for i in range(len(test_set)) if i not in idx][: n - len(idx)]
    scale = max(1, 256 // cfg.image_size)
    panels, labels = [], []
    for enc, inp, seed in configs:
        out = {k: v.cpu() for k, v in predict(_load_trained(cfg, enc, inp, seed), test_set, idx).items()}
        scores, _ = postprocess(out["logits"])  # (B, M)
        row = []
        for b, i in enumerate(idx):
            true = test_set.boxes[i][test_set.valid[i]]
            top = torch.argsort(scores[b], descending=True)[: len(true)].numpy()
            row.append(draw_boxes(test_set.rgb[i], test_set.K[i], true, out["boxes"][b].numpy()[top], scale=scale))
        panels.append(row)
        labels.append(f"{enc} {INPUT_LABELS.get(inp, inp)} s{seed}")
    return example_grid(panels, labels, path)


def run_errors(cfg: Detect3DConfig, row: Dict[str, Any], test_set: SceneSet) -> Dict[str, float]:
    """:func:`~ropekit.detection.train.matched_errors` of a finished run, cached in its ``errors.json``."""
    run_dir = Path(cfg.out) / "runs" / _run_name(row["encoding"], row["input"], row["seed"])
    path = run_dir / "errors.json"
    key = _run_key(json.loads((run_dir / "metrics.json").read_text())["settings"])
    if path.exists():
        doc = json.loads(path.read_text())
        if doc.get("key") == key:
            return doc["errors"]
    errors = matched_errors(_load_trained(cfg, row["encoding"], row["input"], row["seed"]), test_set, cfg.train)
    _write_json(path, {"key": key, "errors": errors})
    return errors


def _run_key(settings: Dict[str, Any]) -> str:
    return hashlib.sha1(json.dumps(settings, sort_keys=True, default=_json_default).encode()).hexdigest()[:16]


def write_report(cfg: Detect3DConfig, runs: Sequence[Dict[str, Any]], test_set: SceneSet, argv: Sequence[str]) -> Dict:
    """Aggregate files, table, plots and examples from the run rows."""
    from ropekit.detection.plot import plot_metric_bars, plot_training_curves

    out = Path(cfg.out)
    runs = [{**r, **run_errors(cfg, r, test_set)} for r in runs]
    summary = summarise(runs, cfg.encodings, cfg.inputs)
    pairs = [(a, b) for a, b in (("rgbd", "rgb"), ("rgbd", "rgbd-channel"), ("rgbd-channel", "rgb"),
                                 ("rgbd-coord", "rgb")) if a in cfg.inputs and b in cfg.inputs]
    differences = paired_differences(runs, cfg.encodings, pairs)
    command = " ".join(shlex.quote(a) for a in argv)
    _write_csv(out / "detect3d.csv", runs)
    _write_csv(out / "summary.csv", summary)
    _write_json(out / "detect3d.json", {"study": "detect3d", "preset": cfg.preset, "rows": list(runs),
                                        "summary": summary, "differences": differences, "config": cfg.to_dict(),
                                        "command": command})
    t = cfg.train
    header = (f"# detect3d results\n\n{len(runs)} runs ({cfg.preset} preset): {len(cfg.encodings)} encodings × "
              f"{len(cfg.inputs)} inputs × {len(cfg.seeds)} seeds; {cfg.n_train} training / {cfg.n_test} test scenes "
              f"of {cfg.image_size}×{cfg.image_size}; {t.steps} steps of {t.batch_size}; Monte Carlo IoU with "
              f"{t.iou_samples} points per predicted box; learning curve on the first {t.val_scenes} test scenes."
              f"\n\n")
    (out / "table.md").write_text(header + markdown_table(summary, cfg.encodings, cfg.inputs, differences))
    plot_metric_bars(runs, METRICS, out / "detect3d.png", cfg.encodings, cfg.inputs, INPUT_LABELS)
    curves: Dict[Tuple[str, str], List[List[Dict[str, float]]]] = {}
    run_index = []
    for r in runs:
        name = _run_name(r["encoding"], r["input"], r["seed"])
        mp = out / "runs" / name / "metrics.json"
        if mp.exists():
            doc = json.loads(mp.read_text())
            curves.setdefault((r["encoding"], r["input"]), []).append(doc["curve"])
            run_index.append({"name": name, "dir": f"runs/{name}", "key": _run_key(doc["settings"]),
                              "settings": doc["settings"]})
    plot_training_curves(curves, out / "training.png", "loss", INPUT_LABELS)
    val = {k: [[row for row in c if "val_mean_iou" in row] for c in v] for k, v in curves.items()}
    if any(any(c) for c in val.values()):
        plot_training_curves(val, out / "iou_curve.png", "val_mean_iou", INPUT_LABELS,
                             ylabel=f"held-out mean IoU ({t.val_scenes} test scenes, mean over seeds)")
    _write_json(out / "config.json", {"study": "detect3d", "preset": cfg.preset, "recipe": cfg.recipe(),
                                      "command": command, "runs": run_index})
    # examples: for each input, the best seed of "none" and of the best other encoding
    chosen: List[Tuple[str, str, int]] = []
    for inp in cfg.inputs:
        rows = [s for s in summary if s["input"] == inp]
        others = [s for s in rows if s["encoding"] != "none"]
        picks = [s for s in rows if s["encoding"] == "none"]
        if others:
            picks.append(max(others, key=lambda s: s["mean_iou_mean"]))
        chosen += [(s["encoding"], inp, s["best_seed"]) for s in picks]
    missing = [_run_name(*c) for c in chosen if not _checkpoint(cfg, *c).exists()]
    if missing:  # a fresh clone: checkpoints are not committed, the examples already drawn stay as they are
        _log(f"examples.png not redrawn: no checkpoint (model.pt) for {', '.join(missing)}")
    else:
        render_examples(cfg, test_set, chosen, out / "examples.png")
    (out / "command.txt").write_text(command + "\n")
    return {"summary": summary, "runs": list(runs), "differences": differences}


# --------------------------------------------------------------------------------------------- entry points


#: Seconds between looks at runs another process is training.
POLL_SECONDS = 10.0


def _train_or_wait(cfg: Detect3DConfig, plan: Sequence[Tuple[int, str, str]], train_set: SceneSet,
                   test_set: SceneSet, poll_seconds: Optional[float] = None) -> List[Dict[str, Any]]:
    """Every run of ``plan`` (``(seed, input, encoding)``), each under a lock on its run folder.

    A run another process is training (its folder locked) is passed over and taken up again at the end: by then
    it is done and read back, or its process has ended and this one trains it.  So two processes started with
    the same ``out`` share the work, and both end with every row.  Each run's error breakdown
    (:func:`run_errors`) is computed by the process that trained it, under the same lock.
    """
    from ropekit.train.engine import RunLock, RunLockedError

    rows: Dict[Tuple[int, str, str], Dict[str, Any]] = {}
    waiting = list(plan)
    total, k = len(plan), 0
    while waiting:
        later = []
        for seed, inp, enc in waiting:
            run_dir = Path(cfg.out) / "runs" / _run_name(enc, inp, seed)
            lock = RunLock(run_dir)
            try:
                lock.acquire()
            except RunLockedError:
                later.append((seed, inp, enc))
                continue
            try:
                k += 1
                _log(f"[{k}/{total}] {run_dir.name}")
                row = train_one(cfg, enc, inp, seed, train_set, test_set, run_dir)
                rows[(seed, inp, enc)] = {**row, **run_errors(cfg, row, test_set)}
            finally:
                lock.release()
        if later and len(later) == len(waiting):
            _log(f"waiting for {len(later)} run(s) another process is training: "
                 f"{', '.join(_run_name(e, i, s) for s, i, e in later)}")
            time.sleep(POLL_SECONDS if poll_seconds is None else poll_seconds)
        waiting = later
    return [rows[key] for key in plan]


def run_detect3d(cfg: Detect3DConfig, argv: Optional[Sequence[str]] = None, progress: bool = True) -> Dict:
    """Run the whole study (resuming finished runs, sharing the work with another process on the same ``out``)
    and write its report; returns ``{"summary", "runs", "differences"}``."""
    cfg.validate()
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    train_set, test_set = load_scenes(cfg, progress=progress)
    _log(f"scenes: {len(train_set)} train, {len(test_set)} test ({time.perf_counter() - t0:.0f}s); "
         f"objects per test scene {test_set.valid.sum(1).mean():.2f}")
    # seeds outermost: an early stop still leaves every configuration with some seeds
    plan = [(seed, inp, enc) for seed in cfg.seeds for enc, inp in planned_runs(cfg)]
    runs = _train_or_wait(cfg, plan, train_set, test_set)
    argv = list(argv) if argv is not None else ["python", "-m", "ropekit_studies.detection"] + sys.argv[1:]
    with _wait_lock(out / ".report.lock"):  # a second process on the same folder rewrites it after this one
        result = write_report(cfg, runs, test_set, argv)
    _log(f"done in {time.perf_counter() - t0:.0f}s; results in {out}")
    return result


def compare_recipe(doc: Dict[str, Any], where: str = "detect3d") -> List[str]:
    """Differences between a committed detect3d ``config.json`` (``doc``) and what its recorded preset resolves
    to now: the recipe as a whole, the set of runs (none missing, none extra), and every recorded run's settings
    against the settings the recipe gives that run (:func:`run_settings`). One line
    per difference; empty when the committed runs are what the documented command trains now."""
    preset = doc.get("preset")
    from ropekit.train.upgrade import upgrade_architecture

    now = json.loads(json.dumps(recipe(preset)))
    committed = dict(doc.get("recipe") or {})
    if isinstance(committed.get("backbone"), dict):  # a recipe that predates a later backbone field
        committed["backbone"] = upgrade_architecture(committed["backbone"])
    diffs = [f"{where}: recipe {k}: committed {committed.get(k, '<missing>')!r}, now {now.get(k, '<missing>')!r}"
             for k in sorted(set(committed) | set(now)) if committed.get(k, "<missing>") != now.get(k, "<missing>")]
    cfg = config_from_recipe(recipe(preset), preset=preset)
    planned = {f"{enc}-{inp}-s{seed}" for seed in cfg.seeds for enc, inp in planned_runs(cfg)}
    recorded = {run.get("name") for run in doc.get("runs", [])}
    diffs += [f"{where}: run {name} is missing" for name in sorted(planned - recorded)]
    diffs += [f"{where}: run {name} is not part of the study" for name in sorted(recorded - planned, key=str)]
    for run in doc.get("runs", []):
        s = dict(run.get("settings") or {})
        if isinstance(s.get("backbone"), dict):
            s["backbone"] = upgrade_architecture(s["backbone"])
        try:
            want = json.loads(json.dumps(run_settings(cfg, s["encoding"], s["input"], int(s["seed"]))))
        except (KeyError, TypeError, ValueError) as e:
            diffs.append(f"{where}: run {run.get('name')}: settings unreadable ({e})")
            continue
        for k in sorted(set(s) | set(want)):
            if s.get(k, "<missing>") != want.get(k, "<missing>"):
                diffs.append(f"{where}: run {run.get('name')}: {k} = {s.get(k, '<missing>')!r}, "
                             f"recipe {want.get(k, '<missing>')!r}")
    return diffs


def run_study(exp_cfg: Any, out: Any, **options: Any):
    """The ``detect3d`` entry of ``ropekit experiment`` (:mod:`ropekit_studies.registry`).

    The preset's pinned recipe (:mod:`ropekit_studies.recipes.detect3d`; ``exp_cfg.preset``: ``default``, ``gpu`` or
    ``quick``), with these settings of the shared :class:`~ropekit_studies.settings.ExperimentConfig`:
    ``pes`` (a subset of the encodings), ``seeds``, ``threads`` (the gpu preset takes up to 8 unless another
    number than the default 1 is given: its metrics run on the CPU), ``progress``; a ``cache_dir`` other than the
    default puts the rendered scenes in ``<cache_dir>/scenes`` (otherwise they go to ``.cache/scenes``).  The
    study option ``inputs`` chooses a subset of the inputs (``rgb``, ``rgbd``, ``rgbd-channel``, ``rgbd-coord``).
    The classification backbone, data and schedule settings do not apply.
    """
    import os

    from .common import StudyResult
    from .settings import ExperimentConfig

    unknown = sorted(set(options) - {"inputs"})
    if unknown:
        raise ValueError(f"experiment detect3d takes no option {', '.join(unknown)}")
    preset = exp_cfg.preset if exp_cfg.preset in PRESETS else ("quick" if exp_cfg.quick else "default")
    out = Path(out)
    r = recipe(preset)
    if exp_cfg.pes:
        r["encodings"] = [p.lower().replace("_", "-") for p in exp_cfg.pes]
    if exp_cfg.seeds and preset != "quick" and list(exp_cfg.seeds) != ExperimentConfig().seeds:
        r["seeds"] = [int(s) for s in exp_cfg.seeds]
    if options.get("inputs"):
        r["inputs"] = list(options["inputs"])
    cache = str(Path(exp_cfg.cache_dir) / "scenes") if exp_cfg.cache_dir != ExperimentConfig().cache_dir \
        else ".cache/scenes"
    threads = int(exp_cfg.threads or 0)
    if preset == "gpu" and threads == ExperimentConfig().threads:  # the CPU side (metrics) of a GPU machine
        threads = max(1, min(8, os.cpu_count() or 1))
    cfg = config_from_recipe(r, preset=preset, out=str(out), cache_dir=cache, threads=threads,
                             workers=max(1, min(8, os.cpu_count() or 1)),
                             num_examples=2 if preset == "quick" else 4)
    argv = ["ropekit", "experiment", "detect3d"] + ([] if preset == "default" else ["--preset", preset]) + \
        (["--pe", ",".join(cfg.encodings)] if exp_cfg.pes else []) + \
        (["--seeds", ",".join(str(s) for s in cfg.seeds)] if r["seeds"] != recipe(preset)["seeds"] else []) + \
        (["--inputs", ",".join(cfg.inputs)] if options.get("inputs") else []) + ["--out", str(out)]
    result = run_detect3d(cfg, argv=argv, progress=bool(exp_cfg.progress))
    files = sorted(p for p in out.iterdir() if p.is_file() and not p.name.startswith("."))  # not the lock files
    return StudyResult("detect3d", out, files, (out / "table.md").read_text(), {"summary": result["summary"]})


def _csv_list(text: str) -> Tuple[str, ...]:
    return tuple(s.strip() for s in text.split(",") if s.strip())


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``python -m ropekit_studies.detection``: a preset, then any recipe field overridden."""
    p.add_argument("--preset", choices=PRESETS, default="default", help="the pinned recipe (default: default)")
    p.add_argument("--quick", action="store_true", help="the same as --preset quick")
    p.add_argument("--encodings", type=_csv_list, default=None, help="comma-separated encodings")
    p.add_argument("--inputs", type=_csv_list, default=None, help=f"comma-separated, of {', '.join(INPUTS)}")
    p.add_argument("--seeds", type=lambda s: tuple(int(x) for x in _csv_list(s)), default=None)
    p.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                   help="any other recipe field: a top-level one (n_train=4000), backbone.FIELD (backbone.depth=6) "
                        "or train.FIELD (train.steps=600); values are read as JSON, else as text (repeatable)")
    p.add_argument("--workers", type=int, default=2, help="scene rendering processes")
    p.add_argument("--cache-dir", default=".cache/scenes", help="scene cache (npz shards)")
    p.add_argument("--num-examples", type=int, default=4)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda, cuda:1...")
    p.add_argument("--out", default=None, help="output directory (default runs/detect3d[-quick])")
    p.add_argument("--no-progress", action="store_true")


def _set_field(r: Dict[str, Any], assignment: str) -> None:
    key, sep, text = assignment.partition("=")
    if not sep:
        raise ValueError(f"--set needs KEY=VALUE, got {assignment!r}")
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = text
    section, _, name = key.rpartition(".")
    target = r[section] if section else r
    if section not in ("", "backbone", "train", "scenes") or name not in target:
        raise ValueError(f"--set {key}: not a recipe field (top level, backbone.F, train.F or scenes.F)")
    target[name] = value


def config_from_args(args: argparse.Namespace) -> Detect3DConfig:
    """The :class:`Detect3DConfig` of parsed :func:`add_arguments` options."""
    preset = "quick" if args.quick else args.preset
    r = recipe(preset)
    for key, value in (("encodings", args.encodings), ("inputs", args.inputs), ("seeds", args.seeds)):
        if value is not None:
            r[key] = list(value)
    for assignment in args.set:
        _set_field(r, assignment)
    changed = r != recipe(preset)
    out = args.out or ("runs/detect3d-quick" if preset == "quick" else "runs/detect3d")
    return config_from_recipe(r, preset=preset if not changed else f"{preset}+changes", out=out,
                              cache_dir=args.cache_dir, workers=args.workers, num_examples=args.num_examples,
                              threads=args.threads, device=args.device)


def run(args: argparse.Namespace, argv: Optional[Sequence[str]] = None) -> int:
    """Run the study from parsed arguments."""
    run_detect3d(config_from_args(args), argv=argv, progress=not args.no_progress)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m ropekit_studies.detection [options]``."""
    p = argparse.ArgumentParser(prog="python -m ropekit_studies.detection", description=__doc__.split("\n")[0])
    add_arguments(p)
    argv = list(sys.argv[1:] if argv is None else argv)
    return run(p.parse_args(argv), argv=["python", "-m", "ropekit_studies.detection"] + argv)


if __name__ == "__main__":
    sys.exit(main())
