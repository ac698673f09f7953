"""Folding: every commuting STRING is RoPE in a learned basis, so in training and at inference it costs what
RoPE costs.

One name for the two halves: the mathematics, each encoding's RoPE form (:mod:`ropekit.encodings.fold`:
:func:`rope_form`, :func:`rope_forms`, :func:`rope_forms_stacked`, :func:`to_rope`, :class:`FoldedRoPE`,
:func:`fold_pe`, :func:`fold_qkv_weight`, :func:`fold_qkv_weights`, :func:`frequency_rope`,
:func:`frequency_rope_qk`), and :func:`fold`, which merges those bases into a model's attention layers
(:mod:`ropekit.nn.fold`).

>>> from ropekit.fold import fold
>>> folded = fold(model).eval()          # same logits, RoPE's cost                     # doctest: +SKIP
"""

from .encodings.fold import (BlockEigenForm, FoldedRoPE, RoPEForm, fold_pe, fold_qkv_weight, fold_qkv_weights,
                             foldable_kind, frequency_rope, frequency_rope_qk, is_foldable, rope_form, rope_forms,
                             rope_forms_stacked, to_rope, unstack_rope_form)
from .nn.fold import fold

__all__ = ["to_rope", "rope_form", "rope_forms", "rope_forms_stacked", "unstack_rope_form", "RoPEForm",
           "BlockEigenForm", "foldable_kind", "FoldedRoPE", "fold_pe", "fold", "is_foldable", "fold_qkv_weight",
           "fold_qkv_weights", "frequency_rope", "frequency_rope_qk"]
