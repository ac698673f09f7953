"""``ropekit bench --ops``: ATen operations per ViT training step, the proxy of an eager GPU step's launches, held
for the folded encodings against axial RoPE.

The target is a folded encoding within +15 % of axial's count in the device form. Not reached yet (this version:
Cayley 1.40, Circulant 1.43, ComRoPE-LD 2.81 with its paper's sharing, per layer and head;
docs/bench/folded-ops.md): Cayley and Circulant pay their learned frequencies' gradients (as RoPE-Mixed, which is
not folded, at 1.23) and Cayley its prefix transform, per layer (the merge of the bases into the projections is one
batched product per step); ComRoPE-LD pays its block Schur form (six batched Jacobi sweeps, ~600 operations per
step, the price of a step without host synchronisation) and, per layer, the outer products of its rotation's
backward. Its layers' Schur forms come from one batched Jacobi solve and their gradients from one batched Frechet
map per step (``blocks.batch_block_gradients``, each layer keeping its own generators; 3.55x axial when each layer
computed and mapped its own). The bounds below hold what this version reaches (with a little room), so that a
change that adds operations fails here.
"""

from __future__ import annotations

import pytest

from ropekit.bench.ops import count_step_ops, format_op_counts, step_op_counts

#: device-form ratio to axial (all operations) this version holds; the target is 1.15
HELD = {"mixed": 1.26, "cayley": 1.44, "circulant": 1.47, "comrope-ld": 2.86}


@pytest.fixture(scope="module")
def records():
    return {r["pe"]: r for r in step_op_counts(list(HELD), size="tiny", batch=2, image_size=8, forms=("device",))}


@pytest.mark.slow
def test_counts_are_sane(records):
    ax = records["axial"]
    assert 300 < ax["device_all"] < 2000 and ax["device_non_view"] < ax["device_all"]
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
