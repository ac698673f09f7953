"""``create_pe``: one factory for every position encoding, by name."""

from __future__ import annotations

import inspect
from typing import Any

from .base import PositionEncoding
from .cayley import CayleySTRING
from .circulant import CirculantSTRING
from .comrope import ComRoPEAP, ComRoPELD
from .liere import LieRE
from .relaxed import RelaxedSTRING
from .rope import AxialRoPE, LieRECommute, MixedRoPE, NoPE
from .string import GeneralSTRING
from .tensor import TensorSTRING

__all__ = ["PE_REGISTRY", "PAPER_PRESETS", "create_pe", "list_pes"]

#: options every encoding accepts (``PositionEncoding.set_conventions``): tensor layout, pair convention, backend
_CONVENTIONS = ("layout", "pairs", "backend")

PE_REGISTRY: dict[str, type[PositionEncoding]] = {
    "none": NoPE,
    "axial": AxialRoPE,
    "mixed": MixedRoPE,
    "cayley": CayleySTRING,
    "circulant": CirculantSTRING,
    "tensor": TensorSTRING,
    "string": GeneralSTRING,
    "liere": LieRE,
    "liere-commute": LieRECommute,
    "comrope-ap": ComRoPEAP,
    "comrope-ld": ComRoPELD,
    "relaxed": RelaxedSTRING,
}


# Encoding options as each encoding's paper trained it (``create_pe(..., preset="paper")``); the plain defaults
# are ropekit's and stay as they are. Sharing across layers is the model's choice (``ropekit.nn``), not listed.
PAPER_PRESETS: dict[str, dict[str, Any]] = {
    "none": {},
    "axial": {},  # VisionLlama / EVA: base 10000 (the defaults)
    "mixed": {"base": 10.0, "per_head": True},  # Heo et al.: theta = 10, frequencies per head (and per layer)
    "cayley": {},  # STRING: frequencies as RoPE-Mixed, S = 0, shared by heads (the defaults)
    "circulant": {"block_size": 16},  # STRING: block sizes 16-32 worked best
    "tensor": {},
    "string": {},
    "liere": {},  # Ostmeier et al.: dense d x d generators, raw parameters uniform in [0, 2 pi), shared (the defaults)
    "liere-commute": {},
    "comrope-ap": {"init": "normal", "init_std": 1.0, "per_head": True},  # Yu et al.: random bases per head
    "comrope-ld": {"init": "normal", "init_std": 1.0, "per_head": True},
    "relaxed": {},
}


def list_pes() -> list[str]:
    """Names accepted by ``create_pe``."""
    return list(PE_REGISTRY)


def pe_options(name: str) -> list[str]:
    """Keyword options accepted by the encoding ``name`` (besides head_dim, coord_dim, num_heads)."""
    cls = _lookup(name)
    params = inspect.signature(cls.__init__).parameters
    own = [p for p in params if p not in ("self", "head_dim", "coord_dim", "num_heads")]
    return own + [p for p in _CONVENTIONS if p not in own]


def _key(name: str) -> str:
    """The registry key of ``name`` (case and ``_`` / ``-`` insensitive)."""
    return name.lower().replace("_", "-") if isinstance(name, str) else name


def _lookup(name: str) -> type[PositionEncoding]:
    key = _key(name)
    if key not in PE_REGISTRY:
        raise ValueError(f"unknown position encoding {name!r}; known: {', '.join(PE_REGISTRY)}")
    return PE_REGISTRY[key]


def create_pe(name: str, *, head_dim: int, coord_dim: int, num_heads: int = 1, preset: str | None = None,
              **options: Any) -> PositionEncoding:
    """Build the position encoding ``name``.

    Args:
        name: one of ``none, axial, mixed, cayley, circulant, tensor, string, liere, liere-commute,
            comrope-ap, comrope-ld, relaxed``.
        head_dim: ``d``, even.
        coord_dim: ``c``, the number of coordinates per token (2 for images, 3 for RGB-D or video).
        num_heads: ``H``.
        **options: encoding options, e.g. ``per_head`` (parameters per head instead of shared by heads),
            ``block_size`` (circulant, liere, comrope-*), ``base`` (rotation base / frequency scale),
            ``init_scale`` (liere), ``init`` (comrope: "rope" or "zero"), ``exact`` and ``active_planes``
            (relaxed), ``band`` (cayley), ``num_features`` (tensor), ``learnable_freqs`` (axial); and for every
            encoding ``layout`` (``"bhnd"`` default, or ``"bnhd"``), ``pairs`` (``"interleaved"`` default, or
            ``"half"`` for HF / Llama ``rotate_half`` checkpoints) and ``backend`` (``"auto"`` default, ``"torch"``
            or ``"triton"``: the execution path of the fused rotation, see ``PositionEncoding.set_conventions``).
        preset: ``None`` (ropekit's defaults) or ``"paper"``: the options each encoding's paper trained with
            (``PAPER_PRESETS``; see docs/presets-encodings.md); explicit ``options`` override the preset.

    Raises:
        ValueError: unknown name, unknown option, or a configuration that does not fit the head dimension.
    """
    cls = _lookup(name)
    if preset not in (None, "paper"):
        raise ValueError(f"{name}: preset must be None or 'paper', got {preset!r}")
    if preset == "paper":
        options = {**PAPER_PRESETS[_key(name)], **options}
    allowed = pe_options(name)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"{name}: unknown option(s) {', '.join(unknown)}; accepted: {', '.join(allowed)}")
    conventions = {key: options.pop(key) for key in _CONVENTIONS if key in options}
    own = inspect.signature(cls.__init__).parameters
    passed = {key: value for key, value in conventions.items() if key in own}
    pe = cls(head_dim, coord_dim, num_heads, **options, **passed)
    return pe.set_conventions(**{key: value for key, value in conventions.items() if key not in own})
