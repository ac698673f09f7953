"""What the integrations share."""

from __future__ import annotations

from typing import Dict, List

from torch import nn

from ..encodings import PositionEncoding

__all__ = ["encodings"]


def encodings(model: nn.Module) -> List[PositionEncoding]:
    """The distinct encoding modules of a converted model (one with ``sharing="model"``)."""
    seen: Dict[int, PositionEncoding] = {}
    for m in model.modules():
        if isinstance(m, PositionEncoding) and id(m) not in seen:
            seen[id(m)] = m
    return list(seen.values())
