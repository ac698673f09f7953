"""Rotary position encodings for N-dimensional coordinates, behind one interface (``create_pe``)."""

from .base import PEState, PositionEncoding, check_coords, keep_encodings_fp32
from .ops.rotation import apply_frequency_rope
from .registry import PAPER_PRESETS, PE_REGISTRY, BenchRow, create_pe, list_pes, pe_options, register_pe
# the encodings, imported in the order list_pes() gives them (each registers itself)
from .rope import AxialRoPE, FrequencyRoPE, MixedRoPE, NoPE
from .cayley import CayleySTRING
from .circulant import CirculantSTRING
from .tensor import TensorSTRING
from .string import GeneralSTRING
from .liere import LieRE, LieRECommute
from .comrope import ComRoPEAP, ComRoPELD
from .relaxed import RelaxedSTRING
from .counting import count_parameters
from .ops.validation import check_deferred_coords, set_coord_validation

__all__ = [
    "PositionEncoding", "PEState", "check_coords", "check_deferred_coords", "set_coord_validation",
    "keep_encodings_fp32",
    "apply_frequency_rope", "create_pe", "list_pes", "pe_options", "register_pe", "BenchRow",
    "PE_REGISTRY", "PAPER_PRESETS", "count_parameters",
    "NoPE", "FrequencyRoPE", "AxialRoPE", "MixedRoPE", "LieRECommute", "CayleySTRING", "CirculantSTRING",
    "TensorSTRING", "GeneralSTRING", "LieRE", "ComRoPEAP", "ComRoPELD", "RelaxedSTRING",
]
