"""Operations per ViT training step: a machine-independent proxy of an eager GPU step's kernel launches.

On a GPU an eager training step of a small or mid-sized ViT is often bound by the host launching one kernel per
ATen operation, and a folded encoding's extra cost is mostly extra small operations (its basis, the merge into the
projection, the gradients of learned frequencies). Counting the top-level ATen operations of one step on the CPU
measures that without a GPU and without timing noise (``ropekit bench --ops``).

Two forms of the same step (forward, cross entropy, backward, AdamW) are counted:

* ``device`` -- the step as it runs on a GPU: fused AdamW (one operation for all parameters), the backward
  reductions of the rotation as single batched operations (on the CPU they loop over the batch, see
  ``encodings.ops.rotation.slice_loops``) and the coordinate check deferred (no host read). The target of the
  folded encodings is stated in this form.
* ``cpu`` -- the step as the CPU bench times it (per-parameter AdamW, the CPU's loops).

Both take the PyTorch rotation path; on a CUDA device with Triton the rotation of q and k is one fused kernel
(forward) for every encoding, so the proxy overstates the per-layer rotation work there, axial's included.

``all`` counts every top-level ATen operation, ``non_view`` leaves out the view-like ones (no arithmetic, no
launch: ``VIEWS``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Sequence

import torch
from torch.profiler import ProfilerActivity, profile

__all__ = ["VIEWS", "count_step_ops", "step_op_counts", "format_op_counts"]

#: View-like operations (no arithmetic, no launch), left out of the ``non_view`` count.
VIEWS = frozenset({
    "aten::view", "aten::reshape", "aten::t", "aten::transpose", "aten::permute", "aten::select", "aten::slice",
    "aten::unsqueeze", "aten::squeeze", "aten::expand", "aten::detach", "aten::unflatten", "aten::flatten",
    "aten::as_strided", "aten::alias", "aten::unbind", "aten::split", "aten::split_with_sizes", "aten::narrow",
    "aten::view_as_real", "aten::view_as_complex", "aten::_unsafe_view", "aten::mH", "aten::mT", "aten::diagonal",
    "aten::imag", "aten::real", "aten::expand_as", "aten::view_as", "aten::lift_fresh"})


def count_step_ops(step: Callable[[], None]) -> Dict[str, int]:
    """Top-level ATen operations of one call of ``step`` (after one unprofiled call that builds the optimiser
    state and cached tables): ``{"all": n, "non_view": m}``."""
    from .measure import native_output_to_stderr

    step()
    with native_output_to_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    top = [e.name for e in prof.events() if e.name.startswith("aten::")
           and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    return {"all": len(top), "non_view": sum(name not in VIEWS for name in top)}


@contextlib.contextmanager
def _device_form() -> Iterator[None]:
    """The rotation's backward reductions batched, the folded weights merged for all layers at once and the
    coordinate check deferred, as on an accelerator."""
    from ..encodings import fold
    from ..encodings.ops import rotation
    from ..encodings.ops.validation import set_coord_validation

    loop, merge, previous = rotation.LOOP_MIN_BYTES, fold.MERGE_BY_LAYER_DEVICES, set_coord_validation("deferred")
    rotation.LOOP_MIN_BYTES, fold.MERGE_BY_LAYER_DEVICES = 1 << 62, ()
    try:
        yield
    finally:
        rotation.LOOP_MIN_BYTES, fold.MERGE_BY_LAYER_DEVICES = loop, merge
        set_coord_validation(previous)


def step_op_counts(pes: Sequence[str], size: str = "tiny", batch: int | None = None,
                   image_size: int | None = None, reference: str = "axial",
                   forms: Sequence[str] = ("device", "cpu")) -> List[Dict[str, Any]]:
    """Op counts of one ViT training step per encoding, in both forms, with the ratio to ``reference``.

    Args:
        pes: encoding names (their ``bench_vit_options``, as the training-step table).
        size: ViT size (``ropekit.nn.vit_config``); ``batch`` and ``image_size`` default to the bench's.
        reference: the encoding the ratios are taken against (counted too, first).
        forms: which forms to count (``"device"``, ``"cpu"``).

    Returns:
        One record per encoding: ``pe``, ``size``, ``device_all``, ``device_non_view``, ``cpu_all``,
        ``cpu_non_view`` (those of ``forms``) and each divided by the reference's (``*_ratio``). Counts do not
        depend on the batch or image size, except where a CPU loop runs over the batch (the ``cpu`` form).
    """
    from .core import BenchConfig
    from .training_step import VIT_SETTINGS, vit_step

    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        image, patch, chans, default_batch = VIT_SETTINGS[size]
        cfg = BenchConfig(vit_batch=batch) if batch is not None else BenchConfig()
        names = [reference] + [p for p in pes if p != reference]
        counts: Dict[str, Dict[str, int]] = {}
        for pe in names:
            out: Dict[str, int] = {}
            for form in forms:
                with (_device_form() if form == "device" else contextlib.nullcontext()):
                    step = vit_step(size, pe, cfg, fused_adamw=form == "device", image_size=image_size)
                    for key, n in count_step_ops(step).items():
                        out[f"{form}_{key}"] = n
            counts[pe] = out
    finally:
        torch.set_num_threads(torch_threads)
    ref = counts[reference]
    records = []
    for pe in names:
        rec: Dict[str, Any] = {"kind": "ops", "pe": pe, "size": size, "reference": reference, **counts[pe]}
        rec.update({f"{k}_ratio": counts[pe][k] / ref[k] for k in ref})
        records.append(rec)
    return records


def format_op_counts(records: Sequence[Dict[str, Any]], command: str = "") -> str:
    """The records of :func:`step_op_counts` as a markdown table."""
    ref = records[0]["reference"] if records else "axial"
    lines = ["## ATen operations per ViT training step", ""]
    if command:
        lines += [f"Command: `{command}`", ""]
    if records and "cpu_all" not in records[0]:
        lines += ["| encoding | device, all | × | device, non-view | × |", "|---|---:|---:|---:|---:|"]
        lines += [f"| {r['pe']} | {r['device_all']} | {r['device_all_ratio']:.2f} | {r['device_non_view']} | "
                  f"{r['device_non_view_ratio']:.2f} |" for r in records]
        return "\n".join(lines)
    lines += [f"ViT-{records[0]['size'] if records else '?'}; one step: forward, cross entropy, backward, AdamW. "
              f"*device*: the step as a GPU runs it (fused AdamW, batched reductions, deferred coordinate check) -- "
              f"the proxy of an eager GPU step's kernel launches; *cpu*: as the CPU bench times it. "
              f"Ratios against {ref}.", "",
              "| encoding | device, all | × | device, non-view | × | cpu, all | × | cpu, non-view | × |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        lines.append(f"| {r['pe']} | {r['device_all']} | {r['device_all_ratio']:.2f} | {r['device_non_view']} | "
                     f"{r['device_non_view_ratio']:.2f} | {r['cpu_all']} | {r['cpu_all_ratio']:.2f} | "
                     f"{r['cpu_non_view']} | {r['cpu_non_view_ratio']:.2f} |")
    return "\n".join(lines)
