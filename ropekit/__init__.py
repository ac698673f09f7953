"""ropekit: learnable N-dimensional rotary position encodings for transformers."""

from .encodings import PositionEncoding, create_pe, list_pes, pe_options

__version__ = "0.1.0"

__all__ = ["PositionEncoding", "create_pe", "list_pes", "pe_options", "__version__"]
