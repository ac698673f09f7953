"""``ropekit experiment detect3d``: 3-D box detection from RGB vs RGB-D for each position encoding.

For every encoding × input × seed the same detector (:mod:`ropekit.detection.model`) is trained on the same
cached scenes with the same schedule -- only the encoding, the input and the seed change -- and evaluated on a
held-out scene stream (every object; mean 3-D IoU of Hungarian-matched pairs and mAP at 3-D IoU 0.25 / 0.5,
Monte Carlo IoU with ``iou_samples`` points per predicted box).  The output directory gets:

* ``runs/<encoding>-<input>-s<seed>/``: ``config.json`` (resolved detector + training + data settings),
  ``curve.csv`` (training losses), ``metrics.json``, ``model.pt`` (state dict; git-ignored);
* the layout of the other ``ropekit experiment`` studies: ``detect3d.csv`` (one row per run),
  ``detect3d.json`` (the rows, the summary and the settings), ``table.md`` (per encoding × input, mean ±
  sample standard deviation over seeds and the best seed -- Hungarian training sometimes sticks in a poor
  minimum), ``detect3d.png`` (bars of the three metrics), ``config.json`` (settings, command line, a key per
  run);
* ``summary.csv``, ``training.png`` (loss curves), ``examples.png`` (test scenes with predicted (blue) and
  true (green) boxes) and ``command.txt`` (the command line).

A run whose ``metrics.json`` exists with the same settings is not trained again, so an interrupted experiment
resumes where it stopped.  Scenes are rendered once into ``cache_dir`` (npz shards, outside git).

Python entry point::

    from ropekit.detection.experiment import Detect3DConfig, run_detect3d
    summary = run_detect3d(Detect3DConfig(encodings=("none", "cayley"), seeds=(0,), out="runs/d3"))
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import hashlib
import json
import math
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..encodings.counting import count_parameters
from .model import BOX_PARAMS, INPUTS, INTRINSICS, Detector3D, detector_config
from .scenes import CLASS_NAMES, SceneSet, generate_scenes
from .train import DetTrainConfig, evaluate_detector, matched_errors, mean_box, predict, seed_everything, train_detector

__all__ = ["Detect3DConfig", "quick_config", "run_detect3d", "run_study", "add_arguments", "run", "main",
           "INPUT_LABELS"]

DEFAULT_ENCODINGS = ("none", "axial", "mixed", "cayley", "circulant")
INPUT_LABELS = {"rgb": "RGB (ViT)", "rgbd": "RGB-D (ViTD)", "rgbd-channel": "RGB-D (depth channel)"}
METRICS = ("mean_iou", "mAP@0.25", "mAP@0.5")
ERRORS = ("lateral_err", "depth_err", "size_err", "rot_err_deg", "class_acc")


@dataclass
class Detect3DConfig:
    """Settings of the whole study (saved with each run)."""

    encodings: Tuple[str, ...] = DEFAULT_ENCODINGS
    inputs: Tuple[str, ...] = ("rgb", "rgbd")
    seeds: Tuple[int, ...] = (0, 1, 2)
    # data
    n_train: int = 8000
    n_test: int = 500
    image_size: int = 64
    scene_seed: int = 0  # training scenes use this stream, test scenes the stream scene_seed + 1
    workers: int = 2
    cache_dir: str = ".cache/scenes"
    # model
    model_size: str = "tiny"
    layers: int = 4
    patch_size: int = 8
    intrinsics: str = "focal"
    box_param: str = "ray"
    depth_scale_init: float = 5.0
    # training / evaluation
    train: DetTrainConfig = field(default_factory=DetTrainConfig)
    # output
    out: str = "runs/detect3d"
    num_examples: int = 4
    threads: int = 0  # torch threads (0: leave torch's default)
    quick: bool = False

    def validate(self) -> "Detect3DConfig":
        from .. import list_pes

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
        return self

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["train"] = self.train.to_dict()
        for k in ("encodings", "inputs", "seeds"):
            d[k] = list(d[k])
        return d


def quick_config(out: str = "runs/detect3d-quick", cache_dir: str = ".cache/scenes") -> Detect3DConfig:
    """The ``--quick`` (CI) setting: 32 + 8 scenes of 32×32, 2 encodings × 2 inputs × 1 seed, 3 steps."""
    return Detect3DConfig(
        encodings=("none", "cayley"), inputs=("rgb", "rgbd"), seeds=(0,), n_train=32, n_test=8, image_size=32,
        workers=1, cache_dir=cache_dir, layers=2, patch_size=8, out=out, num_examples=2, quick=True,
        train=DetTrainConfig(steps=3, batch_size=8, warmup_steps=1, log_every=1, eval_batch_size=8,
                             iou_samples=256),
    )


# --------------------------------------------------------------------------------------------- helpers


def _write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=_json_default) + "\n")
    tmp.replace(path)


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


def _depth_label(cfg: Detect3DConfig, enc: str, inp: str) -> str:
    """How depth reaches the model: ``-`` (RGB), ``coordinate`` or ``channel``."""
    if inp == "rgb":
        return "-"
    return detector_config(enc, inp, image_size=cfg.image_size, patch_size=cfg.patch_size).vit.resolved().depth_input \
        .replace("coord", "coordinate")


def load_scenes(cfg: Detect3DConfig, progress: bool = True) -> Tuple[SceneSet, SceneSet]:
    """The training and test scenes (rendered once into ``cfg.cache_dir``)."""
    kw = dict(size=cfg.image_size, workers=cfg.workers, cache_dir=cfg.cache_dir, progress=progress)
    train = generate_scenes(cfg.n_train, seed=cfg.scene_seed, **kw)
    test = generate_scenes(cfg.n_test, seed=cfg.scene_seed + 1, **kw)
    return train, test


def _build(cfg: Detect3DConfig, enc: str, inp: str) -> Detector3D:
    dcfg = detector_config(enc, inp, size=cfg.model_size, num_classes=len(CLASS_NAMES), image_size=cfg.image_size,
                           patch_size=cfg.patch_size, intrinsics=cfg.intrinsics, box_param=cfg.box_param,
                           depth_scale_init=cfg.depth_scale_init, depth=cfg.layers)
    return Detector3D(dcfg)


def _load_trained(cfg: Detect3DConfig, enc: str, inp: str, seed: int) -> Detector3D:
    """The detector of a finished run, its weights read from ``runs/<name>/model.pt``.

    ``weights_only=True``: the file is read as tensors only, so a tampered ``model.pt`` cannot run code.
    """
    model = _build(cfg, enc, inp)
    path = Path(cfg.out) / "runs" / _run_name(enc, inp, seed) / "model.pt"
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return model


def _log(msg: str) -> None:
    print(f"[detect3d {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------------------------- one run


def train_one(cfg: Detect3DConfig, enc: str, inp: str, seed: int, train_set: SceneSet, test_set: SceneSet,
              run_dir: Path) -> Dict[str, Any]:
    """Train and evaluate one detector; write its run directory; return its result row."""
    tcfg = dataclasses.replace(cfg.train, seed=seed)
    settings = {"study": {k: v for k, v in cfg.to_dict().items() if k not in ("train", "out", "seeds", "encodings",
                                                                              "inputs", "threads", "workers",
                                                                              "num_examples", "cache_dir")},
                "train": tcfg.to_dict(), "encoding": enc, "input": inp, "seed": seed}
    metrics_path = run_dir / "metrics.json"
    if metrics_path.exists():
        old = json.loads(metrics_path.read_text())
        if old.get("settings") == json.loads(json.dumps(settings, default=_json_default)):
            _log(f"{run_dir.name}: done before, skipped")
            return old["row"]
    seed_everything(seed)
    model = _build(cfg, enc, inp)
    model.init_box_prior(mean_box(train_set))
    n_params = count_parameters(model)  # encodings by their effective count
    _write_json(run_dir / "config.json", {"detector": model.cfg.to_dict(), **settings, "parameters": n_params})
    t0 = time.perf_counter()
    rows = train_detector(model, train_set, tcfg)
    train_s = time.perf_counter() - t0
    _write_csv(run_dir / "curve.csv", rows)
    torch.save(model.state_dict(), run_dir / "model.pt")
    t1 = time.perf_counter()
    metrics = evaluate_detector(model, test_set, tcfg, seed=0)
    eval_s = time.perf_counter() - t1
    row = {"encoding": enc, "input": inp, "depth_as": _depth_label(cfg, enc, inp), "seed": seed,
           "mean_iou": metrics["mean_iou"], "mAP@0.25": metrics["mAP@0.25"], "mAP@0.5": metrics["mAP@0.5"],
           "test_loss": metrics["loss"], "final_train_loss": rows[-1]["loss"] if rows else float("nan"),
           "train_seconds": train_s, "eval_seconds": eval_s, "parameters": n_params}
    if model.backbone.depth_lift is not None:
        row["depth_scale"] = float(model.backbone.depth_lift.scale.detach())
    _write_json(metrics_path, {"row": row, "metrics": metrics, "curve": rows, "settings": settings})
    _log(f"{run_dir.name}: mean IoU {row['mean_iou']:.4f}, mAP@0.25 {row['mAP@0.25']:.4f}, "
         f"mAP@0.5 {row['mAP@0.5']:.4f} (train {train_s:.0f}s, eval {eval_s:.0f}s)")
    return row


# --------------------------------------------------------------------------------------------- summary


def summarise(runs: Sequence[Dict[str, Any]], encodings: Sequence[str], inputs: Sequence[str]) -> List[Dict[str, Any]]:
    """Per encoding × input: ``<metric>_mean``, ``<metric>_std`` (sample std over seeds, 0 for one seed),
    ``<metric>_best``, ``<metric>_min``, the best seed by mean IoU and the number of seeds."""
    out = []
    for enc in encodings:
        for inp in inputs:
            rs = [r for r in runs if r["encoding"] == enc and r["input"] == inp]
            if not rs:
                continue
            s: Dict[str, Any] = {"encoding": enc, "input": inp, "depth_as": rs[0]["depth_as"], "seeds": len(rs)}
            for m in METRICS:
                v = np.array([r[m] for r in rs], float)
                s[f"{m}_mean"] = float(np.nanmean(v)) if np.isfinite(v).any() else float("nan")
                s[f"{m}_std"] = float(np.nanstd(v, ddof=1)) if np.isfinite(v).sum() > 1 else 0.0
                s[f"{m}_best"] = float(np.nanmax(v)) if np.isfinite(v).any() else float("nan")
                s[f"{m}_min"] = float(np.nanmin(v)) if np.isfinite(v).any() else float("nan")
            for m in ERRORS + ("depth_err_const",):
                v = np.array([r.get(m, np.nan) for r in rs], float)
                s[f"{m}_mean"] = float(np.nanmean(v)) if np.isfinite(v).any() else float("nan")
            s["best_seed"] = int(max(rs, key=lambda r: r["mean_iou"])["seed"])
            out.append(s)
    return out


def markdown_table(summary: Sequence[Dict[str, Any]], encodings: Sequence[str], inputs: Sequence[str]) -> str:
    """Tables of mean 3-D IoU and mAP@0.25 / 0.5: ``mean ± std (best)`` per encoding (rows) and input (columns)."""
    lines = []
    for m, title in (("mean_iou", "Mean 3-D IoU (Hungarian-matched, every test object)"),
                     ("mAP@0.25", "mAP at 3-D IoU 0.25"), ("mAP@0.5", "mAP at 3-D IoU 0.5")):
        lines += [f"**{title}** — mean ± std over seeds (best seed)", ""]
        lines.append("| encoding | " + " | ".join(INPUT_LABELS.get(i, i) for i in inputs) + " |")
        lines.append("|---|" + "---|" * len(inputs))
        for enc in encodings:
            cells = []
            for inp in inputs:
                s = next((r for r in summary if r["encoding"] == enc and r["input"] == inp), None)
                if s is None:
                    cells.append("–")
                    continue
                spread = f" ± {s[f'{m}_std']:.3f}" if s["seeds"] > 1 else ""
                cell = f"{s[f'{m}_mean']:.3f}{spread} ({s[f'{m}_best']:.3f})"
                if inp != "rgb" and s["depth_as"] == "channel" and inp == "rgbd":
                    cell += " †"
                cells.append(cell)
            lines.append(f"| {enc} | " + " | ".join(cells) + " |")
        lines.append("")
    if any(f"{ERRORS[0]}_mean" in s for s in summary):
        lines += ["**Where the boxes go wrong** — Hungarian-matched pairs, mean over seeds: centre error across "
                  "(lateral) and along (depth) the optical axis and size error in cm, rotation error in degrees, "
                  "matched class accuracy", ""]
        lines.append("| encoding | input | depth as | lateral cm | depth cm | size cm | rotation ° | class acc |")
        lines.append("|---|---|---|---:|---:|---:|---:|---:|")
        for enc in encodings:
            for inp in inputs:
                s = next((r for r in summary if r["encoding"] == enc and r["input"] == inp), None)
                if s is None:
                    continue
                lines.append(f"| {enc} | {INPUT_LABELS.get(inp, inp)} | {s['depth_as']} | "
                             f"{100 * s['lateral_err_mean']:.1f} | {100 * s['depth_err_mean']:.1f} | "
                             f"{100 * s['size_err_mean']:.1f} | {s['rot_err_deg_mean']:.0f} | "
                             f"{s['class_acc_mean']:.2f} |")
        const = np.nanmean([s.get("depth_err_const_mean", np.nan) for s in summary])
        lines += ["", f"For scale: always answering the median object depth of the test scenes gives a depth error "
                      f"of {100 * const:.1f} cm.", ""]
    if any(s["depth_as"] == "channel" and s["input"] == "rgbd" for s in summary):
        lines.append("† no coordinate path: depth enters as a fourth input channel.")
        lines.append("")
    return "\n".join(lines)


def render_examples(cfg: Detect3DConfig, test_set: SceneSet, configs: Sequence[Tuple[str, str, int]],
                    path: Path) -> Optional[Path]:
    """One row per ``(encoding, input, seed)`` model, one column per test scene: the true boxes in green and,
    in blue, the model's ``n`` highest-scoring predictions (score = best real-class probability) with ``n``
    the number of true objects in the scene -- what the detector outputs when told how many objects there
    are, duplicates included."""
    from .matching import postprocess
    from .plot import draw_boxes, example_grid

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
        out = predict(_load_trained(cfg, enc, inp, seed), test_set, idx)
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
    from .plot import plot_metric_bars, plot_training_curves

    out = Path(cfg.out)
    runs = [{**r, **run_errors(cfg, r, test_set)} for r in runs]
    summary = summarise(runs, cfg.encodings, cfg.inputs)
    command = " ".join(shlex.quote(a) for a in argv)
    _write_csv(out / "detect3d.csv", runs)
    _write_csv(out / "summary.csv", summary)
    _write_json(out / "detect3d.json", {"study": "detect3d", "rows": list(runs), "summary": summary,
                                        "config": cfg.to_dict(), "command": command})
    header = (f"# detect3d results\n\n{len(runs)} runs: {len(cfg.encodings)} encodings × {len(cfg.inputs)} inputs × "
              f"{len(cfg.seeds)} seeds; {cfg.n_train} training / {cfg.n_test} test scenes of "
              f"{cfg.image_size}×{cfg.image_size}; {cfg.train.steps} steps of {cfg.train.batch_size}; Monte Carlo "
              f"IoU with {cfg.train.iou_samples} points per predicted box.\n\n")
    (out / "table.md").write_text(header + markdown_table(summary, cfg.encodings, cfg.inputs))
    plot_metric_bars(runs, METRICS, out / "detect3d.png", cfg.encodings, cfg.inputs, INPUT_LABELS)
    curves: Dict[Tuple[str, str], List[List[Dict[str, float]]]] = {}
    run_index = []
    for r in runs:
        name = _run_name(r["encoding"], r["input"], r["seed"])
        mp = out / "runs" / name / "metrics.json"
        if mp.exists():
            doc = json.loads(mp.read_text())
            curves.setdefault((r["encoding"], r["input"]), []).append(doc["curve"])
            run_index.append({"name": name, "dir": f"runs/{name}", "key": _run_key(doc["settings"])})
    plot_training_curves(curves, out / "training.png", "loss", INPUT_LABELS)
    _write_json(out / "config.json", {"experiment": cfg.to_dict(), "command": command, "runs": run_index})
    # examples: for each input, the best seed of "none" and of the best other encoding
    chosen: List[Tuple[str, str, int]] = []
    for inp in cfg.inputs:
        rows = [s for s in summary if s["input"] == inp]
        others = [s for s in rows if s["encoding"] != "none"]
        picks = [s for s in rows if s["encoding"] == "none"]
        if others:
            picks.append(max(others, key=lambda s: s["mean_iou_mean"]))
        chosen += [(s["encoding"], inp, s["best_seed"]) for s in picks]
    render_examples(cfg, test_set, chosen, out / "examples.png")
    (out / "command.txt").write_text(command + "\n")
    return {"summary": summary, "runs": list(runs)}


# --------------------------------------------------------------------------------------------- entry points


def run_detect3d(cfg: Detect3DConfig, argv: Optional[Sequence[str]] = None, progress: bool = True) -> Dict:
    """Run the whole study (resuming finished runs) and write its report; returns ``{"summary", "runs"}``."""
    cfg.validate()
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    train_set, test_set = load_scenes(cfg, progress=progress)
    _log(f"scenes: {len(train_set)} train, {len(test_set)} test ({time.perf_counter() - t0:.0f}s); "
         f"objects per test scene {test_set.valid.sum(1).mean():.2f}")
    runs = []
    total = len(cfg.encodings) * len(cfg.inputs) * len(cfg.seeds)
    k = 0
    for seed in cfg.seeds:  # seeds outermost: an early stop still leaves every configuration with some seeds
        for inp in cfg.inputs:
            for enc in cfg.encodings:
                k += 1
                _log(f"[{k}/{total}] {_run_name(enc, inp, seed)}")
                runs.append(train_one(cfg, enc, inp, seed, train_set, test_set,
                                      out / "runs" / _run_name(enc, inp, seed)))
    argv = list(argv) if argv is not None else ["python", "-m", "ropekit.detection.experiment"] + sys.argv[1:]
    result = write_report(cfg, runs, test_set, argv)
    _log(f"done in {time.perf_counter() - t0:.0f}s; results in {out}")
    return result


def run_study(exp_cfg: Any, out: Any, **options: Any):
    """The ``detect3d`` entry of ``ropekit experiment`` (:mod:`ropekit.experiments.registry`).

    From the shared :class:`~ropekit.experiments.settings.ExperimentConfig` it takes ``quick`` (the preset),
    ``pes`` (the encodings; default :data:`DEFAULT_ENCODINGS`), ``seeds``, ``threads`` and ``progress``; a
    ``cache_dir`` other than the default puts the rendered scenes in ``<cache_dir>/scenes`` (otherwise they go
    to this study's ``.cache/scenes``).  The classification backbone, data and schedule settings do not apply;
    ``python -m ropekit.detection.experiment`` exposes this study's own settings (scenes, steps, inputs...).
    """
    from ..experiments.common import StudyResult
    from ..experiments.settings import ExperimentConfig

    if options:
        raise ValueError(f"experiment detect3d takes no option {', '.join(sorted(options))}")
    out = Path(out)
    base = quick_config(out=str(out)) if exp_cfg.quick else Detect3DConfig(out=str(out))
    changes: Dict[str, Any] = {"threads": int(exp_cfg.threads or 0)}
    if exp_cfg.cache_dir != ExperimentConfig().cache_dir:
        changes["cache_dir"] = str(Path(exp_cfg.cache_dir) / "scenes")
    if exp_cfg.pes:
        changes["encodings"] = tuple(exp_cfg.pes)
    if exp_cfg.seeds and not exp_cfg.quick:
        changes["seeds"] = tuple(int(s) for s in exp_cfg.seeds)
    cfg = dataclasses.replace(base, **changes)
    argv = ["ropekit", "experiment", "detect3d"] + (["--quick"] if cfg.quick else []) + \
        (["--pe", ",".join(cfg.encodings)] if exp_cfg.pes else []) + \
        (["--seeds", ",".join(str(s) for s in cfg.seeds)] if not cfg.quick else []) + ["--out", str(out)]
    result = run_detect3d(cfg, argv=argv, progress=bool(exp_cfg.progress))
    files = sorted(p for p in out.iterdir() if p.is_file())
    return StudyResult("detect3d", out, files, (out / "table.md").read_text(), {"summary": result["summary"]})


def _csv_list(text: str) -> Tuple[str, ...]:
    return tuple(s.strip() for s in text.split(",") if s.strip())


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``ropekit experiment detect3d``."""
    d, t = Detect3DConfig(), DetTrainConfig()
    p.add_argument("--quick", action="store_true", help="tiny CI setting (overrides the size options)")
    p.add_argument("--encodings", type=_csv_list, default=d.encodings, help="comma-separated encodings")
    p.add_argument("--inputs", type=_csv_list, default=d.inputs, help=f"comma-separated, of {', '.join(INPUTS)}")
    p.add_argument("--seeds", type=lambda s: tuple(int(x) for x in _csv_list(s)), default=d.seeds)
    p.add_argument("--n-train", type=int, default=d.n_train)
    p.add_argument("--n-test", type=int, default=d.n_test)
    p.add_argument("--image-size", type=int, default=d.image_size)
    p.add_argument("--scene-seed", type=int, default=d.scene_seed)
    p.add_argument("--workers", type=int, default=d.workers, help="scene rendering processes")
    p.add_argument("--cache-dir", default=d.cache_dir, help="scene cache (npz shards)")
    p.add_argument("--model-size", default=d.model_size)
    p.add_argument("--layers", type=int, default=d.layers, help="transformer blocks")
    p.add_argument("--patch-size", type=int, default=d.patch_size)
    p.add_argument("--intrinsics", choices=INTRINSICS, default=d.intrinsics,
                   help="focal: the box head sees the per-image field of view; none: pixels only")
    p.add_argument("--box-param", choices=BOX_PARAMS, default=d.box_param,
                   help="ray: centre on the token's viewing ray at the predicted depth + offset; direct: raw 12-vector")
    p.add_argument("--depth-scale-init", type=float, default=d.depth_scale_init)
    p.add_argument("--steps", type=int, default=t.steps)
    p.add_argument("--batch-size", type=int, default=t.batch_size)
    p.add_argument("--lr", type=float, default=t.lr)
    p.add_argument("--max-train-objects", type=int, default=t.max_train_objects)
    p.add_argument("--iou-samples", type=int, default=t.iou_samples, help="Monte Carlo points per predicted box")
    p.add_argument("--num-examples", type=int, default=d.num_examples)
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads (0: default)")
    p.add_argument("--out", default=None, help="output directory (default runs/detect3d[-quick])")
    p.add_argument("--no-progress", action="store_true")


def config_from_args(args: argparse.Namespace) -> Detect3DConfig:
    if args.quick:
        cfg = quick_config(out=args.out or "runs/detect3d-quick", cache_dir=args.cache_dir)
        return dataclasses.replace(cfg, threads=args.threads)
    train = DetTrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                           max_train_objects=args.max_train_objects, iou_samples=args.iou_samples)
    return Detect3DConfig(
        encodings=tuple(args.encodings), inputs=tuple(args.inputs), seeds=tuple(args.seeds), n_train=args.n_train,
        n_test=args.n_test, image_size=args.image_size, scene_seed=args.scene_seed, workers=args.workers,
        cache_dir=args.cache_dir, model_size=args.model_size, layers=args.layers, patch_size=args.patch_size,
        intrinsics=args.intrinsics, box_param=args.box_param, depth_scale_init=args.depth_scale_init, train=train,
        out=args.out or "runs/detect3d", num_examples=args.num_examples, threads=args.threads)


def run(args: argparse.Namespace, argv: Optional[Sequence[str]] = None) -> int:
    """Run ``ropekit experiment detect3d`` from parsed arguments."""
    run_detect3d(config_from_args(args), argv=argv, progress=not args.no_progress)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m ropekit.detection.experiment [options]``."""
    p = argparse.ArgumentParser(prog="python -m ropekit.detection.experiment", description=__doc__.split("\n")[0])
    add_arguments(p)
    argv = list(sys.argv[1:] if argv is None else argv)
    return run(p.parse_args(argv), argv=["python", "-m", "ropekit.detection.experiment"] + argv)


if __name__ == "__main__":
    sys.exit(main())
