"""``ropekit experiment owl``: open-vocabulary detection (OWL-ViT) from contrastively trained towers, for each
position encoding -- the STRING paper's Table 3 (2-D boxes, AP) and Table 4 (3-D boxes by text, IoU), ComRoPE's
Table 2 (detection AP).

For every encoding × seed the study

1. trains the contrastive model (``ropekit train --task retrieval``: an RGB ViT and the text tower with the SigLIP
   loss on captioned scenes; :func:`ropekit.detection.owl_towers.pretrain_towers`) -- or reuses the run folder
   under ``<out>/pretrain/`` when its settings match;
2. trains an OWL-ViT detector on those towers (:mod:`ropekit.detection.owl_task`) on the scenes' 2-D boxes with the
   names of the *seen* classes as queries (the held-out classes' objects are no targets and their names no
   queries: they are known only from the captions) and scores COCO AP on held-out scenes with every class's name
   as a query: ``AP``, ``AP50``, ``AP75``, ``AP_seen``, ``AP_unseen``;
3. for the 3-D arms (ViT on RGB against ViTD on RGB-D, depth as the third coordinate of the rotary encoding),
   trains the 3-D box head with the text-query class head and scores the mean 3-D IoU of the matched boxes, the
   fraction of objects matched with IoU > 0.25 and the median error of the box centres' depth. With
   ``three_d_solid`` (every pinned recipe) the 3-D boxes are the volumes of blocks as deep as their true size, the
   card their front face (:class:`ropekit.data.captioned.SceneConfig` ``solid``): the images and captions are
   the same as the contrastive and 2-D runs', only the 3-D targets differ.

``boxes`` (``--boxes 2d`` or ``3d``) trains only the detectors of that kind (and the contrastive runs they need);
the other kind's finished runs are read back from their ``metrics.json`` into the report.

Differences are paired by seed: each encoding − APE (2-D AP, AP on the unseen classes) and, in 3-D, ViTD − ViT
for the same encoding and each rotary encoding − APE on RGB.  Every setting comes from a pinned recipe
(:data:`RECIPES`: ``default`` for a 2-core CPU, ``gpu``, ``quick`` for the tests), saved in ``config.json``.

Output folder: ``pretrain/<enc>-<input>-s<seed>/`` (contrastive runs: ``checkpoint.pt`` git-ignored),
``runs/<kind>-<enc>-<input>-s<seed>/`` (``metrics.json``, ``metrics.csv``, ``examples.png``), ``owl.csv`` (one row
per run), ``owl.json`` (rows, summary, paired differences), ``table.md``, ``owl.png`` (bars),
``examples_2d.png`` / ``examples_3d.png`` (detections with their text queries), ``config.json``, ``command.txt``.
"""

from __future__ import annotations

import copy
import csv
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .common import StudyResult
from .recipes import PRESETS
from .registry import register_study
from .verdict import RULE, judge, judge_one

__all__ = ["RECIPES", "owl_recipe", "planned", "run_settings", "run_owl", "compare_owl", "reading"]

_ENCODINGS = ["absolute", "axial", "mixed", "circulant", "cayley", "liere", "comrope-ld"]
_OWL_TRAIN = {"lr": 2e-3, "min_lr": 1e-5, "weight_decay": 0.05, "grad_clip": 1.0, "class_weight": 2.0,
              "box_weight": 5.0, "giou_weight": 2.0, "corner_weight": 5.0, "max_dets": 100, "iou_samples": 512}

#: The pinned recipes. ``towers``: the vision tower (patch size, width, depth, heads, MLP ratio) and the text
#: tower and joint width of the contrastive model; ``pretrain``: its schedule (epochs over the training scenes);
#: ``owl``: the detector's schedule and loss weights (2-D and 3-D alike); ``three_d``: the ``[encoding, input]``
#: arms of the 3-D boxes; ``three_d_solid``: the 3-D boxes are blocks as deep as their true size (not 2 cm cards).
RECIPES: Dict[str, Dict[str, Any]] = {
    "default": {
        "encodings": _ENCODINGS, "seeds": [0, 1, 2],
        "three_d": [["absolute", "rgb"], ["cayley", "rgb"], ["cayley", "rgbd"]], "three_d_solid": True,
        "data": {"num_train": 1500, "num_test": 300, "image_size": 32, "min_objects": 1, "max_objects": 3,
                 "shape_fraction": 0.4, "seed": 0, "vocabulary": "colour", "unseen": ["purple", "cyan"],
                 "min_visible": 0.25},
        "towers": {"patch_size": 4, "width": 64, "depth": 2, "heads": 2, "mlp_ratio": 2.0, "embed_dim": 64,
                   "text_width": 64, "text_depth": 2, "text_heads": 2},
        "pretrain": {"epochs": 6, "batch_size": 64, "lr": 2e-3, "weight_decay": 0.05, "warmup_epochs": 0.5,
                     "min_lr": 1e-5, "grad_clip": 1.0},
        "owl": {**_OWL_TRAIN, "steps": 250, "batch_size": 32, "warmup_steps": 25, "log_every": 25},
    },
    "gpu": {
        "encodings": _ENCODINGS, "seeds": [0, 1, 2],
        "three_d": [["absolute", "rgb"], ["absolute", "rgbd"], ["cayley", "rgb"], ["cayley", "rgbd"],
                    ["circulant", "rgb"], ["circulant", "rgbd"], ["axial", "rgb"], ["axial", "rgbd"]],
        "three_d_solid": True,
        "data": {"num_train": 20000, "num_test": 2000, "image_size": 48, "min_objects": 1, "max_objects": 4,
                 "shape_fraction": 0.4, "seed": 0, "vocabulary": "class", "unseen": ["7", "9", "triangle"],
                 "min_visible": 0.25},
        "towers": {"patch_size": 4, "width": 192, "depth": 6, "heads": 4, "mlp_ratio": 4.0, "embed_dim": 128,
                   "text_width": 128, "text_depth": 4, "text_heads": 4},
        "pretrain": {"epochs": 20, "batch_size": 256, "lr": 1e-3, "weight_decay": 0.05, "warmup_epochs": 1,
                     "min_lr": 1e-5, "grad_clip": 1.0},
        "owl": {**_OWL_TRAIN, "lr": 5e-4, "steps": 3000, "batch_size": 64, "warmup_steps": 150,
                "log_every": 100},
    },
    "quick": {
        "encodings": ["absolute", "cayley"], "seeds": [0],
        "three_d": [["cayley", "rgb"], ["cayley", "rgbd"]], "three_d_solid": True,
        "data": {"num_train": 16, "num_test": 8, "image_size": 16, "min_objects": 1, "max_objects": 2,
                 "shape_fraction": 0.4, "seed": 0, "vocabulary": "colour", "unseen": ["purple", "cyan"],
                 "min_visible": 0.25},
        "towers": {"patch_size": 4, "width": 24, "depth": 1, "heads": 2, "mlp_ratio": 2.0, "embed_dim": 16,
                   "text_width": 16, "text_depth": 1, "text_heads": 2},
        "pretrain": {"epochs": 1, "batch_size": 8, "lr": 1e-3, "weight_decay": 0.05, "warmup_epochs": 0,
                     "min_lr": 1e-5, "grad_clip": 1.0},
        "owl": {**_OWL_TRAIN, "steps": 2, "batch_size": 8, "warmup_steps": 1, "log_every": 2, "iou_samples": 64},
    },
}

#: The papers' numbers, quoted next to ours in ``table.md``.
PAPER_NUMBERS = """\
The papers' numbers (their data sets and model sizes: the direction and size of the published effect, not a level
these runs should reach):

* STRING, Table 3 (OWL-ViT on COCO / LVIS, AP): baseline 32.44 / 21.98; RoPE 33.66 (COCO); Cayley-STRING 33.47
  (COCO) and the best LVIS AP, 23.01.
* STRING, Table 4 (open-vocabulary 3-D boxes queried by text, towers from the contrastive model, 3-D IoU, best of
  3 seeds): its RGB ViT models reach 50–59 % IoU, ViTD with STRING above the ViT baseline.
* ComRoPE, Table 2 (COCO detection, AP): APE 44.0, LieRE 44.5, ComRoPE-LD 44.7.
"""


def owl_recipe(preset: str) -> Dict[str, Any]:
    """A deep copy of the pinned recipe of ``preset``."""
    if preset not in RECIPES:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(RECIPES)}")
    return copy.deepcopy(RECIPES[preset])


def planned(r: Dict[str, Any]) -> List[Tuple[str, str, str, int]]:
    """Every run ``(kind, encoding, input, seed)`` of recipe ``r``, seeds outermost (``kind``: ``pretrain``,
    ``owl2d``, ``owl3d``)."""
    out = []
    for seed in r["seeds"]:
        pre = list(dict.fromkeys([(e, "rgb") for e in r["encodings"]] + [tuple(a) for a in r["three_d"]]))
        out += [("pretrain", e, i, seed) for e, i in pre]
        out += [("owl2d", e, "rgb", seed) for e in r["encodings"]]
        out += [("owl3d", e, i, seed) for e, i in (tuple(a) for a in r["three_d"])]
    return out


def run_name(kind: str, enc: str, inp: str, seed: int) -> str:
    return f"{enc}-{inp}-s{seed}" if kind == "pretrain" else f"{kind}-{enc}-{inp}-s{seed}"


def run_settings(r: Dict[str, Any], kind: str, enc: str, inp: str, seed: int) -> Dict[str, Any]:
    """Everything that defines one run (what its ``metrics.json`` must hold to be reused)."""
    s = {"kind": kind, "encoding": enc, "input": inp, "seed": int(seed), "data": r["data"], "towers": r["towers"],
         "pretrain": r["pretrain"]}
    if kind != "pretrain":
        s["owl"] = r["owl"]
    if kind == "owl3d" and r.get("three_d_solid"):
        s["three_d_solid"] = True
    return json.loads(json.dumps(s))


# --------------------------------------------------------------------------------------------- runs


def _log(msg: str) -> None:
    print(f"[owl] {msg}", file=sys.stderr, flush=True)


def _write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=float) + "\n")
    tmp.replace(path)


def _done(path: Path, settings: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    if path.is_file():
        doc = json.loads(path.read_text())
        if doc.get("settings") == settings:
            return doc
    return None


def _data_config(r: Dict[str, Any], kind: str = "owl2d"):
    from ropekit.detection.owl_task import OwlDataConfig

    d = dict(r["data"])
    d["unseen"] = tuple(d["unseen"])
    return OwlDataConfig(**d, solid=kind == "owl3d" and bool(r.get("three_d_solid")))


def _pretrain(r: Dict[str, Any], enc: str, inp: str, seed: int, out: Path, device: str, threads: int) -> Path:
    from ropekit.detection.owl_towers import pretrain_towers

    run_dir = out / "pretrain" / run_name("pretrain", enc, inp, seed)
    settings = run_settings(r, "pretrain", enc, inp, seed)
    doc = _done(run_dir / "settings.json", settings)
    if doc is not None and (run_dir / "checkpoint.pt").is_file():
        return run_dir
    if run_dir.exists():
        shutil.rmtree(run_dir)
    t0 = time.perf_counter()
    metrics = pretrain_towers(enc, inp, seed, data=r["data"], towers=r["towers"], schedule=r["pretrain"],
                              run_dir=run_dir, device=device, threads=threads)
    _write_json(run_dir / "settings.json", {"settings": settings, "metrics": metrics,
                                            "seconds": time.perf_counter() - t0})
    return run_dir


def _train_owl(r: Dict[str, Any], kind: str, enc: str, inp: str, seed: int, out: Path, sets: Tuple[Any, Any],
               device: str) -> Dict[str, Any]:
    from ropekit.detection.owl_task import OwlTaskConfig, OwlTrainConfig, evaluate_owl, plot_owl_examples, train_owl
    from ropekit.train.engine import EngineOptions

    run_dir = out / "runs" / run_name(kind, enc, inp, seed)
    settings = run_settings(r, kind, enc, inp, seed)
    doc = _done(run_dir / "metrics.json", settings)
    if doc is not None:
        return doc
    if run_dir.exists():
        shutil.rmtree(run_dir)
    data = _data_config(r, kind)
    cfg = OwlTaskConfig(init_from=str(out / "pretrain" / run_name("pretrain", enc, inp, seed)),
                        boxes="2d" if kind == "owl2d" else "3d", data=data,
                        train=OwlTrainConfig(seed=int(seed), **r["owl"]))
    t0 = time.perf_counter()
    model, towers, history = train_owl(cfg, sets[0], out_dir=run_dir,
                                       options=EngineOptions(device=device, progress=False, tensorboard=False))
    seconds = time.perf_counter() - t0
    metrics = evaluate_owl(model, sets[1], towers.tokenize, data, cfg.train)
    plot_owl_examples(model, sets[1], towers.tokenize, run_dir / "examples.png", data=data)
    doc = {"settings": settings, "metrics": metrics, "seconds": seconds, "curve": history}
    _write_json(run_dir / "metrics.json", doc)
    (run_dir / "checkpoint.pt").unlink(missing_ok=True)  # (the detector is not reused; the report needs the PNG)
    return doc


def run_owl(r: Dict[str, Any], out: Path, *, preset: str, argv: Sequence[str], device: str = "cpu",
            threads: int = 1, boxes: Sequence[str] = ("2d", "3d")) -> Dict[str, Any]:
    """Run (or resume) every run of recipe ``r`` into ``out`` and write the report; returns the summary.
    ``boxes``: the detector kinds to train (``"2d"``, ``"3d"``); the other kind's runs are read back from their
    ``metrics.json`` when their settings match (and left out of the report otherwise)."""
    import torch

    from ropekit.detection.owl_task import load_scenes

    bad = sorted(set(boxes) - {"2d", "3d"})
    if bad or not boxes:
        raise ValueError(f"boxes must be 2d and/or 3d, got {', '.join(boxes) or 'nothing'}")
    if threads > 0:
        torch.set_num_threads(threads)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    kinds = {f"owl{b}" for b in boxes}
    plan = planned(r)
    needed = {(e, i, s) for kind, e, i, s in plan if kind in kinds}
    sets = {kind: load_scenes(_data_config(r, kind)) for kind in sorted(kinds)}
    rows: List[Dict[str, Any]] = []
    for k, (kind, enc, inp, seed) in enumerate(plan, 1):
        if (kind == "pretrain" and (enc, inp, seed) not in needed) or kind not in kinds | {"pretrain"}:
            doc = _done(out / "runs" / run_name(kind, enc, inp, seed) / "metrics.json",
                        run_settings(r, kind, enc, inp, seed)) if kind != "pretrain" else None
            if doc is None:
                if kind != "pretrain":
                    _log(f"[{k}/{len(plan)}] {kind} {enc} {inp} seed {seed}: not run and not found, left out")
                continue
        else:
            _log(f"[{k}/{len(plan)}] {kind} {enc} {inp} seed {seed} ({time.perf_counter() - t0:.0f}s)")
            if kind == "pretrain":
                _pretrain(r, enc, inp, seed, out, device, threads)
                continue
            doc = _train_owl(r, kind, enc, inp, seed, out, sets[kind], device)
        pre = out / "pretrain" / run_name("pretrain", enc, inp, seed) / "settings.json"
        recall = json.loads(pre.read_text())["metrics"].get("mean_recall", float("nan")) if pre.is_file() \
            else float("nan")
        rows.append({"kind": kind, "encoding": enc, "input": inp, "seed": seed, "seconds": doc["seconds"],
                     "pretrain_recall": recall, **{m: v for m, v in doc["metrics"].items() if "/" not in m}})
    return write_report(r, rows, out, preset=preset, argv=argv)


# --------------------------------------------------------------------------------------------- report


def reading(diffs: Sequence[float], claimed: int = 1) -> str:
    """The word of paired differences against the claimed sign (``+1``: positive) by the one rule
    (:mod:`ropekit_studies.verdict`) for a family of one comparison; NaN seeds are left out, ``-`` without
    any seed. The study's table reads all its claims together (:func:`claim_verdicts`)."""
    d = [float(x) for x in diffs if x == x]
    return judge_one(d, claimed).word if d else "-"


def _judged(claims: Dict[str, Tuple[Sequence[float], int]]) -> Dict[str, Any]:
    """name -> :class:`~ropekit_studies.verdict.Verdict` (``None`` without any seed) of the claims read as one
    Holm family; NaN seeds are left out."""
    clean = {k: [float(x) for x in d if x == x] for k, (d, _) in claims.items()}
    have = {k: v for k, v in clean.items() if v}
    out = judge(have, {k: claims[k][1] for k in have})
    return {k: out.get(k) for k in claims}


def claim_verdicts(claims: Dict[str, Tuple[Sequence[float], int]]) -> Dict[str, str]:
    """name -> word for the study's claims read as one Holm family: ``claims`` maps a name to (per-seed paired
    differences, claimed sign). NaN seeds are left out; a claim without any seed reads ``-``."""
    return {k: v.word if v is not None else "-" for k, v in _judged(claims).items()}


def _cell(v: Any) -> str:
    """A verdict as the tables write it: the word, a null with its MDE."""
    if v is None:
        return "-"
    return v.word + (f" (MDE {v.mde:.3f})" if v.word == "null" else "")


def _ms(values: Sequence[float]) -> str:
    v = np.asarray([x for x in values if x == x], float)
    if len(v) == 0:
        return "-"
    return f"{v.mean():.3f} ± {v.std(ddof=1):.3f}" if len(v) > 1 else f"{v.mean():.3f}"


def _paired(rows: List[Dict[str, Any]], kind: str, a: Tuple[str, str], b: Tuple[str, str], metric: str) -> List[float]:
    by = {(x["encoding"], x["input"], x["seed"]): x.get(metric, float("nan")) for x in rows if x["kind"] == kind}
    seeds = sorted({x["seed"] for x in rows})
    return [by[(*a, s)] - by[(*b, s)] for s in seeds if (*a, s) in by and (*b, s) in by]


def write_report(r: Dict[str, Any], rows: List[Dict[str, Any]], out: Path, *, preset: str,
                 argv: Sequence[str]) -> Dict[str, Any]:
    """``owl.csv``, ``owl.json``, ``table.md``, ``owl.png``, the example figures, ``config.json``, ``command.txt``."""
    from .report import pe_label

    cols: List[str] = []
    for x in rows:
        cols += [k for k in x if k not in cols]
    with open(out / "owl.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols)
        w.writeheader()
        for x in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in x.items()})

    m2 = ("AP", "AP50", "AP75", "AP_seen", "AP_unseen", "AP_small", "AP_medium", "pretrain_recall")
    m3 = ("mean_iou", "iou25", "depth_err", "depth_err_rel", "mean_iou_seen", "mean_iou_unseen",
          "pretrain_recall")
    summary: List[Dict[str, Any]] = []
    lines = [f"# owl: open-vocabulary detection from contrastive towers ({preset} preset)\n",
             f"{len(r['seeds'])} seeds; {r['data']['num_train']} training / {r['data']['num_test']} test scenes of "
             f"{r['data']['image_size']}×{r['data']['image_size']} pixels, 1–{r['data']['max_objects']} objects; "
             f"queries are {r['data']['vocabulary']} words; held out of detection training (seen in the captions "
             f"only): {', '.join(repr(u) for u in r['data']['unseen'])}. Towers: ViT width {r['towers']['width']}, depth "
             f"{r['towers']['depth']}, patches of {r['towers']['patch_size']}; contrastive pretraining "
             f"{r['pretrain']['epochs']} epochs; detector {r['owl']['steps']} steps of {r['owl']['batch_size']}. "
             f"Mean ± sample standard deviation over seeds. `pretrain_recall`: the contrastive model's mean "
             f"image↔text recall@1/5/10 on its test pairs (the towers the detector starts from).\n",
             "## 2-D boxes (COCO AP on the test scenes, every category queried by its word)\n",
             "| encoding | " + " | ".join(m2) + " | seconds |", "|---" * (len(m2) + 2) + "|"]
    for enc in r["encodings"]:
        sel = [x for x in rows if x["kind"] == "owl2d" and x["encoding"] == enc]
        if not sel:
            continue
        s = {"kind": "owl2d", "encoding": enc, "input": "rgb", "n": len(sel)}
        for m in m2:
            v = [x.get(m, float("nan")) for x in sel]
            s[f"{m}_mean"] = float(np.nanmean(v)) if any(x == x for x in v) else float("nan")
        summary.append(s)
        lines.append(f"| {pe_label(enc)} | " + " | ".join(_ms([x.get(m, float('nan')) for x in sel]) for m in m2)
                     + f" | {np.mean([x['seconds'] for x in sel]):.0f} |")
    diffs: List[Dict[str, Any]] = []
    # the study's claims (every comparison its tables read), judged as one Holm family before they are written
    arms3 = [tuple(a) for a in r["three_d"]]
    pairs = [((e, "rgbd"), (e, "rgb"), "ViTD − ViT") for e, i in arms3 if i == "rgb" and (e, "rgbd") in arms3]
    pairs += [((e, "rgb"), ("absolute", "rgb"), "− APE (RGB)") for e, i in arms3
              if i == "rgb" and e != "absolute" and ("absolute", "rgb") in arms3]
    claims: Dict[str, Tuple[List[float], int]] = {}
    for enc in r["encodings"]:
        if enc != "absolute":
            for m in ("AP", "AP_unseen"):
                claims[f"2d {enc} {m}"] = (_paired(rows, "owl2d", (enc, "rgb"), ("absolute", "rgb"), m), 1)
    for a, b, what in pairs:
        for m, sign in (("mean_iou", 1), ("iou25", 1), ("depth_err", -1)):
            claims[f"3d {a} {b} {m}"] = (_paired(rows, "owl3d", a, b, m), sign)
    judged = _judged({k: v for k, v in claims.items() if v[0]})
    words = {k: v.word for k, v in judged.items() if v is not None}
    lines += ["", "Paired by seed, each encoding − APE (claimed: positive). Verdicts, every comparison of this page "
                  f"one family: {RULE}.\n",
              "| difference | AP | reading | AP_unseen | reading |", "|---|---|---|---|---|"]
    for enc in r["encodings"]:
        if enc == "absolute":
            continue
        d1 = _paired(rows, "owl2d", (enc, "rgb"), ("absolute", "rgb"), "AP")
        d2 = _paired(rows, "owl2d", (enc, "rgb"), ("absolute", "rgb"), "AP_unseen")
        if d1:
            w1, w2 = words.get(f"2d {enc} AP", "-"), words.get(f"2d {enc} AP_unseen", "-")
            diffs.append({"kind": "owl2d", "a": enc, "b": "absolute", "AP": d1, "AP_unseen": d2,
                          "AP_reading": w1, "AP_unseen_reading": w2})
            lines.append(f"| {pe_label(enc)} − APE | {_ms(d1)} | {_cell(judged.get(f'2d {enc} AP'))} | {_ms(d2)} | "
                         f"{_cell(judged.get(f'2d {enc} AP_unseen'))} |")
    obj = ("blocks as deep as their true size (the 3-D box is the volume; its centre lies half that depth behind the "
           "front face the depth map shows)" if r.get("three_d_solid") else "cards 2 cm deep")
    lines += ["", "## 3-D boxes by text query\n",
              f"Objects are {obj}. `mean_iou`: mean 3-D IoU of the matched boxes, every object counted (unmatched: 0); "
              "`iou25`: fraction of objects matched with IoU > 0.25; `depth_err` / `depth_err_rel`: median "
              "|z_pred − z_true| of the matched box centres, metres / relative to z_true.\n",
              "| encoding | input | " + " | ".join(m3) + " | seconds |", "|---" * (len(m3) + 3) + "|"]
    for enc, inp in (tuple(a) for a in r["three_d"]):
        sel = [x for x in rows if x["kind"] == "owl3d" and x["encoding"] == enc and x["input"] == inp]
        if not sel:
            continue
        s = {"kind": "owl3d", "encoding": enc, "input": inp, "n": len(sel)}
        for m in m3:
            s[f"{m}_mean"] = float(np.nanmean([x.get(m, float("nan")) for x in sel]))
        summary.append(s)
        label = "ViT (RGB)" if inp == "rgb" else "ViTD (RGB-D)"
        lines.append(f"| {pe_label(enc)} | {label} | " + " | ".join(_ms([x.get(m, float('nan')) for x in sel])
                                                                   for m in m3)
                     + f" | {np.mean([x['seconds'] for x in sel]):.0f} |")
    if pairs:
        lines += ["", "Paired by seed (claimed: IoU and iou25 up, depth error down):\n",
                  "| difference | mean IoU | reading | iou25 | reading | depth_err (m) | reading |",
                  "|---|---|---|---|---|---|---|"]
    for a, b, what in pairs:
        d = _paired(rows, "owl3d", a, b, "mean_iou")
        if d:
            d25 = _paired(rows, "owl3d", a, b, "iou25")
            dz = _paired(rows, "owl3d", a, b, "depth_err")
            w, w25, wz = (words.get(f"3d {a} {b} {m}", "-") for m in ("mean_iou", "iou25", "depth_err"))
            diffs.append({"kind": "owl3d", "a": list(a), "b": list(b), "mean_iou": d, "reading": w,
                          "iou25": d25, "iou25_reading": w25, "depth_err": dz, "depth_err_reading": wz})
            c, c25, cz = (_cell(judged.get(f"3d {a} {b} {m}")) for m in ("mean_iou", "iou25", "depth_err"))
            lines.append(f"| {pe_label(a[0])} {what} | {_ms(d)} | {c} | {_ms(d25)} | {c25} | {_ms(dz)} | {cz} |")
    lines += ["", PAPER_NUMBERS]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    _bars(rows, r, out / "owl.png")
    for kind, name in (("owl2d", "examples_2d.png"), ("owl3d", "examples_3d.png")):
        cand = [x for x in rows if x["kind"] == kind and x["seed"] == min(r["seeds"])]
        if cand:
            key = "AP" if kind == "owl2d" else "mean_iou"
            best = max(cand, key=lambda x: x.get(key, -1) if x.get(key, -1) == x.get(key, -1) else -1)
            src = out / "runs" / run_name(kind, best["encoding"], best["input"], best["seed"]) / "examples.png"
            if src.is_file():
                shutil.copyfile(src, out / name)
    command = " ".join(argv)
    _write_json(out / "owl.json", {"rows": rows, "summary": summary, "differences": diffs, "recipe": r})
    _write_json(out / "config.json", {"study": "owl", "preset": preset, "recipe": r, "command": command,
                                      "runs": [{"name": run_name(*p), "settings": run_settings(r, *p)}
                                               for p in planned(r)]})
    (out / "command.txt").write_text(command + "\n")
    return {"summary": summary, "differences": diffs}


def _bars(rows: List[Dict[str, Any]], r: Dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ropekit.detection.plot import save_figure
    from .report import pe_label

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), gridspec_kw={"width_ratios": [2.2, 1]})
    encs = [e for e in r["encodings"] if any(x["encoding"] == e and x["kind"] == "owl2d" for x in rows)]
    for j, (m, col) in enumerate((("AP_seen", "tab:blue"), ("AP_unseen", "tab:orange"), ("AP", "tab:gray"))):
        for i, e in enumerate(encs):
            v = [x.get(m, np.nan) for x in rows if x["kind"] == "owl2d" and x["encoding"] == e]
            axes[0].bar(i + (j - 1) * 0.27, np.nanmean(v), 0.27, yerr=np.nanstd(v, ddof=1) if len(v) > 1 else 0,
                        color=col, label=m if i == 0 else None, capsize=2)
            axes[0].plot([i + (j - 1) * 0.27] * len(v), v, "k.", ms=3)
    axes[0].set_xticks(range(len(encs)), [pe_label(e) for e in encs], fontsize=8, rotation=15)
    axes[0].set_ylabel("COCO AP (test scenes)")
    axes[0].legend(fontsize=8)
    axes[0].set_title("2-D boxes by text query", fontsize=9)
    arms = [tuple(a) for a in r["three_d"]]
    for i, (e, inp) in enumerate(arms):
        v = [x["mean_iou"] for x in rows if x["kind"] == "owl3d" and x["encoding"] == e and x["input"] == inp]
        if v:
            axes[1].bar(i, np.mean(v), 0.6, yerr=np.std(v, ddof=1) if len(v) > 1 else 0, capsize=2,
                        color="tab:green" if inp == "rgbd" else "tab:olive")
            axes[1].plot([i] * len(v), v, "k.", ms=3)
    axes[1].set_xticks(range(len(arms)), [f"{pe_label(e)}\n{'ViTD' if i == 'rgbd' else 'ViT'}" for e, i in arms],
                       fontsize=8)
    axes[1].set_ylabel("mean 3-D IoU (matched)")
    axes[1].set_title("3-D boxes by text query", fontsize=9)
    save_figure(fig, path)


def compare_owl(doc: Dict[str, Any]) -> List[str]:
    """Differences between a committed owl ``config.json`` and what its preset's recipe trains now: the recipe
    as a whole and the list of runs with their settings."""
    preset = doc.get("preset")
    if preset not in RECIPES:
        return [f"owl: unknown preset {preset!r}"]
    now = owl_recipe(preset)
    committed = doc.get("recipe") or {}
    diffs = [f"owl: recipe {k}: committed {committed.get(k, '<missing>')!r}, now {now.get(k, '<missing>')!r}"
             for k in sorted(set(committed) | set(now)) if committed.get(k, "<missing>") != now.get(k, "<missing>")]
    want = [{"name": run_name(*p), "settings": run_settings(now, *p)} for p in planned(now)]
    if doc.get("runs") != want:
        names = {x.get("name") for x in doc.get("runs", [])}
        diffs += [f"owl: run {w['name']} is missing or has other settings" for w in want
                  if w["name"] not in names or w not in doc.get("runs", [])]
        diffs += [f"owl: run {n} is not part of the study" for n in sorted(names - {w["name"] for w in want})]
    return diffs


@register_study("owl", "open-vocabulary 2-D and 3-D detection (OWL-ViT) from contrastive towers, per encoding",
                options=("boxes",), compare=compare_owl)
def run_study(exp_cfg: Any, out: Any, **options: Any) -> StudyResult:
    """The ``owl`` entry of ``ropekit experiment``: the preset's pinned recipe (:data:`RECIPES`), with ``pes`` (a
    subset of the encodings), ``seeds``, ``threads`` and ``device`` from the shared settings; the study option
    ``boxes`` (``--boxes 3d``) trains only that kind of detector (:func:`run_owl`)."""
    from .settings import ExperimentConfig

    boxes = [str(b).lower() for b in (options.pop("boxes", None) or ["2d", "3d"])]
    if options:
        raise ValueError(f"experiment owl takes no option {', '.join(sorted(options))}")
    preset = exp_cfg.preset if exp_cfg.preset in PRESETS else ("quick" if exp_cfg.quick else "default")
    r = owl_recipe(preset)
    argv = ["ropekit", "experiment", "owl"] + ([] if preset == "default" else ["--preset", preset])
    if exp_cfg.pes:
        r["encodings"] = [p.lower().replace("_", "-") for p in exp_cfg.pes]
        argv += ["--pe", ",".join(r["encodings"])]
    if exp_cfg.seeds and preset != "quick" and list(exp_cfg.seeds) != ExperimentConfig().seeds:
        r["seeds"] = [int(s) for s in exp_cfg.seeds]
        argv += ["--seeds", ",".join(str(s) for s in r["seeds"])]
    out = Path(out)
    argv += ["--out", str(out)]
    device = getattr(exp_cfg, "device", "auto") or "auto"
    if sorted(boxes) != ["2d", "3d"]:
        argv += ["--boxes", ",".join(boxes)]
    result = run_owl(r, out, preset=preset, argv=argv, device=device, threads=int(exp_cfg.threads or 0),
                     boxes=boxes)
    files = sorted(p for p in out.iterdir() if p.is_file())
    return StudyResult("owl", out, files, (out / "table.md").read_text(), {"summary": result["summary"]})
