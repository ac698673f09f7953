"""Rotary position encodings for N-dimensional coordinates, behind one interface (``create_pe``)."""

from .base import PEState, PositionEncoding, check_coords
from .functional import apply_frequency_rope
from .cayley import CayleySTRING
from .circulant import CirculantSTRING
from .comrope import ComRoPEAP, ComRoPELD
from .liere import LieRE
from .counting import count_parameters
from .registry import PAPER_PRESETS, PE_REGISTRY, create_pe, list_pes, pe_options
from .relaxed import RelaxedSTRING
from .rope import AxialRoPE, FrequencyRoPE, LieRECommute, MixedRoPE, NoPE
from .string import GeneralSTRING
from .tensor import TensorSTRING
from .validation import check_deferred_coords, set_coord_validation

__all__ = [
    "PositionEncoding", "PEState", "check_coords", "check_deferred_coords", "set_coord_validation",
    "apply_frequency_rope", "create_pe", "list_pes", "pe_options",
    "PE_REGISTRY", "PAPER_PRESETS", "count_parameters",
    "NoPE", "FrequencyRoPE", "AxialRoPE", "MixedRoPE", "LieRECommute", "CayleySTRING", "CirculantSTRING",
    "TensorSTRING", "GeneralSTRING", "LieRE", "ComRoPEAP", "ComRoPELD", "RelaxedSTRING",
]
