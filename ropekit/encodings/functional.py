"""The functional core of the rotary encodings in one namespace: pure functions on tensors, no modules, no state.

Each function lives in the module of its concept and is re-exported here:

* :mod:`ropekit.encodings.ops.angles`: angles ``theta = r . freqs`` and their cos/sin tables (``frequency_angles``,
  ``rope_cos_sin``);
* :mod:`ropekit.encodings.ops.products`: products with a basis that stay float32-accurate under TF32
  (``basis_change``, ``precise_matmul``);
* :mod:`ropekit.encodings.ops.rotation`: the rotation of pairs and the per-token rotation of frequency RoPE with its
  execution paths (``rotate_pairs``, ``rotate_angles``, ``apply_frequency_rope``, ``BACKENDS``,
  ``check_backend``); the pair layout is described there;
* :mod:`ropekit.encodings.ops.frequencies`: initial frequencies and pairwise generators (``pair_generators``,
  ``axial_frequencies``, ``mixed_frequencies``);
* :mod:`ropekit.encodings.ops.skew`: skew matrices (``skew``, ``cayley_transform``, ``skew_real_schur``);
* :mod:`ropekit.encodings.ops.blocks`: block-diagonal operators and block exponentials (``block_apply``,
  ``scaled_block_exp_matrices``, ``scaled_block_exp_apply``, ``scaled_block_exp_reference``,
  ``rotate_in_block_eigenbasis``).

Shape legend used throughout ``ropekit.encodings``:

* ``B`` batch, ``H`` heads, ``M`` tokens that carry a coordinate, ``d`` head dimension (even),
  ``P = d / 2`` rotation planes ("pairs"), ``c`` coordinate dimension;
* ``Hp`` heads that own parameters: 1 when an encoding is shared by all heads, ``H`` when per head;
* ``nb = d / b`` blocks of size ``b`` for block-diagonal encodings.
"""

from __future__ import annotations

from .ops.angles import frequency_angles, rope_cos_sin
from .ops.blocks import (block_apply, rotate_in_block_eigenbasis, scaled_block_exp_apply, scaled_block_exp_matrices,
                     scaled_block_exp_reference)
from .ops.frequencies import axial_frequencies, mixed_frequencies, pair_generators
from .ops.products import basis_change, precise_matmul
from .ops.rotation import BACKENDS, apply_frequency_rope, check_backend, rotate_angles, rotate_pairs
from .ops.skew import cayley_transform, skew, skew_real_schur

__all__ = [
    "BACKENDS",
    "check_backend",
    "frequency_angles",
    "rope_cos_sin",
    "rotate_angles",
    "apply_frequency_rope",
    "rotate_pairs",
    "pair_generators",
    "axial_frequencies",
    "mixed_frequencies",
    "skew",
    "cayley_transform",
    "basis_change",
    "precise_matmul",
    "block_apply",
    "skew_real_schur",
    "scaled_block_exp_matrices",
    "scaled_block_exp_apply",
    "scaled_block_exp_reference",
    "rotate_in_block_eigenbasis",
]
