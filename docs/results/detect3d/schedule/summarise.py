"""Summarise the detect3d schedule pilots (``commands.sh``): ``table.md`` and ``schedule.png``.

Reads every ``<pilot>/runs/<run>/metrics.json`` (test metrics, settings, learning curve) beside this file and
writes one table row per pilot, a comparison of the encodings over seeds at every schedule that was run on
several seeds, and one plot of the held-out IoU against the number of training images seen.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
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
    return "\n".join(lines) + "\n"


def _model(r) -> str:
    return f"{r['encoding']} {'ViTD' if r['input'] == 'rgbd' else 'ViT (RGB)'}"


def _over_seeds(rows) -> list:
    """Mean ± sample standard deviation over seeds of every model and schedule run on two seeds or more, and the
    differences to the APE ViTD of the same schedule, paired by seed."""
    groups = {}
    for r in rows:
        groups.setdefault((r["steps"], r["batch"], r["lr"], r["encoding"], r["input"]), {})[r["seed"]] = r
    multi = {k: v for k, v in groups.items() if len(v) >= 2}
    if not multi:
        return []
    out = ["", "Over seeds (mean ± sample standard deviation; the difference to the APE ViTD of the same schedule is "
           "paired by seed):", "",
           "| model | steps × batch | seeds | mean 3-D IoU | mAP@0.25 | − APE ViTD (mean 3-D IoU) |",
           "|---|---|---|---:|---:|---:|"]

    def ms(values) -> str:
        return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"

    for (steps, batch, lr, enc, inp), runs in sorted(multi.items()):
        seeds = sorted(runs)
        ape = groups.get((steps, batch, lr, "absolute", "rgbd"), {})
        paired = [runs[s]["iou"] - ape[s]["iou"] for s in seeds if s in ape]
        diff = ms(paired) if enc != "absolute" and len(paired) >= 2 else "–"
        out.append(f"| {_model(runs[seeds[0]])} | {steps} × {batch} | {', '.join(map(str, seeds))} | "
                   f"{ms([runs[s]['iou'] for s in seeds])} | {ms([runs[s]['map25'] for s in seeds])} | {diff} |")
    return out


def plot(rows) -> None:
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
    plot(rows)
    print((HERE / "table.md").read_text())
