"""``ropekit bench data``: the training input pipeline, ropekit's streams against torchvision's ``ImageFolder``.

What is measured, on generated JPEG folders (:func:`ropekit.data.write_fake_image_folder`, square images):

* **throughput** -- images per second through decode → RandomResizedCrop → flip → RandAugment → normalise
  (:func:`ropekit.data.build_train_transform`, the same transform object for every pipeline) and batching, one
  epoch at a time, for three pipelines with the same batch size and number of workers:
  ``torchvision`` (``torchvision.datasets.ImageFolder`` + ``DataLoader(shuffle=True)``), ``folder-stream``
  (:class:`ropekit.data.ImageFolderStream` + :func:`ropekit.data.make_loader`) and ``shards``
  (:class:`ropekit.data.ShardStream` over the same images converted by :func:`ropekit.data.write_shards`).
  The pipelines alternate within each round (the order rotates), and each round's ratio against
  torchvision is taken within the round, so drift of a shared machine hits both sides of a ratio alike. An
  epoch's time includes starting its workers (none of the pipelines keeps them between epochs).
* **memory** -- the peak, over an epoch, of the resident memory of the main process plus its workers: RSS summed
  (counts pages the workers share with the main process once per process) and PSS summed (shares them out),
  sampled every 0.1 s from ``/proc`` (or psutil), for every dataset size asked for (2,000 and 20,000 by default).

Records are dicts; :func:`format_data_report` renders them as markdown.
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

__all__ = ["DataBenchConfig", "run_data_bench", "format_data_report", "PIPELINES"]

PIPELINES = ("torchvision", "folder-stream", "shards")


@dataclass
class DataBenchConfig:
    """Options of ``ropekit bench data``.

    Attributes:
        images: dataset size of the throughput rounds; memory_sizes: dataset sizes of the memory runs.
        image_size: side of the generated JPEGs; crop: RandomResizedCrop output; classes: generated classes.
        batch_size, workers: of every pipeline's DataLoader.
        rounds: throughput epochs per pipeline; auto_augment: the policy (RandAugment by default).
        folder: reuse this generated folder for the throughput rounds instead of a temporary one.
        threads: torch threads of the main process (workers use one each, as DataLoader sets).
    """

    images: int = 2000
    memory_sizes: Tuple[int, ...] = (2000, 20000)
    image_size: int = 256
    crop: int = 224
    classes: int = 10
    batch_size: int = 64
    workers: int = 2
    rounds: int = 3
    auto_augment: Optional[str] = "randaugment"
    shard_size: int = 250
    folder: Optional[str] = None
    threads: int = 1
    pipelines: Tuple[str, ...] = field(default=PIPELINES)


# ----------------------------------------------------------------------------------------------------------
# memory of a process tree
# ----------------------------------------------------------------------------------------------------------


def _children(pid: int) -> List[int]:
    out: List[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        return out
    return out + [g for c in out for g in _children(c)]


def _rss_pss_proc(pid: int) -> Tuple[int, int]:
    rss = pss = 0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Rss:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("Pss:"):
                pss = int(line.split()[1]) * 1024
    return rss, pss


def tree_memory() -> Tuple[Optional[int], Optional[int]]:
    """(RSS, PSS) in bytes of this process and all its descendants, summed; ``None`` where unreadable."""
    me = os.getpid()
    if os.path.exists(f"/proc/{me}/smaps_rollup"):
        rss = pss = 0
        for pid in [me] + _children(me):
            try:
                r, p = _rss_pss_proc(pid)
            except OSError:  # a worker that just ended
                continue
            rss, pss = rss + r, pss + p
        return rss, pss
    try:
        import psutil
    except ImportError:
        return None, None
    proc = psutil.Process()
    procs = [proc] + proc.children(recursive=True)
    rss = sum(p.memory_info().rss for p in procs)
    try:
        pss = sum(p.memory_full_info().pss for p in procs)
    except (AttributeError, psutil.Error):
        pss = None
    return rss, pss


class _PeakMemory:
    """Samples :func:`tree_memory` in a thread; ``peak`` = (max RSS, max PSS) seen between start and stop."""

    def __init__(self, interval: float = 0.1) -> None:
        self.interval = interval
        self.peak: List[Optional[int]] = [None, None]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for i, v in enumerate(tree_memory()):
                if v is not None:
                    self.peak[i] = v if self.peak[i] is None else max(self.peak[i], v)
            self._stop.wait(self.interval)

    def __enter__(self) -> "_PeakMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


# ----------------------------------------------------------------------------------------------------------
# pipelines
# ----------------------------------------------------------------------------------------------------------


def _epoch_loader(name: str, folder: Path, shards: Path, transform: Callable, cfg: DataBenchConfig,
                  epoch: int) -> Iterable[Tuple[torch.Tensor, torch.Tensor]]:
    from ..data import ImageFolderStream, ShardStream, make_loader

    if name == "torchvision":
        from torch.utils.data import DataLoader
        from torchvision.datasets import ImageFolder

        gen = torch.Generator().manual_seed(epoch)
        return DataLoader(ImageFolder(str(folder), transform=transform), batch_size=cfg.batch_size, shuffle=True,
                          num_workers=cfg.workers, drop_last=True, generator=gen)
    ds = ImageFolderStream(folder, transform) if name == "folder-stream" else ShardStream(shards, transform)
    return make_loader(ds, batch_size=cfg.batch_size, seed=0, epoch=epoch, num_workers=cfg.workers)


def _cpu_seconds() -> float:
    """User + system CPU time of this process and of its ended (joined) children, in seconds."""
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _time_epoch(name: str, folder: Path, shards: Path, transform: Callable, cfg: DataBenchConfig, epoch: int,
                memory: bool = False) -> Dict[str, Any]:
    import gc

    gc.collect()  # the last epoch's workers are joined and counted before the clock starts
    c0 = _cpu_seconds()
    t0 = time.perf_counter()
    n = 0
    peak = _PeakMemory() if memory else None
    if peak is not None:
        peak.__enter__()
    try:
        for images, labels in _epoch_loader(name, folder, shards, transform, cfg, epoch):
            n += int(labels.shape[0])
    finally:
        if peak is not None:
            peak.__exit__(None, None, None)
    dt = time.perf_counter() - t0
    gc.collect()  # drop the loader: its workers end and are joined, so their CPU time is counted
    cpu = _cpu_seconds() - c0
    rec: Dict[str, Any] = {"pipeline": name, "images": n, "seconds": dt, "images_per_s": n / dt,
                           "cpu_ms_per_image": 1e3 * cpu / max(n, 1)}
    if peak is not None:
        rec["peak_rss_mb"] = None if peak.peak[0] is None else peak.peak[0] / 2 ** 20
        rec["peak_pss_mb"] = None if peak.peak[1] is None else peak.peak[1] / 2 ** 20
    return rec


def _prepare(root: Path, n: int, cfg: DataBenchConfig, log: Callable[[str], None]) -> Tuple[Path, Path]:
    """A generated folder of ``n`` images (about ``n / classes`` per class) and its shards, under ``root``."""
    from ..data import write_fake_image_folder, write_shards

    folder, shards = root / "folder", root / "shards"
    per_class = -(-n // cfg.classes)
    t0 = time.perf_counter()
    write_fake_image_folder(folder, classes=cfg.classes, per_class=per_class, size=cfg.image_size, seed=n)
    write_shards(folder, shards, shard_size=cfg.shard_size, val_fraction=0)
    log(f"generated {per_class * cfg.classes} JPEGs of {cfg.image_size}² and their shards in "
        f"{time.perf_counter() - t0:.0f} s")
    return folder, shards


def _environment(cfg: DataBenchConfig) -> Dict[str, Any]:
    import PIL
    import torchvision
    import webdataset

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"kind": "environment", "cpu": cpu, "cpu_count": os.cpu_count(),
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "python": platform.python_version(), "torch": torch.__version__, "torchvision": torchvision.__version__,
            "webdataset": getattr(webdataset, "__version__", "?"), "pillow": PIL.__version__,
            "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()}}


def run_data_bench(cfg: DataBenchConfig, log: Callable[[str], None] = print) -> List[Dict[str, Any]]:
    """Run the throughput rounds and the memory runs; returns the records (environment first)."""
    from ..data import build_train_transform

    bad = sorted(set(cfg.pipelines) - set(PIPELINES))
    if bad or cfg.images < cfg.batch_size or cfg.rounds < 1:
        raise ValueError(f"pipelines must be among {PIPELINES}, images >= batch_size and rounds >= 1 "
                         f"(got {cfg.pipelines}, {cfg.images}, {cfg.rounds})")
    torch.set_num_threads(cfg.threads)
    transform = build_train_transform(cfg.crop, auto_augment=cfg.auto_augment)
    records: List[Dict[str, Any]] = [_environment(cfg)]
    tmp = Path(tempfile.mkdtemp(prefix="ropekit-bench-data-"))
    try:
        if cfg.folder is not None:
            folder = Path(cfg.folder)
            from ..data import write_shards

            write_shards(folder, tmp / "shards", shard_size=cfg.shard_size, val_fraction=0)
            shards = tmp / "shards"
        else:
            folder, shards = _prepare(tmp / f"n{cfg.images}", cfg.images, cfg, log)
        names = list(cfg.pipelines)
        _time_epoch(names[0], folder, shards, transform, cfg, epoch=99)  # warm the page cache and imports
        for r in range(cfg.rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                rec = _time_epoch(name, folder, shards, transform, cfg, epoch=r)
                rec.update(kind="throughput", round=r)
                records.append(rec)
                log(f"round {r} {name:>13}: {rec['images_per_s']:.1f} images/s, {rec['cpu_ms_per_image']:.2f} CPU ms "
                    "per image")
        for n in cfg.memory_sizes:
            if n == cfg.images and cfg.folder is None:
                mfolder, mshards = folder, shards
            else:
                mfolder, mshards = _prepare(tmp / f"n{n}", n, cfg, log)
            for name in names:
                rec = _time_epoch(name, mfolder, mshards, transform, cfg, epoch=0, memory=True)
                rec.update(kind="memory", dataset_images=n)
                records.append(rec)
                log(f"memory {n:>6} {name:>13}: peak RSS {rec['peak_rss_mb']:.0f} MB, PSS "
                    f"{rec['peak_pss_mb']:.0f} MB ({rec['images_per_s']:.1f} images/s)")
            if mfolder != folder:
                shutil.rmtree(mfolder.parent, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    records.append({"kind": "load_after", "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg")
                    else None})
    return records


# ----------------------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------------------


def _summary(records: List[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Per pipeline: median images/s and CPU ms per image, and the medians of the per-round ratios to
    torchvision (throughput ratio: higher is better; CPU ratio: lower is better)."""
    thr = [r for r in records if r.get("kind") == "throughput"]
    out: Dict[str, Dict[str, Any]] = {}
    for name in PIPELINES:
        mine = [r for r in thr if r["pipeline"] == name]
        if not mine:
            continue
        ratios, cpu_ratios = [], []
        for r in mine:
            ref = next((t for t in thr if t["pipeline"] == "torchvision" and t["round"] == r["round"]), None)
            if ref is not None:
                ratios.append(r["images_per_s"] / ref["images_per_s"])
                cpu_ratios.append(r["cpu_ms_per_image"] / ref["cpu_ms_per_image"])
        out[name] = {"median": statistics.median(r["images_per_s"] for r in mine),
                     "all": [r["images_per_s"] for r in mine],
                     "cpu": statistics.median(r["cpu_ms_per_image"] for r in mine),
                     "ratio": statistics.median(ratios) if ratios else None, "ratios": ratios,
                     "cpu_ratio": statistics.median(cpu_ratios) if cpu_ratios else None}
    return out


def format_data_report(records: List[Dict[str, Any]], command: str = "") -> str:
    """Markdown: environment, throughput (median images/s and ratio to torchvision per round), memory, targets."""
    env = next((r for r in records if r.get("kind") == "environment"), {})
    cfg = env.get("config", {})
    after = next((r for r in records if r.get("kind") == "load_after"), {})
    lines = ["# Data pipeline: ropekit streams against torchvision ImageFolder", ""]
    if command:
        lines += [f"Command: `{command}`", ""]
    lines += [f"Machine: {env.get('cpu')} ({env.get('cpu_count')} logical CPUs); load average before "
              f"{_load(env.get('load_average'))}, after {_load(after.get('load_average'))}. Python "
              f"{env.get('python')}, torch {env.get('torch')}, torchvision {env.get('torchvision')}, webdataset "
              f"{env.get('webdataset')}, Pillow {env.get('pillow')}.", "",
              f"Pipeline: decode JPEG {cfg.get('image_size')}² → RandomResizedCrop {cfg.get('crop')} (bicubic) → "
              f"flip → {cfg.get('auto_augment') or 'no policy'} → float + normalise; "
              f"batch {cfg.get('batch_size')}, "
              f"{cfg.get('workers')} DataLoader workers, {cfg.get('images')} generated images "
              f"({cfg.get('classes')} classes), {cfg.get('rounds')} rounds alternating the pipelines; shards of "
              f"{cfg.get('shard_size')} images.", ""]
    summ = _summary(records)
    if summ:
        lines += ["## Throughput", "", "Images/s is wall-clock over an epoch (worker start included); CPU ms per "
                  "image is the user + system time of the main process and its workers over the same epoch, "
                  "which a busy machine disturbs less than wall time.", "",
                  "| pipeline | images/s (median) | each round | ratio to torchvision (median of rounds) | "
                  "each round | CPU ms / image (median) | CPU ratio to torchvision (median) |",
                  "|---|---|---|---|---|---|---|"]
        for name, s in summ.items():
            ratio = "–" if s["ratio"] is None else f"{s['ratio']:.3f}"
            cpu_ratio = "–" if s["cpu_ratio"] is None else f"{s['cpu_ratio']:.3f}"
            lines.append(f"| {name} | {s['median']:.1f} | {', '.join(f'{v:.1f}' for v in s['all'])} | {ratio} | "
                         f"{', '.join(f'{v:.3f}' for v in s['ratios'])} | {s['cpu']:.2f} | {cpu_ratio} |")
        lines.append("")
    mem = [r for r in records if r.get("kind") == "memory"]
    if mem:
        lines += ["## Memory (peak over one epoch: main process + workers)", "",
                  "| dataset images | pipeline | peak RSS sum (MB) | peak PSS sum (MB) | images/s |",
                  "|---|---|---|---|---|"]
        for r in mem:
            lines.append(f"| {r['dataset_images']} | {r['pipeline']} | {_mb(r.get('peak_rss_mb'))} | "
                         f"{_mb(r.get('peak_pss_mb'))} | {r['images_per_s']:.1f} |")
        lines.append("")
    lines += ["## Targets", ""]
    for name in ("folder-stream", "shards"):
        if name in summ and summ[name]["ratio"] is not None:
            ok = summ[name]["ratio"] >= 0.95
            lines.append(f"- {name} throughput ≥ 0.95 × torchvision: {summ[name]['ratio']:.3f} — "
                         f"{'met' if ok else 'NOT met'} (CPU per image {summ[name]['cpu_ratio']:.3f} × "
                         "torchvision's)")
    for name in ("folder-stream", "shards"):
        mine = sorted((r for r in mem if r["pipeline"] == name), key=lambda r: r["dataset_images"])
        if not mine or mine[-1].get("peak_rss_mb") is None:
            continue
        top = max(r["peak_rss_mb"] for r in mine)
        lines.append(f"- {name} peak RSS sum ≤ 1500 MB: {top:.0f} MB — {'met' if top <= 1500 else 'NOT met'}")
        if len(mine) > 1 and mine[0].get("peak_pss_mb") is not None:
            growth = mine[-1]["peak_pss_mb"] - mine[0]["peak_pss_mb"]
            lines.append(f"- {name} PSS growth from {mine[0]['dataset_images']} to {mine[-1]['dataset_images']} "
                         f"images: {growth:+.0f} MB")
    return "\n".join(lines) + "\n"


def _mb(v: Optional[float]) -> str:
    return "–" if v is None else f"{v:.0f}"


def _load(v: Optional[List[float]]) -> str:
    return "?" if not v else " / ".join(f"{x:.1f}" for x in v)
