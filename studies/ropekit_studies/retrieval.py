"""Image-text retrieval on captioned RGB-D scenes: RGB vs RGB-D vision towers and their position encodings.

The setting of the STRING paper's Table 2 (WebLI-3D: RGB and RGB-D vision towers trained against a text tower with
the SigLIP loss, image->text and text->image recall@1/5/10), at toy scale: the ``captioned-scenes`` data
(:mod:`ropekit.data.captioned`), whose captions name objects, colours, true sizes, 2-D and **depth** relations.

Arms (:data:`ARMS`), each a vision tower of the same width and depth:

* ``rgb-ape`` -- RGB ViT with a learned absolute embedding (the paper's baseline);
* ``rgbd-ape`` -- the same with depth as a fourth input channel;
* ``rgbd-rope``, ``rgbd-mixed``, ``rgbd-circulant``, ``rgbd-cayley`` -- axial RoPE, RoPE-Mixed, Circulant-STRING and
  Cayley-STRING with depth as the third coordinate of every patch (ViTD);
* ``rgb-cayley`` -- Cayley-STRING on RGB only (2-D coordinates);
* ``rgbd-cayley-both`` -- Cayley-STRING with depth both as a fourth input channel and as the third coordinate
  (``depth_input="both"``), which separates what the coordinate adds from what the depth values as input add.

Every arm trains the pinned recipe (:data:`RECIPES`; presets ``default`` for the 2-core CPU, ``gpu`` for one GPU,
``quick`` for the tests) over the same seeds; a seed fixes the initialisation and the data order of every arm, so
differences are paired by seed. Besides recall, every run scores the **depth hard negatives**: each test
caption that states a depth relation against the same caption with the relation flipped
(:mod:`ropekit.multimodal.hard_negatives`), the share of pairs where the image scores the true caption higher
(chance 0.5). Its claims (:data:`HARD_NEGATIVE_CLAIMS`) are that the RGB-D RoPE and Cayley towers sit above
chance and that the RGB-only towers, which cannot see depth, sit at chance (the control: an RGB tower above
chance would mean the depth relation can be read from 2-D cues).

The study ``retrieval-depth`` trains the same recipes on the depth-only scenes (``cues="depth-only"`` of
:class:`~ropekit.data.captioned.SceneConfig`: apparent size, image height and occlusion say nothing of depth
order), where only the depth map tells a depth relation; ``retrieval`` keeps the natural scenes.

Outputs: ``retrieval.csv`` / ``.json`` (one row per run), ``curves.csv``,
``table.md``, ``retrieval.png``, ``queries.png`` (text queries and their top-5 images, from the Cayley RGB-D run of
the first seed), ``config.json`` (preset, recipe, command, runs) and ``runs/<arm>-s<seed>/`` (each run folder, not
meant to be committed: checkpoints). A run whose folder holds a finished run of the same settings is read back, an
unfinished one resumed, so an interrupted study continues where it stopped.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .common import StudyResult
from .registry import register_study
from .report import StudyWriter, markdown_table, mean_std, setup_matplotlib
from .runs import Progress
from .verdict import RULE, bootstrap_interval, judge, judge_one

__all__ = ["ARMS", "RECIPES", "VARIANTS", "HARD_NEGATIVE_CLAIMS", "hard_negatives", "hard_negative_table",
           "DECISION_PAIR", "decision_power", "power_sentence",
           "caption_depth_counts", "depth_share_phrases",
           "PAPER_TABLE2", "recipe", "run_retrieval_study", "reading", "compare_retrieval", "CLAIMS",
           "comparisons", "comparison_table"]

#: arm -> (label, pe, depth_input).
ARMS: Dict[str, Tuple[str, str, str]] = {
    "rgb-ape": ("RGB, APE (baseline)", "absolute", "ignore"),
    "rgbd-ape": ("RGB-D, APE, depth as channel", "absolute", "channel"),
    "rgbd-rope": ("RGB-D, RoPE (axial), depth as z", "axial", "coord"),
    "rgbd-mixed": ("RGB-D, RoPE-Mixed, depth as z", "mixed", "coord"),
    "rgbd-circulant": ("RGB-D, Circulant-STRING, depth as z", "circulant", "coord"),
    "rgbd-cayley": ("RGB-D, Cayley-STRING, depth as z", "cayley", "coord"),
    "rgb-cayley": ("RGB, Cayley-STRING (2-D)", "cayley", "ignore"),
    "rgbd-cayley-both": ("RGB-D, Cayley-STRING, depth as channel and z", "cayley", "both"),
}
BASELINE = "rgb-ape"

#: The STRING paper's Table 2 (WebLI-3D, mean of i2t and t2i recall@1/5/10, percent): our arm -> its number.
PAPER_TABLE2: Dict[str, Tuple[str, float]] = {
    "rgb-ape": ("ViT (baseline)", 68.77),
    "rgbd-rope": ("RoPE", 69.86),
    "rgbd-mixed": ("RoPE-Mixed", 69.85),
    "rgbd-circulant": ("Circulant-STRING", 70.21),
    "rgbd-cayley": ("Cayley-STRING", 70.48),
}

_COMMON = dict(data="captioned-scenes", normalize=True, split_seed=0, augment_shift=0, weight_decay=0.05,
               min_lr=1e-5, model="tiny", precision="fp32")

#: preset -> {"train": TrainConfig fields, "retrieval": RetrievalOptions fields, "seeds", "arms"}.
RECIPES: Dict[str, Dict[str, Any]] = {
    "default": {
        "train": {**_COMMON, "data_options": {"num_train": 2000, "num_test": 1000, "captions_per_scene": 2},
                  "image_size": 32, "patch_size": 4, "model_options": {"embed_dim": 64, "depth": 2, "num_heads": 2},
                  "epochs": 10, "batch_size": 32, "lr": 2e-3, "warmup_epochs": 1.0, "eval_batch_size": 250},
        "retrieval": {"embed_dim": 64, "text_width": 64, "text_depth": 2, "text_heads": 2, "num_queries": 4},
        "seeds": [0, 1, 2], "arms": list(ARMS),
    },
    "gpu": {
        "train": {**_COMMON, "data_options": {"num_train": 20000, "num_test": 2000, "captions_per_scene": 3},
                  "image_size": 64, "patch_size": 8,
                  "model_options": {"embed_dim": 192, "depth": 6, "num_heads": 3}, "epochs": 20, "batch_size": 256,
                  "lr": 1e-3, "warmup_epochs": 1.0, "eval_batch_size": 500, "precision": "bf16"},
        "retrieval": {"embed_dim": 128, "text_width": 128, "text_depth": 4, "text_heads": 2, "num_queries": 4},
        "seeds": [0, 1, 2], "arms": list(ARMS),
    },
    "quick": {
        "train": {**_COMMON, "data_options": {"num_train": 32, "num_test": 16, "captions_per_scene": 1},
                  "image_size": 16, "patch_size": 4, "model_options": {"embed_dim": 16, "depth": 1, "num_heads": 2},
                  "epochs": 1, "batch_size": 16, "lr": 2e-3, "warmup_epochs": 0.0, "eval_batch_size": 250},
        "retrieval": {"embed_dim": 16, "text_width": 16, "text_depth": 1, "text_heads": 2, "num_queries": 2},
        "seeds": [0], "arms": list(ARMS),
    },
}


#: study -> the data options it sets on top of :data:`RECIPES` (``retrieval``: the natural scenes, as committed).
VARIANTS: Dict[str, Dict[str, Any]] = {"retrieval": {}, "retrieval-depth": {"cues": "depth-only"}}


def recipe(preset: str = "default", study: str = "retrieval") -> Dict[str, Any]:
    """A copy of the pinned recipe of ``preset`` for ``study`` (a key of :data:`VARIANTS`)."""
    if preset not in RECIPES:
        raise ValueError(f"unknown preset {preset!r} for retrieval; presets: {', '.join(RECIPES)}")
    if study not in VARIANTS:
        raise ValueError(f"unknown retrieval study {study!r}; studies: {', '.join(VARIANTS)}")
    r = copy.deepcopy(RECIPES[preset])
    r["train"]["data_options"].update(VARIANTS[study])
    return r


def run_settings(r: Dict[str, Any], arm: str, seed: int) -> Dict[str, Any]:
    """What one run trains (the recipe with the arm's encoding, depth input and the seed): compared with a run
    folder's ``config.json`` before reusing it."""
    _, pe, depth_input = ARMS[arm]
    return {"train": {**r["train"], "pe": pe, "depth_input": depth_input, "seed": int(seed)},
            "retrieval": dict(r["retrieval"])}


def _train_run(r: Dict[str, Any], arm: str, seed: int, run_dir: Path, threads: Optional[int],
               device: str) -> Dict[str, Any]:
    """Train (or read back, or resume) one run; its ``summary.json`` and ``metrics.csv`` rows."""
    from ropekit.multimodal import RetrievalConfig, RetrievalOptions, train_retrieval
    from ropekit.classification import TrainConfig
    from ropekit.train.metrics import read_metrics_csv
    from ropekit.train.upgrade import flatten, upgrade_config

    want = run_settings(r, arm, seed)
    summary_path, config_path = run_dir / "summary.json", run_dir / "config.json"
    same = False
    if config_path.is_file():
        doc = json.loads(config_path.read_text())
        recorded = flatten(upgrade_config(doc.get("train", {}), fill=False))  # (the nested form, or an older flat one)
        got = {"train": {k: recorded.get(k) for k in want["train"]},
               "retrieval": {k: doc.get("retrieval", {}).get(k) for k in want["retrieval"]}}
        same = json.loads(json.dumps(got)) == json.loads(json.dumps(want))
    if not same and run_dir.exists():
        if (run_dir / ".lock").exists():
            raise RuntimeError(f"{run_dir} is being written by another process (its .lock is held); run the study "
                               f"again when it is done")
        shutil.rmtree(run_dir)  # another recipe's run: start again
    finished = same and summary_path.is_file() and \
        json.loads(summary_path.read_text()).get("epochs_done") == r["train"]["epochs"]
    if not finished:
        tc = TrainConfig.from_dict({**want["train"], "out": str(run_dir), "threads": threads, "device": device,
                                    "progress": False, "tensorboard": False})
        resume = same and (run_dir / "checkpoint.pt").is_file()
        train_retrieval(RetrievalConfig(tc, RetrievalOptions.from_dict(want["retrieval"])), resume=resume,
                        quiet=True)
    return {"summary": json.loads(summary_path.read_text()), "history": read_metrics_csv(run_dir / "metrics.csv")}


def reading(diffs: Sequence[float]) -> str:
    """The word of paired differences claimed positive, by the one rule (:mod:`ropekit_studies.verdict`)
    for a family of one comparison; the study's table reads its :data:`CLAIMS` together
    (:func:`comparisons`)."""
    return judge_one([float(x) for x in diffs], 1).word


#: The comparisons the study claims, each positive (``a − b``): rotary RGB-D towers above the RGB ViT and depth
#: helping (STRING Table 2), declared before the runs; their p-values are Holm-corrected together.
#: ``(a, b, what)``; a pair whose arms were not run is left out.
CLAIMS: Tuple[Tuple[str, str, str], ...] = tuple(
    [(arm, BASELINE, f"{ARMS[arm][0]} − {ARMS[BASELINE][0]}") for arm in ARMS if arm != BASELINE]
    + [("rgbd-cayley", "rgb-cayley", "Cayley: RGB-D (depth as z) − RGB (2-D)"),
       ("rgbd-cayley", "rgbd-ape", "RGB-D: Cayley (depth as z) − APE (depth as channel)"),
       ("rgbd-cayley-both", "rgbd-ape", "RGB-D, depth as channel: Cayley (and depth as z) − APE"),
       ("rgbd-cayley-both", "rgbd-cayley", "Cayley RGB-D: depth as channel and z − depth as z only"),
       ("rgbd-cayley", "rgbd-rope", "RGB-D, depth as z: Cayley-STRING − RoPE (axial)")])


def comparisons(rows: Sequence[Dict[str, Any]], arms: Sequence[str]) -> List[Dict[str, Any]]:
    """The paired differences of mean recall for every claim in :data:`CLAIMS` whose arms are among ``arms``,
    each with its verdict (the claims read as one Holm family). ``rows``: the study's rows (``arm``, ``seed``,
    ``mean_recall``; strings as a CSV gives them are accepted)."""
    def per_seed(arm: str) -> Dict[int, float]:
        return {int(row["seed"]): float(row["mean_recall"]) for row in rows if row["arm"] == arm}

    out = []
    for a, b, what in CLAIMS:
        if a not in arms or b not in arms:
            continue
        va, vb = per_seed(a), per_seed(b)
        d = [va[k] - vb[k] for k in sorted(set(va) & set(vb))]
        if d:
            out.append({"a": a, "b": b, "what": what, "diffs": d, **mean_std(d),
                        "seeds_positive": sum(x > 0 for x in d)})
    verdicts = judge({c["what"]: c["diffs"] for c in out}, {c["what"]: 1 for c in out})
    for c in out:
        v = verdicts[c["what"]]
        c.update({"reading": v.word, "label": v.label, "low95": v.low95, "high95": v.high95, "p_holm": v.p_holm,
                  "mde": v.mde})
    return out


#: The pair a user choosing between STRING and RoPE for an RGB-D tower decides on: RGB-D Cayley-STRING − RGB-D axial
#: RoPE, both with depth as the third coordinate (a declared claim of :data:`CLAIMS`).
DECISION_PAIR: Tuple[str, str] = ("rgbd-cayley", "rgbd-rope")


def decision_power(comps: Sequence[Dict[str, Any]], target: float = 0.01) -> Optional[Dict[str, Any]]:
    """The power of :data:`DECISION_PAIR` among ``comps`` (:func:`comparisons`): its paired mean, sd, 95 %
    interval and MDE at these seeds, and the seeds that detect ``target`` (mean recall as a fraction; 0.01 is one
    point) at 80 % power with this paired spread (:func:`~ropekit_studies.verdict.seeds_needed`, one comparison
    at α = 0.05). ``None`` when the pair was not run or has fewer than two seeds."""
    from .verdict import seeds_needed

    c = next((c for c in comps if (c["a"], c["b"]) == DECISION_PAIR), None)
    if c is None or c["n"] < 2:
        return None
    return {**{k: c[k] for k in ("what", "n", "mean", "std", "low95", "high95", "mde", "label")},
            "target": target, "seeds_for_target": seeds_needed(c["std"], target)}


def power_sentence(p: Dict[str, Any]) -> str:
    """One sentence of :func:`decision_power` (points of mean recall)."""
    return (f"**Power of the STRING-against-RoPE pair** ({p['what']}): {100 * p['mean']:+.2f} ± "
            f"{100 * p['std']:.2f} points over {p['n']} seeds, 95 % [{100 * p['low95']:+.1f}, "
            f"{100 * p['high95']:+.1f}], {p['label']}; these seeds detect {100 * p['mde']:.1f} points at 80 % "
            f"power (MDE), and {100 * p['target']:g} point{'' if p['target'] == 0.01 else 's'} of mean recall needs "
            f"about {p['seeds_for_target']} seeds at this paired spread (one comparison at α = 0.05, "
            f"`ropekit_studies.verdict.seeds_needed`; a spread from {p['n']} seeds is itself uncertain).")


def comparison_table(comps: Sequence[Dict[str, Any]]) -> str:
    """The markdown of :func:`comparisons` (differences in points), with the power of :data:`DECISION_PAIR`."""
    def iv(c: Dict[str, Any]) -> str:
        return "–" if c["n"] < 2 else f"[{100 * c['low95']:+.1f}, {100 * c['high95']:+.1f}]"

    power = decision_power(comps)
    rows = [[c["what"], f"{100 * c['mean']:+.2f} ± {100 * (c['std'] if c['n'] > 1 else 0):.2f}", iv(c),
             f"{c['seeds_positive']} of {c['n']}", ", ".join(f"{100 * x:+.1f}" for x in c["diffs"]),
             f"**{c.get('label', c['reading'])}**"
             + (f" (MDE {100 * c['mde']:.1f})" if c["reading"] == "null" else "")]
            for c in comps]
    return ("Paired by seed (the same initialisation seed and data order for every arm): differences of mean "
            f"recall in points, mean ± sd and the 95 % t interval over seeds; the {len(comps)} comparisons are "
            f"the study's declared claims. Verdicts: {RULE}.\n\n"
            + markdown_table(["comparison", "Δ mean recall (points)", "95 % interval", "seeds > 0", "per seed",
                              "verdict"], rows, align="lrrrrl").rstrip("\n")
            + ("" if power is None else "\n\n" + power_sentence(power)))


#: The study's claims on the depth hard negatives, declared before the runs: arm -> (what, expected word). Each is
#: read as ``accuracy − 0.5`` per seed with the claimed sign ``+1``; the RGB-only towers are the control that must
#: read ``null`` (at chance), the RGB-D RoPE and Cayley towers are claimed to read ``holds`` (above chance). The
#: claims whose arms were run are one Holm family; the other arms are reported with their interval only.
HARD_NEGATIVE_CLAIMS: Dict[str, Tuple[str, str]] = {
    "rgb-ape": ("control: RGB cannot see depth, at chance", "null"),
    "rgb-cayley": ("control: RGB cannot see depth, at chance", "null"),
    "rgbd-rope": ("above chance", "holds"),
    "rgbd-cayley": ("above chance", "holds"),
}


#: Fewer pairs than this, over all seeds, cannot exclude chance even when every one is right (two-sided
#: binomial p = 2 · 0.5^N ≥ 0.05 for N ≤ 5): such an arm is "not assessable".
MIN_HARD_NEGATIVE_PAIRS = 6


def _outcomes(acc: float, pairs: int, ties: int) -> List[float]:
    """The per-caption outcomes (1 right, 0.5 tie, 0 wrong) of one run from its accuracy, pairs and ties."""
    ones = int(round(acc * pairs - 0.5 * ties))
    return [1.0] * ones + [0.5] * ties + [0.0] * (pairs - ones - ties)


def hard_negatives(rows: Sequence[Dict[str, Any]], arms: Sequence[str], *, resamples: int = 10000
                   ) -> List[Dict[str, Any]]:
    """Per arm of ``arms``: the depth hard-negative accuracy per seed (``depth_hn_acc``, ``depth_hn_pairs``,
    ``depth_hn_ties`` of the rows; seeds without it -- runs from before it was measured, or without a depth
    caption -- are left out), its mean over seeds and the 95 % interval of a two-level bootstrap (seeds, then
    captions inside each seed: :func:`~ropekit_studies.verdict.bootstrap_interval`), so that the few pairs of a
    small test set widen it. For the arms of :data:`HARD_NEGATIVE_CLAIMS`: the verdict of ``accuracy − 0.5`` by
    the one rule with those intervals and bootstrap p-values (the claims one Holm family), the expected word and
    whether the verdict is it; an arm with fewer than :data:`MIN_HARD_NEGATIVE_PAIRS` pairs in all is "not
    assessable". ``rows``: the study's rows (strings as a CSV gives them are accepted)."""
    def num(row: Dict[str, Any], key: str) -> Optional[float]:
        v = row.get(key)
        if v is None or v == "":
            return None
        v = float(v)
        return None if math.isnan(v) else v

    out = []
    for arm in arms:
        runs = {}
        for row in rows:
            acc, pairs = num(row, "depth_hn_acc"), num(row, "depth_hn_pairs")
            if row["arm"] == arm and acc is not None and pairs:
                runs[int(row["seed"])] = (acc, int(pairs), int(num(row, "depth_hn_ties") or 0))
        if not runs:
            continue
        seeds = sorted(runs)
        acc = [runs[k][0] for k in seeds]
        pairs = [runs[k][1] for k in seeds]
        boot = bootstrap_interval([[x - 0.5 for x in _outcomes(*runs[k])] for k in seeds], (0.95, 0.8),
                                  resamples=resamples, seed=0)
        out.append({"arm": arm, "seeds": seeds, "acc": acc, **mean_std(acc), "pairs": pairs,
                    "low95": 0.5 + boot["intervals"][0.95][0], "high95": 0.5 + boot["intervals"][0.95][1],
                    "boot": boot, "claim": HARD_NEGATIVE_CLAIMS.get(arm)})
    few = {h["arm"] for h in out if sum(h["pairs"]) < MIN_HARD_NEGATIVE_PAIRS}
    claimed = [h for h in out if h["claim"] is not None and h["arm"] not in few]
    verdicts = judge({h["arm"]: [a - 0.5 for a in h["acc"]] for h in claimed}, {h["arm"]: 1 for h in claimed},
                     p_values={h["arm"]: h["boot"]["p"] for h in claimed},
                     intervals={h["arm"]: h["boot"]["intervals"] for h in claimed})
    for h in out:
        boot = h.pop("boot")
        v = verdicts.get(h["arm"])
        word = v.word if v is not None else ("not assessable" if h["claim"] else None)
        h.update({"reading": word, "label": v.label if v is not None else word,
                  "mde": v.mde if v is not None else float("nan"), "p": boot["p"],
                  "p_holm": v.p_holm if v is not None else float("nan"),
                  "expected": h["claim"][1] if h["claim"] else None,
                  "as_expected": (word == h["claim"][1]) if h["claim"] else None})
    return out


def hard_negative_table(hn: Sequence[Dict[str, Any]]) -> str:
    """The markdown of :func:`hard_negatives` (accuracies in percent)."""
    def iv(h: Dict[str, Any]) -> str:
        return f"[{100 * h['low95']:.1f}, {100 * h['high95']:.1f}]"

    rows = []
    for h in hn:
        word = "–"
        if h["claim"]:
            word = (f"**{h['label']}**" + (f" (MDE {100 * h['mde']:.1f})" if h["reading"] == "null" else "")
                    + (f" ({sum(h['pairs'])} pairs)" if h["reading"] == "not assessable" else "")
                    + f"; expected {h['expected']}" + ("" if h["as_expected"] else " — **not as expected**"))
        rows.append([ARMS[h["arm"]][0], f"{100 * h['mean']:.1f}" + (f" ± {100 * h['std']:.1f}" if h["n"] > 1 else ""),
                     iv(h), ", ".join(f"{100 * a:.1f}" for a in h["acc"]),
                     ", ".join(str(p) for p in h["pairs"]), h["claim"][0] if h["claim"] else "not a claim", word])
    return ("**Depth hard negatives**: each test caption that states a depth relation against the same caption "
            "with the relation flipped (`in front of` ↔ `behind`); the share of pairs where the image scores the "
            "true caption higher, in percent (chance 50), mean ± sd over seeds and the 95 % interval of a bootstrap "
            "over seeds and captions (so that few pairs widen it). The claims (accuracy − 50, read as one Holm "
            "family with the bootstrap's p-values) were declared before the runs: the RGB-only towers are the "
            f"control that must sit at chance; fewer than {MIN_HARD_NEGATIVE_PAIRS} pairs in all cannot exclude "
            f"chance and are not assessable. Verdicts: {RULE}.\n\n"
            + markdown_table(["vision tower", "accuracy (%)", "95 % interval", "per seed", "pairs per seed",
                              "claim", "verdict"], rows, align="lrrrrll"))


def caption_depth_counts(preset: str = "default", study: str = "retrieval") -> Dict[str, int]:
    """How many captions of the test split of ``study``'s ``preset`` recipe state a depth relation
    (:func:`~ropekit.multimodal.hard_negatives.depth_relation_counts` over every caption of every test scene, the
    captions the depth hard negatives score). The test scenes do not depend on the number of training scenes
    (their own generator seed), so one training scene is generated, not the recipe's thousands."""
    from ropekit.data import load_dataset
    from ropekit.multimodal.hard_negatives import depth_relation_counts

    t = recipe(preset, study)["train"]
    opts = {**t["data_options"], "num_train": 1}
    _, test, _ = load_dataset(t["data"], image_size=t["image_size"], split_seed=t["split_seed"], **opts)
    s = test.scenes
    return depth_relation_counts(s.captions, s.valid.sum(1).tolist())


def depth_share_phrases(counts: Dict[str, int]) -> Tuple[str, str]:
    """The two phrases in which the docs state :func:`caption_depth_counts`: ``"28 % of the test captions (552 of
    2,000)"`` and ``"41 % of those of multi-object scenes (552 of 1,356"`` (percentages rounded to integers; the
    second phrase's parenthesis is left open for what the page adds)."""
    def pct(a: int, b: int) -> str:
        return f"{100 * a / b:.0f}" if b else "0"

    return (f"{pct(counts['depth'], counts['captions'])} % of the test captions ({counts['depth']:,} of "
            f"{counts['captions']:,})",
            f"{pct(counts['multi_object_depth'], counts['multi_object'])} % of those of multi-object scenes "
            f"({counts['multi_object_depth']:,} of {counts['multi_object']:,}")


def _pm(st: Dict[str, float], scale: float = 100.0, digits: int = 1) -> str:
    if st["n"] == 0:
        return "–"
    if st["n"] < 2 or math.isnan(st["std"]):
        return f"{st['mean'] * scale:.{digits}f}"
    return f"{st['mean'] * scale:.{digits}f} ± {st['std'] * scale:.{digits}f}"


METRICS = ("mean_recall", "i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10")
HN_METRICS = ("depth_hn_acc", "depth_hn_pairs", "depth_hn_ties")


def run_retrieval_study(preset: str, out: Path, *, seeds: Optional[Sequence[int]] = None,
                        arms: Optional[Sequence[str]] = None, threads: Optional[int] = 1, device: str = "auto",
                        progress: bool = True, command: Optional[str] = None,
                        study: str = "retrieval") -> StudyResult:
    """Train every arm over the seeds of the ``preset`` recipe of ``study`` (``retrieval`` or
    ``retrieval-depth``: :data:`VARIANTS`; or the seeds given) and write the report into ``out`` (see the module
    docstring)."""
    r = recipe(preset, study)
    if seeds:
        r["seeds"] = [int(s) for s in seeds]
    if arms:
        bad = [a for a in arms if a not in ARMS]
        if bad:
            raise ValueError(f"unknown arm(s) {', '.join(bad)}; arms: {', '.join(ARMS)}")
        r["arms"] = list(arms)
    out = Path(out)
    writer = StudyWriter(out, study)
    bar = Progress(len(r["arms"]) * len(r["seeds"]), f"experiment {study}", enabled=progress)
    rows: List[Dict[str, Any]] = []
    curves: List[Dict[str, Any]] = []
    for seed in r["seeds"]:  # seed-major: a partial study already pairs every arm of its first seeds
        for arm in r["arms"]:
            res = _train_run(r, arm, seed, out / "runs" / f"{arm}-s{seed}", threads, device)
            s = res["summary"]
            rows.append({"arm": arm, "seed": seed, **{k: s.get(k) for k in METRICS + HN_METRICS},
                         "train_loss": s.get("train_loss"), "logit_scale": s.get("logit_scale"),
                         "logit_bias": s.get("logit_bias"), "num_params": s.get("num_params"),
                         "wall_time": s.get("wall_time"), "device": s.get("device"), "run": f"{arm}-s{seed}"})
            curves += [{"arm": arm, "seed": seed, "epoch": int(h["epoch"]), "train_loss": h["train_loss"],
                        "mean_recall": h["mean_recall"]} for h in res["history"]]
            bar.advance(1, f"{arm} s{seed}")
    bar.close()

    def per_seed(arm: str, key: str = "mean_recall") -> Dict[int, float]:
        return {row["seed"]: row[key] for row in rows if row["arm"] == arm}

    stats = {arm: {k: mean_std(v for v in per_seed(arm, k).values()) for k in METRICS} for arm in r["arms"]}
    comps = comparisons(rows, r["arms"])
    hn = hard_negatives(rows, r["arms"])

    n_test = rows[0] and r["train"]["data_options"]["num_test"]
    tcfg, mo = r["train"], r["train"]["model_options"]
    cues = tcfg["data_options"].get("cues", "natural")
    head = (f"captioned-scenes{'' if cues == 'natural' else f' ({cues})'} {tcfg['image_size']}×{tcfg['image_size']}, "
            f"{tcfg['data_options']['num_train']} train "
            f"scenes × {tcfg['data_options']['captions_per_scene']} captions, {n_test} test pairs; ViT width "
            f"{mo['embed_dim']}, depth {mo['depth']}, patch {tcfg['patch_size']}; text tower "
            f"{r['retrieval']['text_depth']}×{r['retrieval']['text_width']} (RoPE); SigLIP; {tcfg['epochs']} epochs, "
            f"batch {tcfg['batch_size']}; {len(r['seeds'])} seed{'s' if len(r['seeds']) != 1 else ''} ({preset} "
            f"preset)")
    table_rows = []
    for arm in r["arms"]:
        st = stats[arm]
        paper = PAPER_TABLE2.get(arm)
        wall = mean_std(row["wall_time"] for row in rows if row["arm"] == arm)
        table_rows.append([ARMS[arm][0], _pm(st["mean_recall"]), _pm(st["i2t_r1"]), _pm(st["i2t_r5"]),
                           _pm(st["i2t_r10"]), _pm(st["t2i_r1"]), _pm(st["t2i_r5"]), _pm(st["t2i_r10"]),
                           f"{paper[1]:.2f} ({paper[0]})" if paper else "–", f"{wall['mean']:.0f}"])
    devices = sorted({str(row.get("device")) for row in rows if row.get("device")})
    table = (f"**Image–text retrieval** — {head}. Recall in percent on the held-out pairs after the last epoch, "
             f"mean ± std across seeds; chance R@1 is {100 / max(n_test, 1):.1f} %.\n\n"
             + markdown_table(["vision tower", "mean recall", "i→t R@1", "i→t R@5", "i→t R@10", "t→i R@1",
                               "t→i R@5", "t→i R@10", "STRING Table 2 (WebLI-3D)",
                               f"train s / run ({', '.join(devices) or 'cpu'})"], table_rows))
    table += "\n\n" + comparison_table(comps)
    if hn:
        table += "\n\n" + hard_negative_table(hn)

    fig = _figure(r, rows, curves, stats, head)
    summary = {"stats": stats, "comparisons": comps, "hard_negatives": hn, "paper_table2": PAPER_TABLE2}
    writer.csv(rows)
    writer.csv(curves, "curves.csv")
    writer.json({"study": study, "rows": rows, "summary": summary, "recipe": r})
    writer.table(table)
    writer.figure(fig)
    queries = out / "runs" / f"rgbd-cayley-s{r['seeds'][0]}" / "queries.png"
    if queries.is_file():
        shutil.copyfile(queries, out / "queries.png")
        writer.files.append(out / "queries.png")
    writer.config({"study": study, "preset": preset, "recipe": r, "command": command,
                   "runs": [{"name": row["run"], "arm": row["arm"], "seed": row["seed"],
                             "settings": run_settings(r, row["arm"], row["seed"])} for row in rows]})
    return StudyResult(study, out, list(writer.files), table, summary)


def _figure(r: Dict[str, Any], rows: List[Dict[str, Any]], curves: List[Dict[str, Any]],
            stats: Dict[str, Any], head: str) -> Any:
    plt = setup_matplotlib()
    arms = r["arms"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 0.45 * len(arms) + 2.4), gridspec_kw={"width_ratios": [1.1, 1]})
    ys = list(range(len(arms)))[::-1]
    means = [100 * stats[a]["mean_recall"]["mean"] for a in arms]
    errs = [0 if stats[a]["mean_recall"]["n"] < 2 else 100 * stats[a]["mean_recall"]["std"] for a in arms]
    colours = ["tab:gray" if a.startswith("rgb-") else "tab:blue" for a in arms]
    ax1.barh(ys, means, xerr=errs, color=colours, alpha=0.6, capsize=3)
    for y, a in zip(ys, arms):
        vals = [100 * row["mean_recall"] for row in rows if row["arm"] == a]
        ax1.plot(vals, [y] * len(vals), "k.", ms=4)
    ax1.set_yticks(ys, [ARMS[a][0] for a in arms], fontsize=8)
    ax1.set_xlabel("mean recall (%, i→t and t→i R@1/5/10)")
    ax1.set_title("final mean recall (grey: RGB, blue: RGB-D; dots: seeds)", fontsize=9)
    for a in arms:
        epochs = sorted({c["epoch"] for c in curves if c["arm"] == a})
        m = [100 * mean_std(c["mean_recall"] for c in curves if c["arm"] == a and c["epoch"] == e)["mean"]
             for e in epochs]
        ax2.plot(epochs, m, marker="o", ms=3, label=ARMS[a][0], ls="--" if a.startswith("rgb-") else "-")
    ax2.set_xlabel("epoch")
    ax2.set_ylabel("test mean recall (%)")
    ax2.set_title("learning curves (mean over seeds)", fontsize=9)
    ax2.legend(fontsize=6)
    ax2.grid(alpha=0.3)
    fig.suptitle(f"Retrieval: {head}", fontsize=8)
    fig.tight_layout()
    return fig


def compare_retrieval(doc: Dict[str, Any]) -> List[str]:
    """Differences between a committed study's ``config.json`` (``doc``) and what its preset's recipe trains now
    (arms the command narrowed are allowed when they are among the recipe's; seeds the command chose are allowed,
    every run's settings being compared with the recipe's)."""
    preset, study = doc.get("preset"), doc.get("study", "retrieval")
    if preset not in RECIPES or study not in VARIANTS:
        return [f"retrieval: unknown preset {preset!r} or study {study!r}"]
    now, got = recipe(preset, study), doc.get("recipe", {})
    diffs = []
    for key in ("train", "retrieval"):
        if json.loads(json.dumps(now[key])) != got.get(key):
            diffs.append(f"retrieval: the {key} recipe differs: committed {got.get(key)}, now {now[key]}")
    outside = [v for v in got.get("arms", []) if v not in now["arms"]]
    if outside:
        diffs.append(f"retrieval: committed arms {outside} are not in the recipe's {now['arms']}")
    # seeds beyond the recipe's are more runs of the same settings (each run's settings are compared below)
    for run in doc.get("runs", []):
        want = json.loads(json.dumps(run_settings(now, run["arm"], run["seed"])))
        if run.get("settings") != want:
            diffs.append(f"retrieval: run {run.get('name')} trained other settings than the recipe's")
    return diffs


def _run(study: str, cfg: Any, out: Any, arms: Optional[Sequence[str]]) -> StudyResult:
    """The entry of ``ropekit experiment <study>`` (see :func:`run_retrieval`)."""
    from .settings import ExperimentConfig, quick_config

    if cfg.pes:
        raise ValueError(f"experiment {study} chooses vision towers with --arms ({', '.join(ARMS)}), not --pe")
    preset = cfg.preset if cfg.preset in RECIPES else ("quick" if cfg.quick else "default")
    base = quick_config() if preset == "quick" else ExperimentConfig()
    seeds = cfg.seeds if cfg.seeds and list(cfg.seeds) != list(base.seeds) else None
    if isinstance(arms, str):
        arms = [a.strip() for a in arms.split(",") if a.strip()]
    command = " ".join(["ropekit", "experiment", study] + ([] if preset == "default" else ["--preset", preset])
                       + (["--seeds", ",".join(map(str, seeds))] if seeds else [])
                       + (["--arms", ",".join(arms)] if arms else []) + ["--out", str(out)])
    return run_retrieval_study(preset, Path(out), seeds=seeds, arms=arms, threads=cfg.threads,
                               device="auto", progress=bool(cfg.progress), command=command, study=study)


@register_study("retrieval", "image-text retrieval (SigLIP) on captioned RGB-D scenes: RGB vs RGB-D vision towers "
                             "with APE, RoPE, RoPE-Mixed, Circulant and Cayley", options=("arms",),
                compare=compare_retrieval)
def run_retrieval(cfg: Any, out: Any, arms: Optional[Sequence[str]] = None) -> StudyResult:
    """The ``retrieval`` entry of ``ropekit experiment``: the preset's pinned recipe (:data:`RECIPES`), with these
    settings of the shared :class:`~ropekit_studies.settings.ExperimentConfig`: ``seeds`` (when other than the
    preset's), ``threads``, ``progress``; ``--arms`` a subset of :data:`ARMS`. The classification backbone, data and
    schedule settings do not apply."""
    return _run("retrieval", cfg, out, arms)


@register_study("retrieval-depth", "the retrieval study on depth-only captioned scenes (apparent size, image height "
                                   "and occlusion say nothing of depth order): depth hard negatives per tower",
                options=("arms",), compare=compare_retrieval)
def run_retrieval_depth(cfg: Any, out: Any, arms: Optional[Sequence[str]] = None) -> StudyResult:
    """The ``retrieval-depth`` entry of ``ropekit experiment``: as ``retrieval`` (:func:`run_retrieval`), on the
    scenes of ``cues="depth-only"`` (:data:`VARIANTS`)."""
    return _run("retrieval-depth", cfg, out, arms)
