"""What per-image coordinates (position jitter, coordinate augmentation) cost a training step, per encoding: the
step with the shared patch grid against the same step with ``--jitter``, timed in alternation.

    python tools/per_image_coords.py                          # the 2-block MNIST ViT of the studies, one thread
    python tools/per_image_coords.py --pes liere cayley --jitter 0.5 --batch 64 --steps 7

A commuting encoding's angles are linear in the coordinates, so moving them per image costs little; LieRE with two
or more axes computes one matrix exponential per distinct coordinate, once per batch on a shared grid and once per
image with per-image coordinates. The step is forward, cross-entropy, backward and AdamW on random 28x28 images; the
time is the median of ``--steps`` steps after one warm-up step (wall clock).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's ropekit

import torch  # noqa: E402

from ropekit.nn import VisionTransformer, ViTConfig  # noqa: E402


def _step(pe: str, jitter: float, batch: int):
    torch.manual_seed(0)
    model = VisionTransformer(ViTConfig(image_size=28, patch_size=4, in_chans=1, num_classes=10, embed_dim=64,
                                        depth=2, num_heads=2, pe=pe, jitter=jitter))
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    x, y = torch.randn(batch, 1, 28, 28), torch.randint(0, 10, (batch,))

    def step() -> float:
        t = time.perf_counter()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t

    return step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pes", nargs="+", default=["liere", "cayley", "mixed"])
    p.add_argument("--jitter", type=float, default=0.5, help="position jitter in patches (default 0.5)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), batch {args.batch}, jitter {args.jitter:g}, "
          f"median of {args.steps} steps")
    print("| encoding | shared grid (ms) | per-image coordinates (ms) | ratio |\n|---|---:|---:|---:|")
    for pe in args.pes:
        shared, moved = _step(pe, 0.0, args.batch), _step(pe, args.jitter, args.batch)
        shared(), moved()  # warm-up
        a, b = [], []
        for _ in range(args.steps):  # in alternation, so that the machine's state affects both
            a.append(shared())
            b.append(moved())
        ta, tb = statistics.median(a), statistics.median(b)
        print(f"| {pe} | {ta * 1e3:.0f} | {tb * 1e3:.0f} | {tb / ta:.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
