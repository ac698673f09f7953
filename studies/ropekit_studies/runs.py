"""Trained runs, cached by a hash of their resolved configuration, and the two progress bars of a study.

A run is identified by the SHA-256 of its resolved configuration: the :class:`~ropekit.classification.TrainConfig`
without the runtime-only fields (run folder, progress bar, TensorBoard, threads, device, evaluation batch
size), the resolved :class:`~ropekit.nn.ViTConfig` built from it, and the ropekit version. Encoding options
equal to the encoding's defaults are dropped first, so ``{"block_size": 8}`` and ``{}`` for ComRoPE name the
same run. The run folder is ``<cache_dir>/<data>-<pe>-s<seed>-<hash16>`` and holds what ``ropekit train``
writes (``config.json``, ``checkpoint.pt``, ``metrics.csv``, ``summary.json``...).

A run is *complete* when its ``summary.json`` reports all epochs done; an incomplete run with a checkpoint is
resumed; concurrent processes that need the same run wait on a lock file instead of training it twice.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ropekit import __version__
from ropekit.encodings.registry import PE_REGISTRY
from ropekit.nn.vit import ViTConfig, VisionTransformer
from ropekit.train import load_run
from ropekit.classification import TrainConfig, build_vit_config, load_data, train
from ropekit.classification.config import split_pending_scaling
from ropekit.train.upgrade import flatten
from ropekit.train.checkpoint import CHECKPOINT_NAME, load_model_state
from ropekit.train.metrics import read_metrics_csv

__all__ = ["RunRecord", "RunCache", "Progress", "canonical_pe_options", "run_key", "RUNTIME_FIELDS"]

#: ``TrainConfig`` fields that do not change what is learned (left out of the hash).
RUNTIME_FIELDS = ("out", "progress", "tensorboard", "threads", "device", "eval_batch_size", "compile", "log_every",
                  "checkpoint_every")


def canonical_pe_options(pe: str, options: Dict[str, Any]) -> Dict[str, Any]:
    """``options`` without the entries equal to the encoding's default (sorted by name)."""
    name = pe.lower().replace("_", "-")
    cls = PE_REGISTRY.get(name)
    if cls is None:
        return dict(sorted(options.items()))
    defaults = {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
    return {k: v for k, v in sorted(options.items()) if not (k in defaults and defaults[k] == v)}


def _canonical(cfg: TrainConfig) -> TrainConfig:
    vit = cfg.model.vit()
    pe = vit.pe.lower().replace("_", "-")
    return cfg.replace(pe=pe, pe_options=canonical_pe_options(pe, dict(vit.pe_options)))


def _data_key(cfg: TrainConfig, image_size: Any = None) -> str:
    size = image_size if image_size is not None else cfg.data.image_size
    return json.dumps([cfg.data.name, cfg.data.data_root, size, cfg.data.split_seed, cfg.data.normalize,
                       cfg.data.data_options,
                       cfg.data.train_fraction], sort_keys=True, default=str)


_DATA_MEMO: Dict[str, Tuple[Any, Any, Any]] = {}


def memo_data(cfg: TrainConfig, image_size: Any = None) -> Tuple[Any, Any, Any]:
    """``ropekit.classification.load_data(cfg, image_size)``, memoised for the process (datasets are read-only here)."""
    key = _data_key(cfg, image_size)
    if key not in _DATA_MEMO:
        if len(_DATA_MEMO) > 16:
            _DATA_MEMO.clear()
        _DATA_MEMO[key] = load_data(cfg, image_size=image_size)
    return _DATA_MEMO[key]


def _train_doc(cfg: TrainConfig) -> Dict[str, Any]:
    """The ``TrainConfig`` fields that decide what a run learns; a run it starts from (``init_from``, a run folder
    of the cache, named by its key) by its folder name, so that neither the hash nor the outputs hold the cache's
    absolute path."""
    doc = {k: v for k, v in flatten(cfg.to_nested()).items() if k not in RUNTIME_FIELDS}
    if doc.get("init_from"):
        doc["init_from"] = Path(str(doc["init_from"])).name
    return doc


def run_key(cfg: TrainConfig) -> Tuple[str, Dict[str, Any]]:
    """``(hash16, document)``: the hash of the resolved configuration and the document it hashes."""
    cfg = _canonical(cfg)
    _, _, info = memo_data(cfg)
    plain, _ = split_pending_scaling(cfg)  # (a scaling asked for by method: its train section names it)
    doc = {"train": _train_doc(cfg), "model": build_vit_config(plain, info).to_dict(), "ropekit": __version__}
    text = json.dumps(doc, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16], doc


@dataclass
class RunRecord:
    """A trained (or cached) run: its folder, configuration and per-epoch metrics."""

    key: str
    run_dir: Path
    config: TrainConfig
    history: List[Dict[str, float]]
    summary: Dict[str, Any]
    cached: bool
    label: str = ""
    _model: Optional[VisionTransformer] = field(default=None, repr=False)

    @property
    def final(self) -> Dict[str, float]:
        return dict(self.history[-1]) if self.history else {}

    def model(self) -> VisionTransformer:
        """The trained model in eval mode (loaded from the checkpoint once, then kept)."""
        if self._model is None:
            _, ckpt = load_run(self.run_dir)
            model = VisionTransformer(ViTConfig.from_dict(ckpt["vit_config"], source=f"checkpoint {ckpt['path']}",
                                                          strict=False))
            load_model_state(model, ckpt["model"], source=f"checkpoint {ckpt['path']}")
            self._model = model
        return self._model.eval()

    def release(self) -> None:
        """Drop the in-memory model (the checkpoint stays on disk)."""
        self._model = None

    def describe(self) -> Dict[str, Any]:
        """What the outputs record about this run (no absolute paths); ``machine`` is where it was trained
        (:func:`ropekit._platform.numerics_fingerprint`; ``None`` for a run trained before summaries recorded it)."""
        doc = _train_doc(self.config)
        return {"key": self.key, "label": self.label, "run": self.run_dir.name, "cached": self.cached,
                "wall_time": self.summary.get("wall_time"), "num_params": self.summary.get("num_params"),
                "machine": self.summary.get("machine"), "train_config": doc}


class Progress:
    """Two bars: the study (position 0) and the run being trained (position 1, steps)."""

    def __init__(self, total: int, desc: str, enabled: bool = True) -> None:
        from tqdm import tqdm

        self._tqdm = tqdm
        self.enabled = enabled
        self.study = tqdm(total=total, desc=desc, position=0, leave=True, disable=not enabled, dynamic_ncols=True,
                          file=sys.stderr, unit="model")

    def run_bar(self, total: int, desc: str, initial: int = 0):
        return self._tqdm(total=total, initial=initial, desc=desc, position=1, leave=False, disable=not self.enabled,
                          dynamic_ncols=True, file=sys.stderr, unit="step")

    def advance(self, n: int = 1, note: Optional[str] = None) -> None:
        if note:
            self.study.set_postfix_str(note, refresh=False)
        self.study.update(n)

    def write(self, msg: str) -> None:
        self._tqdm.write(msg, file=sys.stderr)

    def close(self) -> None:
        self.study.close()


class _RunLock:
    """An ``O_EXCL`` lock file next to a run folder; waits while another live process holds it."""

    def __init__(self, path: Path, poll: float = 2.0) -> None:
        self.path = path
        self.poll = poll
        self.held = False

    def __enter__(self) -> "_RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                os.write(fd, str(os.getpid()).encode())
                os.close(fd)
                self.held = True
                return self
            except FileExistsError:
                if self._stale():
                    try:
                        self.path.unlink()
                    except FileNotFoundError:
                        pass
                    continue
                time.sleep(self.poll)

    def _stale(self) -> bool:
        try:
            pid = int(self.path.read_text().strip() or "0")
        except (OSError, ValueError):
            return True
        if pid <= 0 or pid == os.getpid():
            return True
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def __exit__(self, *exc: Any) -> None:
        if self.held:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
            self.held = False


class RunCache:
    """Train-or-load runs in ``cache_dir`` (see the module docstring)."""

    def __init__(self, cache_dir: Any, threads: Optional[int] = 1, progress: Optional[Progress] = None) -> None:
        self.root = Path(cache_dir).expanduser()
        self.threads = threads
        self.progress = progress
        self._records: Dict[str, RunRecord] = {}

    def run_dir(self, cfg: TrainConfig) -> Path:
        key, _ = run_key(cfg)
        return self.root / f"{cfg.data.name}-{cfg.model.vit().pe}-s{cfg.run.seed}-{key}"

    @staticmethod
    def _complete(run_dir: Path, epochs: int) -> Optional[Dict[str, Any]]:
        path = run_dir / "summary.json"
        if not (path.is_file() and (run_dir / CHECKPOINT_NAME).is_file() and (run_dir / "metrics.csv").is_file()):
            return None
        try:
            summary = json.loads(path.read_text())
        except json.JSONDecodeError:
            return None
        if summary.get("interrupted") or int(summary.get("epochs_done", -1)) != int(epochs):
            return None
        return summary

    def get(self, cfg: TrainConfig, label: str = "") -> RunRecord:
        """The run for ``cfg``: from the cache when complete, else trained (or resumed) now."""
        cfg = _canonical(cfg)
        key, doc = run_key(cfg)
        if key in self._records:
            return self._records[key]
        run_dir = self.root / f"{cfg.data.name}-{cfg.model.vit().pe}-s{cfg.run.seed}-{key}"
        label = label or f"{cfg.model.vit().pe} s{cfg.run.seed}"
        summary = self._complete(run_dir, cfg.optim.epochs)
        cached = summary is not None
        if summary is None:
            with _RunLock(run_dir.with_name(run_dir.name + ".lock")):
                summary = self._complete(run_dir, cfg.optim.epochs)  # another process may have finished it meanwhile
                cached = summary is not None
                if summary is None:
                    summary = self._train(cfg, run_dir, label, doc)
        history = read_metrics_csv(run_dir / "metrics.csv")
        rec = RunRecord(key=key, run_dir=run_dir, config=cfg, history=history, summary=summary, cached=cached,
                        label=label)
        self._records[key] = rec
        return rec

    def _train(self, cfg: TrainConfig, run_dir: Path, label: str, doc: Dict[str, Any]) -> Dict[str, Any]:
        train_ds, _, _ = memo_data(cfg)
        steps = math.ceil(len(train_ds) / cfg.optim.batch_size)
        resume = (run_dir / CHECKPOINT_NAME).is_file()
        run_cfg = cfg.replace(out=str(run_dir), progress=False, tensorboard=False, threads=self.threads)
        bar = self.progress.run_bar(cfg.optim.epochs * steps, f"train {label}") if self.progress else None

        def on_step(global_step: int) -> None:
            if bar is not None:
                bar.update(global_step - bar.n)

        try:
            result = train(run_cfg, resume=resume, on_step=on_step, quiet=True)
        finally:
            if bar is not None:
                bar.close()
        if result.interrupted:
            raise KeyboardInterrupt
        (run_dir / "run_key.json").write_text(json.dumps(doc, indent=2, sort_keys=True, default=str) + "\n")
        summary = json.loads((run_dir / "summary.json").read_text())
        if self.progress is not None:
            acc = result.final.get("test_acc")
            self.progress.write(f"trained {label}: test accuracy {acc:.4f} in {result.wall_time:.0f}s "
                                f"({run_dir.name})")
        return summary

    def records(self) -> List[RunRecord]:
        return list(self._records.values())
