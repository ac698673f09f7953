"""Run outputs: ``metrics.csv`` (one row per epoch), TensorBoard event files, and a PNG of the learning curves."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from .._io import atomic_write

__all__ = ["METRIC_COLUMNS", "write_metrics_csv", "read_metrics_csv", "plot_curves", "TensorBoardLogger",
           "atomic_write_text"]

#: Columns of ``metrics.csv``; accuracies are fractions in [0, 1], times in seconds.
METRIC_COLUMNS = ("epoch", "train_loss", "train_acc", "test_loss", "test_acc", "lr", "epoch_time", "elapsed_time")


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (:func:`ropekit._io.atomic_write`)."""
    atomic_write(path, text)


def write_metrics_csv(path: Path, rows: Sequence[Dict[str, Any]], columns: Optional[Sequence[str]] = None) -> None:
    """(Re)write ``metrics.csv`` from the full history, atomically (so a resumed run never has gaps).

    ``columns``: the column order (default :data:`METRIC_COLUMNS` when the rows have them, else every key of the
    rows in order of first appearance).
    """
    if columns is None:
        keys: List[str] = []
        for row in rows:
            keys.extend(k for k in row if k not in keys)
        columns = list(METRIC_COLUMNS) if set(METRIC_COLUMNS) <= set(keys) else keys
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(columns), extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _fmt(row.get(k)) for k in columns})
    atomic_write_text(Path(path), buf.getvalue())


def read_metrics_csv(path: Path) -> List[Dict[str, float]]:
    with open(path, newline="") as f:
        return [{k: float(v) for k, v in row.items() if v not in (None, "")} for row in csv.DictReader(f)]


def _fmt(v: Any) -> Any:
    if isinstance(v, float):
        return f"{v:.6g}"
    return "" if v is None else v


def plot_curves(rows: Sequence[Dict[str, Any]], path: Path, title: Optional[str] = None) -> Optional[Path]:
    """Loss and accuracy against epoch, train and test, saved as a PNG. Returns the path (``None`` if no rows)."""
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    ep = [r["epoch"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    ax1.plot(ep, [r["train_loss"] for r in rows], "o-", label="train")
    ax1.plot(ep, [r["test_loss"] for r in rows], "s-", label="test")
    ax1.set_xlabel("epoch")
    ax1.set_ylabel("cross-entropy loss")
    ax1.legend()
    ax1.grid(alpha=0.3)
    ax2.plot(ep, [r["train_acc"] for r in rows], "o-", label="train")
    ax2.plot(ep, [r["test_acc"] for r in rows], "s-", label="test")
    ax2.set_xlabel("epoch")
    ax2.set_ylabel("accuracy")
    ax2.legend()
    ax2.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    atomic_write(path, lambda f: fig.savefig(f, dpi=100, format=path.suffix.lstrip(".") or "png"))
    plt.close(fig)
    return path


class TensorBoardLogger:
    """Scalars to ``<run>/tb`` when ``tensorboard`` is installed; a silent no-op otherwise."""

    def __init__(self, log_dir: Path, enabled: bool = True) -> None:
        self.writer = None
        if not enabled:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
        except Exception:  # noqa: BLE001 - ImportError, or a broken tensorboard install
            return
        self.writer = SummaryWriter(log_dir=str(log_dir))

    @property
    def active(self) -> bool:
        return self.writer is not None

    def log(self, row: Dict[str, Any], step: Optional[int] = None) -> None:
        """Every number of ``row`` as a scalar at ``step`` (default ``row["epoch"]``); ``train_loss`` and
        ``test_loss`` go to ``loss/train`` and ``loss/test`` (accuracies likewise), so both share a chart."""
        if self.writer is None:
            return
        step = int(row["epoch"] if step is None else step)
        for k, v in row.items():
            if k in ("epoch", "step") or isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            head, _, tail = k.partition("_")
            name = f"{'loss' if tail == 'loss' else 'accuracy'}/{head}" if tail in ("loss", "acc") and \
                head in ("train", "test") else k
            self.writer.add_scalar(name, v, step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
