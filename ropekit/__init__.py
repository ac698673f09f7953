"""ropekit: learnable N-dimensional rotary position encodings for transformers."""

from .encodings import PositionEncoding, create_pe, list_pes, pe_options
from . import kernels as _kernels  # (imports no Triton)
from .encodings.ops.rotation import register_kernels as _register_kernels

_register_kernels(_kernels)  # resolved once here, never while torch.compile traces

__version__ = "0.1.0"

__all__ = ["PositionEncoding", "create_pe", "list_pes", "pe_options", "__version__"]
