"""``create_pe``: one factory for every position encoding, by name, and ``register_pe``, the decorator that puts an
encoding in it.

Everything about an encoding is declared on its class: ``@register_pe(name, label=..., paper_preset=...,
paper_sharing=..., bench_rows=..., ...)`` sets the class attributes, and the class itself says whether and how it
folds (``rope_kind``, ``rope_form``). The tables the rest of the package reads -- :data:`PAPER_PRESETS`,
``ropekit.nn.PAPER_SHARING``, the studies' labels, ``ropekit bench``'s rows -- are views of the registered
classes, so an encoding registered from outside the package appears in all of them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from .base import PositionEncoding

__all__ = ["PE_REGISTRY", "PAPER_PRESETS", "SHARINGS", "BenchRow", "RegistryView", "register_pe", "create_pe",
           "list_pes", "pe_options"]

#: options every encoding accepts (``PositionEncoding.set_conventions``): tensor layout, pair convention, backend
_CONVENTIONS = ("layout", "pairs", "backend")

#: How an encoding's parameters may be shared in a model: one set for the model, per layer, or per layer and head.
SHARINGS = ("model", "layer", "head")

#: Registered encodings by name, in registration order (what ``list_pes`` returns).
PE_REGISTRY: dict[str, type[PositionEncoding]] = {}

_PE = TypeVar("_PE", bound=type)


@dataclass(frozen=True)
class BenchRow:
    """One row an encoding adds to ``ropekit bench``'s encoding table.

    Attributes:
        label: the row's name in the table.
        options: ``create_pe`` options, as ``(name, value)`` pairs.
        kind: ``"pe"`` (the encoding itself), ``"folded"`` (its folded form, ``fold_pe``), ``"train"`` (its work in
            one attention layer's training step, folded as ``ropekit.nn.Attention`` does it) or ``"naive"`` (a
            reference form of ``ropekit.bench.baselines``).
        base: the label of the row this one is compared with (folded, train and naive rows).
        heavy: left out by ``--quick``.
    """

    label: str
    options: tuple[tuple[str, Any], ...] = ()
    kind: str = "pe"
    base: str | None = None
    heavy: bool = False


def register_pe(name: str, *, label: str | None = None, paper_preset: Mapping[str, Any] | None = None,
                paper_sharing: str = "model", bench_rows: tuple[BenchRow, ...] | None = None,
                bench_vit_options: Mapping[str, Any] | None = None,
                bench_vit_gpu: bool = False) -> Callable[[_PE], _PE]:
    """Class decorator: register a ``PositionEncoding`` subclass under ``name`` and declare everything about it.

    Args:
        name: the ``create_pe`` name (lower case, ``-`` between words); set as the class's ``name``.
        label: display name in tables and plots (default: ``name``).
        paper_preset: options as the encoding's paper trained it (``create_pe(..., preset="paper")``).
        paper_sharing: ``"model"``, ``"layer"`` or ``"head"``: how the paper shared the parameters across a
            model's layers and heads (``ropekit.nn``'s ``pe_sharing="auto"``).
        bench_rows: rows of ``ropekit bench``'s encoding table (default: one row of the encoding with its
            defaults, labelled ``name``).
        bench_vit_options: options of the encoding in the training-step table of ``ropekit bench``.
        bench_vit_gpu: whether the training-step table on a GPU has the encoding.

    Returns:
        The decorator; it returns the class unchanged but for these attributes.

    Raises:
        ValueError: a name already registered by another class, a class that is no ``PositionEncoding``, or an
            unknown ``paper_sharing``.
    """
    key = _key(name)
    if paper_sharing not in SHARINGS:
        raise ValueError(f"{name}: paper_sharing must be one of {', '.join(SHARINGS)}, got {paper_sharing!r}")

    def decorate(cls: _PE) -> _PE:
        if not (isinstance(cls, type) and issubclass(cls, PositionEncoding)):
            raise ValueError(f"register_pe({name!r}) decorates PositionEncoding subclasses, got {cls!r}")
        known = PE_REGISTRY.get(key)
        if known is not None and known.__qualname__ != cls.__qualname__:
            raise ValueError(f"position encoding {key!r} is already registered by {known.__qualname__}")
        cls.name = key
        cls.label = label or key
        cls.paper_preset = dict(paper_preset or {})
        cls.paper_sharing = paper_sharing
        cls.bench_rows = tuple(bench_rows) if bench_rows is not None else (BenchRow(key),)
        cls.bench_vit_options = dict(bench_vit_options or {})
        cls.bench_vit_gpu = bool(bench_vit_gpu)
        PE_REGISTRY[key] = cls
        return cls

    return decorate


class RegistryView(Mapping):
    """A read-only ``{name: getattr(cls, attribute)}`` view of the registered encodings, always current."""

    def __init__(self, attribute: str) -> None:
        self.attribute = attribute

    def __getitem__(self, name: str) -> Any:
        return getattr(PE_REGISTRY[name], self.attribute)

    def __iter__(self) -> Iterator[str]:
        return iter(list(PE_REGISTRY))

    def __len__(self) -> int:
        return len(PE_REGISTRY)

    def __repr__(self) -> str:
        return repr(dict(self))


#: Encoding options as each encoding's paper trained it (``create_pe(..., preset="paper")``; each class's
#: ``paper_preset``); the plain defaults are ropekit's and stay as they are. Sharing across layers is the model's
#: choice (``ropekit.nn.PAPER_SHARING``), not listed.
PAPER_PRESETS: Mapping[str, dict[str, Any]] = RegistryView("paper_preset")


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
        preset: ``None`` (ropekit's defaults) or ``"paper"``: the options the encoding's paper trained with (its
            class's ``paper_preset``; see docs/presets-encodings.md); explicit ``options`` override the preset.

    Raises:
        ValueError: unknown name, unknown option, or a configuration that does not fit the head dimension.
    """
    cls = _lookup(name)
    if preset not in (None, "paper"):
        raise ValueError(f"{name}: preset must be None or 'paper', got {preset!r}")
    if preset == "paper":
        options = {**cls.paper_preset, **options}
    allowed = pe_options(name)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"{name}: unknown option(s) {', '.join(unknown)}; accepted: {', '.join(allowed)}")
    conventions = {key: options.pop(key) for key in _CONVENTIONS if key in options}
    own = inspect.signature(cls.__init__).parameters
    passed = {key: value for key, value in conventions.items() if key in own}
    pe = cls(head_dim, coord_dim, num_heads, **options, **passed)
    return pe.set_conventions(**{key: value for key, value in conventions.items() if key not in own})
