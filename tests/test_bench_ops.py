"""``ropekit bench --ops``: ATen operations per ViT training step, the proxy of an eager GPU step's launches, held
for the folded encodings against axial RoPE.

The target is a folded encoding within +15 % of axial's count in the device form. This version (docs/bench/
folded-ops.md): axial 663 operations, RoPE-Mixed 1.05, Circulant 1.13, Cayley 1.14, ComRoPE-LD 2.54 (its paper's
sharing, per layer and head). Every layer rotates q and k as one tensor by an angle table that the model forms for
all its layers in one product, and the learned frequencies of all layers get their gradient from one node; what
remains per layer is the reduction of that angle gradient (RoPE-Mixed, Cayley, Circulant), and for ComRoPE-LD the
outer products of its rotation's backward. Per step: the stacked merge of the bases into the q/k projections
(the biases a last column of the weights) and its backward (Circulant 34 operations, Cayley 40), Cayley's gather,
solve and hand-written backward (11), and ComRoPE's block Schur form -- six batched block Jacobi sweeps, 696
operations, the price of a step without host synchronisation -- and its batched Frechet map (111). The bounds below hold what this version reaches (with a little room), so that a
change that adds operations fails here; axial's own count is held too, since the ratios alone would let every
encoding grow together.
"""

from __future__ import annotations

import pytest

from ropekit.bench.ops import count_step_ops, format_op_counts, step_op_counts

#: device-form ratio to axial (all operations) this version holds; the target is 1.15. Exactness on every CPU
#: raised two: Cayley's backward reuses the forward's LU factors (``lu_factor_ex``/``lu_solve``, 759 -> 763
#: operations), and ComRoPE-LD's Schur forms end with three Newton steps that converge by construction (1688 ->
#: 1929); bringing those back down is open work (docs/performance.md).
HELD = {"mixed": 1.07, "cayley": 1.16, "circulant": 1.13, "comrope-ld": 2.95}
#: device-form operations of axial's step (all) this version holds
HELD_AXIAL = 680


@pytest.fixture(scope="module")
def records():
    return {r["pe"]: r for r in step_op_counts(list(HELD), size="tiny", batch=2, image_size=8, forms=("device",))}


@pytest.mark.slow
def test_counts_are_sane(records):
    ax = records["axial"]
    assert 300 < ax["device_all"] <= HELD_AXIAL and ax["device_non_view"] < ax["device_all"]
    assert ax["device_all_ratio"] == 1.0


def test_the_device_form_drops_the_cpu_loops():
    """The CPU's per-parameter AdamW and per-example loops are left out of the device form; both forms reported."""
    (r,) = step_op_counts([], size="tiny", batch=2, image_size=8)
    assert r["device_all"] < r["cpu_all"] and r["device_non_view"] < r["cpu_non_view"]
    assert "cpu, non-view" in format_op_counts([r])


@pytest.mark.slow
@pytest.mark.parametrize("pe", sorted(HELD))
def test_folded_encodings_hold_their_operation_count(records, pe):
    assert records[pe]["device_all_ratio"] <= HELD[pe], format_op_counts(list(records.values()))


def test_counts_do_not_depend_on_the_batch():
    """Device-form counts are per step, not per example (what makes them a launch proxy)."""
    a = step_op_counts([], size="tiny", batch=2, image_size=8, reference="cayley", forms=("device",))
    b = step_op_counts([], size="tiny", batch=3, image_size=12, reference="cayley", forms=("device",))
    assert [r["device_all"] for r in a] == [r["device_all"] for r in b]


def test_count_step_ops_counts_top_level_operations():
    import torch

    x = torch.randn(3, 4)
    counts = count_step_ops(lambda: (x.t() @ x).sum())
    assert counts == {"all": 3, "non_view": 2}  # t (a view), mm, sum
