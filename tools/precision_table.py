"""Measure what casting an encoding's parameters costs, per encoding, at coordinates 1e2 and 1e4.

For every registered encoding (head_dim 16, 2 heads, 2-D coordinates, parameters moved off their initialisation by a
0.1 normal perturbation, as the tests do), the encoded q and k are compared with the float64 module holding the
original float32 parameters, on float64 copies of the same tokens: the largest entry error relative to the largest
entry, maximised over seeds and over coordinates drawn uniformly in ``[-r, r]^2``. Columns:

* ``bf16 params`` / ``fp16 params``: the module cast with ``.to(torch.bfloat16)`` / ``.half()`` (its parameters
  rounded), float32 tokens -- what the rounding of the parameters alone costs;
* ``fp32 kept, bf16 tokens``: ``keep_fp32()`` then ``.to(torch.bfloat16)``, bf16 tokens -- bf16's own rounding of
  the output (``2^-8``), nothing from the encoding.

Usage: ``python tools/precision_table.py [--seeds 5]`` prints a markdown table (docs/execution-paths.md holds its
output).
"""

from __future__ import annotations

import argparse
import copy

import torch

from ropekit import create_pe, list_pes

D, H, C, M = 16, 2, 2, 16
SIZES = {"liere": {"block_size": 8}, "comrope-ap": {"block_size": 4}, "comrope-ld": {"block_size": 4},
         "circulant": {"block_size": 8}}
SCALES = (1e2, 1e4)


def _pe(name: str, seed: int):
    torch.manual_seed(seed)
    base, opts = (("axial", {"learnable_freqs": True}) if name == "axial (learnable)" else
                  (name, dict(SIZES.get(name, {}))))
    pe = create_pe(base, head_dim=D, coord_dim=C, num_heads=H, **opts)
    with torch.no_grad():
        for p in pe.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return pe


def _error(name: str, mode: str, r: float, seed: int) -> float:
    pe = _pe(name, seed)
    ref = copy.deepcopy(pe).double()
    g = torch.Generator().manual_seed(1000 + seed)
    q = torch.randn(1, H, M, D, generator=g, dtype=torch.float64)
    k = torch.randn(1, H, M, D, generator=g, dtype=torch.float64)
    coords = ((torch.rand(M, C, generator=g, dtype=torch.float64) * 2 - 1) * r).float()  # given in float32 to both
    if mode == "bf16 params":
        low, tokens = copy.deepcopy(pe).to(torch.bfloat16), torch.float32
    elif mode == "fp16 params":
        low, tokens = copy.deepcopy(pe).half(), torch.float32
    else:
        low, tokens = copy.deepcopy(pe).keep_fp32().to(torch.bfloat16), torch.bfloat16
    q, k = q.to(tokens), k.to(tokens)  # (the reference takes the same, already rounded, tokens)
    with torch.no_grad():
        got = low(q, k, coords)
        want = ref(q.double(), k.double(), coords.double())
    return max(float((a.double() - b).abs().max() / b.abs().max()) for a, b in zip(got, want))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5, help="parameter and coordinate draws per cell (max taken)")
    args = parser.parse_args()
    modes = ("bf16 params", "fp16 params", "fp32 kept, bf16 tokens")
    head = " | ".join(f"{m}, r = {r:.0e}" for m in modes for r in SCALES)
    print(f"| encoding | {head} |")
    print("|---|" + "---|" * (len(modes) * len(SCALES)))
    for name in [*list_pes()[:2], "axial (learnable)", *list_pes()[2:]]:
        cells = [max(_error(name, m, r, s) for s in range(args.seeds)) for m in modes for r in SCALES]
        print(f"| {name} | " + " | ".join(f"{e:.1e}" for e in cells) + " |")


if __name__ == "__main__":
    main()
