"""Compilations, recompilations and graph breaks of a compiled ViT training step, per encoding.

Each encoding's ViT is compiled (forward, and through AOT autograd its backward) with its optimiser step compiled
as well, then trained for ``--steps`` steps; the table gives, from Dynamo's counters, how many graphs were
compiled for the model (1 when its forward does not break), how many after the first step (0 when nothing
recompiles), how many times a frame was compiled again (the guard failures Dynamo logs as ``Recompiling
function``) and how many graph breaks the model's forward had. PyTorch's optimiser step breaks its own graph
around the update on purpose (``torch.optim.optimizer._use_grad_for_differentiable``); it is compiled too, and
must not recompile either.

    python tools/recompiles.py --device cpu                     # tiny ViT, aot_eager, every encoding (~2 min)
    python tools/recompiles.py --device cpu --kernel-path torch # the Python a GPU runs, the PyTorch rotation
    python tools/recompiles.py --device cuda --mode reduce-overhead --pes absolute axial cayley comrope-ld

``--kernel-path torch`` (CPU) makes the path a GPU takes reachable without one: ropekit's dispatch is told the
fused kernel runs (as ``TRITON_INTERPRET=1`` does), and the kernel module's entry points are replaced by the
PyTorch rotation, so Dynamo traces the same ropekit Python as on CUDA, quickly. ``--kernel-path interpret`` runs
the real Triton kernels in Triton's interpreter (slow). Exit status 1 when any encoding compiled more than once,
broke its graph or failed (``--check``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's ropekit

DEFAULT_PES = ["absolute", "none", "axial", "mixed", "cayley", "circulant", "comrope-ld", "comrope-ap", "liere",
               "liere-commute", "string", "relaxed", "tensor"]


def _stand_in_kernels() -> None:
    """Tell ropekit's dispatch that the fused rotation runs on the CPU, with the PyTorch rotation behind the kernel
    module's entry points (before any compilation: the process then looks like a GPU's to Dynamo)."""
    os.environ["TRITON_INTERPRET"] = "1"
    import ropekit.kernels as kernels
    from ropekit.encodings.ops.rotation import apply_frequency_rope

    def fused_rotary(q, k, coords, freqs, *, k_coords=None, num_prefix_tokens=0, pairs="interleaved",
                     validate=True):
        return apply_frequency_rope(q, k, coords, freqs, k_coords=k_coords, num_prefix_tokens=num_prefix_tokens,
                                    pairs=pairs, backend="torch", validate=validate)

    kernels.available = lambda device: True
    kernels.unavailable_reason = lambda device: None
    kernels.fused_rotary = fused_rotary
    kernels.basis_rotary_supported = lambda *args: False


class _RecompileCount(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "Recompiling function" in record.getMessage():
            self.count += 1


def measure(pe: str, args) -> dict:
    import torch
    from torch._dynamo.utils import counters

    from ropekit.nn import VisionTransformer, vit_config

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    dev = torch.device(args.device)
    size = dict(image_size=(args.image, args.image), patch_size=args.patch, depth=args.depth)
    model = VisionTransformer(vit_config(args.size, num_classes=10, in_chans=3, pe=pe, **size)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **({"fused": True} if dev.type == "cuda" else {}))
    kw = {"backend": args.backend} if args.mode == "none" else {"mode": args.mode}
    step_model = torch.compile(model, **kw)
    opt_step = torch.compile(opt.step, **kw) if args.optimizer else opt.step
    x = torch.rand(args.batch, 3, args.image, args.image, device=dev)
    y = torch.randint(0, 10, (args.batch,), device=dev)
    amp = torch.autocast(dev.type, torch.bfloat16, enabled=dev.type == "cuda")
    handler = _RecompileCount()
    logger = logging.getLogger("torch._dynamo")
    torch._logging.set_logs(recompiles=True)
    logger.addHandler(handler)
    t0, err = time.perf_counter(), None
    model_graphs = model_breaks = later_graphs = 0
    reasons: list = []

    def graphs() -> int:
        return int(counters["stats"]["unique_graphs"])

    def breaks() -> dict:
        return dict(counters["graph_break"])

    try:
        for i in range(args.steps):
            if args.mode == "reduce-overhead":  # a new step for CUDA-graph trees: the last step's outputs may be reused
                torch.compiler.cudagraph_mark_step_begin()
            g0, b0 = graphs(), breaks()
            with amp:
                loss = torch.nn.functional.cross_entropy(step_model(x), y)
            loss.backward()
            model_graphs += graphs() - g0
            b1 = breaks()
            model_breaks += sum(b1.values()) - sum(b0.values())
            reasons += [k for k in b1 if b1[k] != b0.get(k, 0)]
            opt_step()  # (PyTorch's optimiser breaks its own graph around the update, on purpose)
            opt.zero_grad(set_to_none=False)
            if i == 0:
                first = graphs()
            if i == args.steps - 1:
                later_graphs = graphs() - first
        if dev.type == "cuda":
            torch.cuda.synchronize()
        loss = float(loss.detach())
    except Exception as e:  # noqa: BLE001 -- reported in the table
        err = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        loss = float("nan")
    finally:
        logger.removeHandler(handler)
        torch._logging.set_logs()
    return {"pe": pe, "model_graphs": model_graphs, "graphs": graphs(), "compiled_after_first_step": later_graphs,
            "recompiles": handler.count, "graph_breaks": model_breaks,
            "break_reasons": sorted({" ".join(k.split())[:200] for k in reasons}), "error": err,
            "seconds": round(time.perf_counter() - t0, 1), "loss": loss}


def ok(row: dict) -> bool:
    return (row["error"] is None and row["recompiles"] == 0 and row["graph_breaks"] == 0
            and row["model_graphs"] == 1 and row["compiled_after_first_step"] == 0)


def markdown(rows: list, args) -> str:
    how = f"mode {args.mode}" if args.mode != "none" else f"backend {args.backend}"
    lines = [f"Compiled ViT training step ({args.size}, {args.image} px, patch {args.patch}, depth {args.depth}, "
             f"batch {args.batch}) on {args.device}, {how}, kernel path {args.kernel_path}, {args.steps} steps. ok: "
             f"the model (forward and backward) is one graph without a break, nothing recompiles, nothing is compiled "
             f"after the first step (graphs: all, the optimiser's included).", "",
             "| encoding | model graphs | graphs | compiled after step 1 | recompiles | model graph breaks | s | ok | "
             "error |", "|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        lines.append(f"| {r['pe']} | {r['model_graphs']} | {r['graphs']} | {r['compiled_after_first_step']} | "
                     f"{r['recompiles']} | {r['graph_breaks']} | {r['seconds']} | {'yes' if ok(r) else '**no**'} | "
                     f"{r['error'] or '; '.join(r['break_reasons'])} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--pes", nargs="+", default=DEFAULT_PES, help="encodings (registry names; absolute = APE)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--mode", default="none",
                   help="torch.compile mode (default, reduce-overhead, max-autotune-no-cudagraphs); none: --backend")
    p.add_argument("--backend", default="aot_eager", help="torch.compile backend when --mode none")
    p.add_argument("--kernel-path", choices=["auto", "torch", "interpret"], default="auto",
                   help="auto: the device's own; torch / interpret: the GPU's dispatch on the CPU (see above)")
    p.add_argument("--size", default="tiny")
    p.add_argument("--image", type=int, default=32)
    p.add_argument("--patch", type=int, default=8)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--no-optimizer", dest="optimizer", action="store_false", help="leave the optimiser eager")
    p.add_argument("--json", help="write the rows to this file")
    p.add_argument("--markdown", help="write the table to this file")
    p.add_argument("--check", action="store_true", help="exit 1 unless every encoding compiled once, cleanly")
    args = p.parse_args(argv)
    if args.kernel_path == "torch":
        _stand_in_kernels()
    elif args.kernel_path == "interpret":
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    torch._dynamo.config.recompile_limit = max(8, args.steps + 1)  # count them all, up to a step each
    rows = []
    for pe in args.pes:  # files rewritten after each row: a run cut off by a time limit keeps what it measured
        rows.append(measure(pe, args))
        print(json.dumps(rows[-1]), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")
        if args.markdown:
            Path(args.markdown).write_text(markdown(rows, args))
    print(markdown(rows, args), end="", flush=True)
    return 1 if args.check and not all(ok(r) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
