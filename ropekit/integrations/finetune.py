"""Fine-tuning a 2-D checkpoint into an RGB-D model with a 3-D encoding, starting from the same function.

The functions live in :mod:`ropekit.nn.finetune` (model to model, torch only) and :mod:`ropekit.train.finetune`
(from a run folder or checkpoint; training's ``init_from`` uses them); this is their public name.
"""

from ..train.finetune import init_3d_from_2d, init_3d_from_checkpoint, init_from_checkpoint, load_source_model, \
    logits_match

__all__ = ["init_3d_from_2d", "init_3d_from_checkpoint", "init_from_checkpoint", "load_source_model", "logits_match"]
