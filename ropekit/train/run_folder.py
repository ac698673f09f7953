"""Reading a run folder written by ``ropekit train``: its ``config.json`` and checkpoint.

Kept apart from the trainer so that code which only reads runs (fine-tuning, evaluation, experiment reports)
does not import the training loop.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Tuple

from .checkpoint import CheckpointError, load_checkpoint

__all__ = ["load_run"]


def load_run(run_dir: Any) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``(config, checkpoint)`` of a run folder or a checkpoint file.

    ``config`` is the parsed ``config.json`` (``{"train": ..., "model": ..., ...}``), or, when the folder has none
    or a checkpoint file is given, ``{"train", "model"}`` taken from the checkpoint.

    Raises:
        FileNotFoundError: no such folder. CheckpointError: no readable checkpoint, or a ``config.json`` that is
            not JSON (one-line messages).
    """
    run = Path(run_dir).expanduser()
    if not run.exists():
        raise FileNotFoundError(f"run folder not found: {run}")
    if run.is_file():  # a checkpoint file: take the config from it
        ckpt = load_checkpoint(run)
        return {"train": ckpt.get("train_config", {}), "model": ckpt["vit_config"]}, ckpt
    cfg_path = run / "config.json"
    ckpt = load_checkpoint(run)
    if cfg_path.is_file():
        try:
            config = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{cfg_path} is not valid JSON ({e.msg})") from None
        if not isinstance(config, dict):
            raise CheckpointError(f"{cfg_path} does not hold a mapping")
    else:
        config = {"train": ckpt.get("train_config", {}), "model": ckpt.get("vit_config", {})}
    return config, ckpt
