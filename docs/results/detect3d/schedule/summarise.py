"""Summarise the detect3d schedule pilots (``commands.sh``): ``table.md``, ``schedule.png``, ``plateau.png`` and the
grid and questions block of the study's ``README.md``.

Reads every ``<pilot>/runs/<run>/metrics.json`` (test metrics, settings, learning curve) beside this file and
writes one table row per pilot, a comparison of the models over seeds at every schedule that was run on several
seeds, the study's questions answered at the longest schedule (differences paired by seed), a plot of the
held-out IoU against the number of training images seen (the ViTD schedule pilots) and one of every model at the
longest schedule (mean over seeds, the seeds' range shaded). The README's copy of the grid and the questions lies
between two marker lines (:data:`BEGIN`, :data:`END`) and is rewritten on every run, so it cannot drift from
``table.md``.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ropekit_studies.report import replace_marked_lines  # noqa: E402

HERE = Path(__file__).resolve().parent
README = HERE.parent / "README.md"
#: The marker lines around the block of the study's README that this script writes.
BEGIN = "<!-- begin: written by schedule/summarise.py from the run files; edits here are overwritten -->"
END = "<!-- end: written by schedule/summarise.py -->"
N_TRAIN = 8000  # training scenes of the default recipe (each pilot's settings are checked against it below)


def load():
    rows = []
    for path in sorted(HERE.glob("*/runs/*/metrics.json")):
        doc = json.loads(path.read_text())
        t, row = doc["settings"]["train"], doc["row"]
        if doc["settings"]["data"]["n_train"] != N_TRAIN:
            raise SystemExit(f"{path}: n_train {doc['settings']['data']['n_train']}, expected {N_TRAIN}")
        curve = [(c["step"] * t["batch_size"], c["val_mean_iou"]) for c in doc["curve"] if "val_mean_iou" in c]
        rows.append(dict(pilot=path.parents[2].name, encoding=row["encoding"], input=row["input"], seed=row["seed"],
                         steps=t["steps"], batch=t["batch_size"], lr=t["lr"], warmup=t["warmup_steps"],
                         images=t["steps"] * t["batch_size"], iou=row["mean_iou"], map25=row["mAP@0.25"],
                         map50=row["mAP@0.5"], val_final=row["val_iou_final"],
                         val_last_quarter=row["val_iou_last_quarter"], seconds=row["train_seconds"], curve=curve))
    if not rows:
        raise SystemExit(f"no pilot runs under {HERE}: run commands.sh")
    return sorted(rows, key=lambda r: (r["input"], r["encoding"], r["images"], r["batch"], r["lr"], r["seed"]))


def render_table(rows) -> str:
    """``table.md``'s text: one row per pilot."""
    lines = ["# detect3d: held-out IoU against the training schedule", "",
             "Test metrics on the study's 500 test scenes; the held-out curve is on the first 100 of them. "
             "Epochs of the 8000 training scenes. Training seconds are process CPU on one thread of the shared "
             "2-core machine, with another run on the second core.", "",
             "| pilot | model | seed | steps × batch | lr | epochs | mean 3-D IoU | mAP@0.25 | mAP@0.5 | held-out IoU at "
             "the end (change over the last quarter) | train s |",
             "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['pilot']} | {_model(r)} | {r['seed']} | {r['steps']} × {r['batch']} | {r['lr']:g} | "
                     f"{r['images'] / N_TRAIN:.1f} | {r['iou']:.3f} | {r['map25']:.3f} | {r['map50']:.3f} | "
                     f"{r['val_final']:.3f} ({r['val_last_quarter']:+.3f}) | {r['seconds']:.0f} |")
    lines += _over_seeds(rows)
    lines += _grid(rows)
    lines += _questions(rows)
    return "\n".join(lines) + "\n"


#: The inputs in the order of the grid's columns and plateau.png's panels.
INPUTS = {"rgb": "ViT (RGB)", "rgbd": "ViTD", "rgbd-channel": "ViTD (depth input only)"}

#: The encodings' names in the questions; every rotary one also runs with depth as an input channel only.
NAMES = {"absolute": "APE", "none": "NoPE", "axial": "RoPE (axial)", "mixed": "RoPE-Mixed", "cayley": "Cayley",
         "circulant": "Circulant"}
ROTARY = ("axial", "mixed", "cayley", "circulant")

#: The study's questions as differences of two models (encoding, input) trained on the same schedule and seeds;
#: a question appears in the table once both of its models have run on two seeds or more.
QUESTIONS = (
    tuple((f"depth in the network: {name} ViTD − {name} ViT (RGB)", (enc, "rgbd"), (enc, "rgb"))
          for enc, name in NAMES.items())
    + tuple((f"depth also as the rotary coordinate: {NAMES[enc]} ViTD − {NAMES[enc]} depth input only",
             (enc, "rgbd"), (enc, "rgbd-channel")) for enc in ROTARY)
    + tuple((f"the encodings on RGB (ViT): {name} − APE", (enc, "rgb"), ("absolute", "rgb"))
            for enc, name in NAMES.items() if enc != "absolute")
    + tuple((f"the encodings with depth (ViTD): {name} − APE", (enc, "rgbd"), ("absolute", "rgbd"))
            for enc, name in NAMES.items() if enc != "absolute")
    + tuple((f"STRING against RoPE, {label}: {NAMES[enc]} − RoPE (axial)", (enc, inp), ("axial", inp))
            for inp, label in (("rgb", "ViT (RGB)"), ("rgbd", "ViTD")) for enc in ("cayley", "circulant"))
)


def _model(r) -> str:
    return f"{r['encoding']} {INPUTS[r['input']]}"


def _mean_sd(values, signed: bool = False) -> str:
    """``"mean ± sd"`` (sample standard deviation) of ``values``; ``signed`` writes the mean's sign (a difference)."""
    return f"{statistics.mean(values):{'+' if signed else ''}.3f} ± {statistics.stdev(values):.3f}"


def _by_model(rows) -> dict:
    """``{(steps, batch, lr, encoding, input): {seed: row}}``: the runs of each model and schedule."""
    groups = {}
    for r in rows:
        groups.setdefault((r["steps"], r["batch"], r["lr"], r["encoding"], r["input"]), {})[r["seed"]] = r
    return groups


def _over_seeds(rows) -> list:
    """Mean ± sample standard deviation over seeds of every model and schedule run on two seeds or more, and the
    differences to the APE model with the same image input (RGB, or RGB + depth channel) and schedule, paired by
    seed."""
    groups = _by_model(rows)
    multi = {k: v for k, v in groups.items() if len(v) >= 2}
    if not multi:
        return []
    out = ["", "Over seeds (mean ± sample standard deviation; the difference to the APE model with the same image "
           "input and schedule -- the APE ViT for RGB, the APE ViTD for depth as a channel -- is paired by seed):", "",
           "| model | steps × batch | seeds | mean 3-D IoU | best seed | mAP@0.25 | best seed "
           "| − APE, same input (mean 3-D IoU) |",
           "|---|---|---|---:|---:|---:|---:|---:|"]

    for (steps, batch, lr, enc, inp), runs in sorted(multi.items()):
        seeds = sorted(runs)
        ape = groups.get((steps, batch, lr, "absolute", "rgb" if inp == "rgb" else "rgbd"), {})
        paired = [runs[s]["iou"] - ape[s]["iou"] for s in seeds if s in ape]
        diff = _mean_sd(paired, signed=True) if enc != "absolute" and len(paired) >= 2 else "–"
        out.append(f"| {_model(runs[seeds[0]])} | {steps} × {batch} | {', '.join(map(str, seeds))} | "
                   f"{_mean_sd([runs[s]['iou'] for s in seeds])} | {max(runs[s]['iou'] for s in seeds):.3f} | "
                   f"{_mean_sd([runs[s]['map25'] for s in seeds])} | {max(runs[s]['map25'] for s in seeds):.3f} | "
                   f"{diff} |")
    return out


def _at_longest(rows):
    """``(steps, {(encoding, input): {seed: row}})``: the runs of the longest schedule at batch 32, lr 1e-3."""
    steps = max(r["steps"] for r in rows if r["batch"] == 32)
    return steps, {(enc, inp): runs for (s, batch, lr, enc, inp), runs in _by_model(rows).items()
                   if (s, batch, lr) == (steps, 32, 1e-3)}


def _grid(rows) -> list:
    """The study's grid at the longest schedule: per encoding and input, the mean 3-D IoU over seeds (mean ± sample
    standard deviation, and how many seeds), where a model ran on two seeds or more."""
    steps, runs = _at_longest(rows)
    runs = {k: v for k, v in runs.items() if len(v) >= 2}
    if not runs:
        return []
    out = ["", f"The grid at {steps} × 32: mean 3-D IoU, mean ± sample standard deviation over seeds (number of "
           "seeds; the best seed, the statistic STRING's Table 4 reports); APE and NoPE have no coordinate path, so "
           "depth as input only is their ViTD:", "",
           "| encoding | " + " | ".join(INPUTS.values()) + " |", "|---|---:|---:|---:|"]
    for enc, name in NAMES.items():
        cells = []
        for inp in INPUTS:
            got = runs.get((enc, inp), {})
            ious = [r["iou"] for r in got.values()]
            cells.append(f"{_mean_sd(ious)} ({len(got)}; best {max(ious):.3f})" if got else "–")
        if any(c != "–" for c in cells):
            out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out


def _questions(rows) -> list:
    """Each question of :data:`QUESTIONS` at the longest schedule: the difference of the two models' mean 3-D IoU
    paired by seed (mean ± sample standard deviation), where both ran on two seeds or more."""
    steps, runs = _at_longest(rows)
    out = []
    for text, a, b in QUESTIONS:
        seeds = sorted(set(runs.get(a, {})) & set(runs.get(b, {})))
        if len(seeds) < 2:
            continue
        d = [runs[a][s]["iou"] - runs[b][s]["iou"] for s in seeds]
        sd = statistics.stdev(d)
        ratio = abs(statistics.mean(d)) / sd if sd > 0 else float("inf")
        out.append(f"| {text} | {', '.join(map(str, seeds))} | {_mean_sd(d, signed=True)} | {ratio:.1f} |")
    if not out:
        return []
    return ["", f"The study's questions at {steps} × 32 (where the IoU has levelled off; each difference is paired "
            "by seed, mean ± sample standard deviation, and |mean| / sd says how far it stands above the seed "
            "spread):", "", "| question | seeds | difference in mean 3-D IoU | abs(mean) / sd |",
            "|---|---|---:|---:|"] + out


def readme_block(rows) -> list:
    """The README's lines between the markers: the grid and the questions as in ``table.md``, indented to sit
    inside the README's list item."""
    return [f"  {line}" if line else "" for line in (_grid(rows) + _questions(rows))[1:]]


def with_readme_block(text: str, block) -> str:
    """``text`` (the README) with the lines between its :data:`BEGIN` and :data:`END` markers replaced by
    ``block``.

    Raises:
        SystemExit: the README lacks either marker line, or has them in the wrong order.
    """
    try:
        return replace_marked_lines(text, BEGIN, END, ["", *block, ""])
    except ValueError as e:
        raise SystemExit(f"{README}: {e}") from None


#: The models whose schedule pilots schedule.png shows (plateau.png shows every model at the longest schedule).
SCHEDULE_MODELS = ("cayley", "absolute")


def plot_plateau(rows) -> None:
    """Every model trained at the longest schedule on two seeds or more: the held-out curve's mean over seeds and
    the seeds' range, one panel per input (RGB ViT, ViTD, depth as input only)."""
    steps, models = _at_longest(rows)
    models = {k: list(v.values()) for k, v in sorted(models.items(), key=lambda kv: list(NAMES).index(kv[0][0]))
              if len(v) >= 2}
    colours = {enc: plt.cm.tab10.colors[i] for i, enc in enumerate(NAMES)}
    titles = {"rgb": "ViT: RGB only",
              "rgbd": "ViTD: depth as input and, for rotary encodings, as the third coordinate",
              "rgbd-channel": "depth as input only (rotary over the 2-D grid)"}
    panels = [(inp, titles[inp]) for inp in INPUTS if any(i == inp for _, i in models)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.8), sharey=True, squeeze=False)
    for ax, (panel, title) in zip(axes[0], panels):
        for (enc, inp), runs in models.items():
            if inp != panel:
                continue
            xs = [x / N_TRAIN for x, _ in runs[0]["curve"]]
            ys = [[y for _, y in r["curve"]] for r in runs]
            ax.plot(xs, [statistics.mean(v) for v in zip(*ys)], color=colours[enc], lw=1.5,
                    label=f"{NAMES[enc]} ({len(runs)} seeds)")
            ax.fill_between(xs, [min(v) for v in zip(*ys)], [max(v) for v in zip(*ys)], color=colours[enc],
                            alpha=0.12)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("epochs of the 8000 training scenes")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("held-out mean 3-D IoU (100 test scenes)")
    fig.suptitle(f"detect3d at {steps} steps of 32: mean over seeds, range shaded")
    fig.tight_layout()
    fig.savefig(HERE / "plateau.png", dpi=110)
    plt.close(fig)


def plot(rows) -> None:
    """The schedule pilots: the Cayley and APE ViTDs, and the RGB ViT below the longest schedule (plateau.png
    shows every model at the longest)."""
    steps, _ = _at_longest(rows)
    rows = [r for r in rows if r["steps"] < steps or (r["input"] == "rgbd" and r["encoding"] in SCHEDULE_MODELS)]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    colours = plt.cm.tab20.colors
    for i, r in enumerate(rows):
        xs, ys = zip(*r["curve"])
        style = "--" if r["input"] != "rgbd" else "-." if r["encoding"] == "absolute" else (
            "-" if r["lr"] == 1e-3 else ":")
        ax.plot([x / N_TRAIN for x in xs], ys, style, marker=".", ms=3, lw=1.2, color=colours[(2 * i) % 20 + (i >= 10)],
                label=f"{r['pilot']} ({r['encoding']} {r['input']}, seed {r['seed']})")
    ax.set_xlabel("epochs of the 8000 training scenes (training images seen / 8000)")
    ax.set_ylabel("held-out mean 3-D IoU (100 test scenes)")
    ax.set_title("detect3d: the IoU rises with the schedule and levels off after about 60 epochs")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(HERE / "schedule.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    rows = load()
    (HERE / "table.md").write_text(render_table(rows))
    README.write_text(with_readme_block(README.read_text(), readme_block(rows)))
    plot(rows)
    plot_plateau(rows)
    print((HERE / "table.md").read_text())
