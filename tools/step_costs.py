"""What each part of an encoding's eager ViT training step costs: coordinate validation on / off, the rotation's
backend (fused Triton kernel / PyTorch), folding on / off -- each as a multiple of the absolute-embedding step,
timed in alternation with it.

    python tools/step_costs.py --device cuda --json costs.json --markdown costs.md   # ViT-B/16, bf16, batch 128
    python tools/step_costs.py --device cpu --size tiny --image 32 --patch 8 --batch 8 --steps 3   # a smoke run

Each row changes one thing against the encoding's default (validation ``auto``: deferred on a GPU; backend
``auto``: the kernel where it runs; folding on). The step is forward (bf16 autocast on a GPU), cross-entropy,
backward and fused AdamW; the time is the median of ``--steps`` steps after ``--warmup``, by CUDA events on a GPU
(wall clock on the CPU), alternating row and reference step by step so that clocks and neighbours affect both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's ropekit

#: (encoding, label, validation mode, backend, fold)
ROWS = [
    ("axial", "default", "auto", "auto", True),
    ("axial", "validation off", "off", "auto", True),
    ("axial", "backend torch", "auto", "torch", True),
    ("mixed", "default", "auto", "auto", True),
    ("cayley", "default (folded)", "auto", "auto", True),
    ("cayley", "validation off", "off", "auto", True),
    ("cayley", "backend torch", "auto", "torch", True),
    ("cayley", "no fold", "auto", "auto", False),
    ("circulant", "default (folded)", "auto", "auto", True),
    ("circulant", "no fold", "auto", "auto", False),
    ("comrope-ld", "default (folded)", "auto", "auto", True),
    ("comrope-ld", "validation off", "off", "auto", True),
    ("comrope-ld", "no fold", "auto", "auto", False),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--size", default="base")
    p.add_argument("--image", type=int, default=224)
    p.add_argument("--patch", type=int, default=16)
    p.add_argument("--depth", type=int, default=None, help="override the size's depth")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--pes", nargs="+", default=None, help="only these encodings' rows")
    p.add_argument("--json")
    p.add_argument("--markdown")
    args = p.parse_args(argv)

    import torch

    from ropekit.encodings import set_coord_validation
    from ropekit.nn import VisionTransformer, vit_config

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    extra = {} if args.depth is None else {"depth": args.depth}
    x = torch.rand(args.batch, 3, args.image, args.image, device=dev)
    y = torch.randint(0, 1000, (args.batch,), device=dev)

    def build(pe: str, backend: str, fold: bool):
        torch.manual_seed(0)
        model = VisionTransformer(vit_config(args.size, num_classes=1000, in_chans=3, pe=pe, patch_size=args.patch,
                                             image_size=(args.image, args.image), **extra)).to(dev)
        for blk in model.blocks:
            blk.attn.fold = fold
        for enc in model.encodings:
            enc.set_conventions(backend=backend)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if cuda else {}))

        def step() -> None:
            with torch.autocast(dev.type, torch.bfloat16, enabled=cuda):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    def timed(step) -> float:
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t = time.perf_counter()
        step()
        return (time.perf_counter() - t) * 1e3

    ape = build("absolute", "auto", True)
    results = []
    for pe, label, validation, backend, fold in ROWS:
        if args.pes and pe not in args.pes:
            continue
        previous = set_coord_validation(validation)
        try:
            step = build(pe, backend, fold)
            for _ in range(args.warmup):
                step()
                ape()
            mine, ref = [], []
            for _ in range(args.steps):
                mine.append(timed(step))
                ref.append(timed(ape))
            row = {"pe": pe, "variant": label, "validation": validation, "backend": backend, "fold": fold,
                   "ms": statistics.median(mine), "ape_ms": statistics.median(ref), "error": None}
            row["x_ape"] = row["ms"] / row["ape_ms"]
        except Exception as e:  # noqa: BLE001 -- reported in the table
            row = {"pe": pe, "variant": label, "validation": validation, "backend": backend, "fold": fold,
                   "ms": None, "ape_ms": None, "x_ape": None, "error": f"{type(e).__name__}: {str(e)[:200]}"}
        finally:
            set_coord_validation(previous)
        results.append(row)
        print(json.dumps(row), flush=True)  # (the log keeps every row even if a time limit cuts the run)
    name = torch.cuda.get_device_name(dev) if cuda else "CPU"
    lines = [f"Eager training step costs, {name}, ViT-{args.size} {args.image} px patch {args.patch}, batch "
             f"{args.batch}{', bf16 autocast, fused AdamW' if cuda else ''}; median of {args.steps} steps, each "
             f"step alternating with the absolute-embedding ViT's.", "",
             "| encoding | variant | validation | backend | fold | step ms | APE ms | x APE |",
             "|---|---|---|---|---|---:|---:|---:|"]
    for r in results:
        if r["error"]:
            lines.append(f"| {r['pe']} | {r['variant']} | {r['validation']} | {r['backend']} | {r['fold']} | "
                         f"{r['error']} | | |")
        else:
            lines.append(f"| {r['pe']} | {r['variant']} | {r['validation']} | {r['backend']} | {r['fold']} | "
                         f"{r['ms']:.2f} | {r['ape_ms']:.2f} | {r['x_ape']:.3f} |")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "device": name, "rows": results}, indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
