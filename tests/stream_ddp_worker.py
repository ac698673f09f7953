"""Run by tests/test_train_stream.py under ``torchrun --nproc_per_node 2`` (gloo on the CPU): for each data kind
(a JPEG folder and its shards), a tiny ViT trained uninterrupted, then the same run stopped mid-epoch and resumed
in a fresh model; each rank saves the final weights of both as ``<out>/<kind>-<run>-rank<r>.pt``."""

import os
import sys
from pathlib import Path

import torch

from ropekit.classification import train
from ropekit.classification.config import TrainConfig

RECIPE = dict(  # the DeiT recipe's augmentations, scaled down to 24-pixel images and a one-block ViT
    image_size=24, patch_size=8, model="tiny", model_options=dict(depth=1, embed_dim=24, num_heads=1,
                                                                  drop_path_rate=0.1),
    epochs=2, batch_size=8, lr=5e-4, lr_base_batch=4, warmup_epochs=1, weight_decay=0.05, label_smoothing=0.1,
    auto_augment="rand-m9-n2", random_erasing=0.25, mixup_alpha=0.8, cutmix_alpha=1.0, crop_pct=0.875,
    log_every=2, checkpoint_every=3, workers=1, eval_batch_size=16, device="cpu", threads=1, progress=False,
    tensorboard=False)


def main(out: Path) -> None:
    rank = int(os.environ["RANK"])
    for kind, data in (("folder", "folder-stream"), ("shards", "shards")):
        cfg = TrainConfig.from_dict(dict(data=data, data_root=str(out / kind), **RECIPE))
        full = train(cfg.replace(out=str(out / f"{kind}-full")), quiet=True)
        torch.save(full.model.state_dict(), out / f"{kind}-full-rank{rank}.pt")
        part = cfg.replace(out=str(out / f"{kind}-part"))
        stopped = train(part, quiet=True, on_step=lambda s: s == 5)  # (agreed at the step-6 check under DDP)
        assert stopped.interrupted, "the run was not stopped"
        torch.manual_seed(1234)  # a resumed run restores every RNG from the checkpoint
        resumed = train(part, resume=True, quiet=True)
        torch.save(resumed.model.state_dict(), out / f"{kind}-resumed-rank{rank}.pt")
        if rank == 0:
            torch.save({"full": full.history, "resumed": resumed.history}, out / f"{kind}-history.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
