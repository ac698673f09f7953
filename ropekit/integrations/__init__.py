"""Adapters that bring ropekit encodings to other libraries' models.

Each adapter lives in its own module and imports its library lazily, so ``import ropekit`` never needs it:

* :mod:`ropekit.integrations.timm` -- ``apply_pe(model, name, ...)`` turns a timm ``VisionTransformer`` or
  ``Eva`` into one whose attention applies any ``create_pe`` encoding (``pip install ropekit[timm]``).
"""

__all__: list = []
