"""Resolution scaling of commuting encodings, acting on their RoPE form.

Every commuting encoding is RoPE in a basis: ``R(r)^T R(s) = P^T RoPE_freqs(s - r) P`` with pair ``n`` turning by
``theta_n(r) = sum_k r_k freqs[k, n]`` (``PositionEncoding.rope_form``). The methods that language and vision
models use to run a RoPE model at a longer context or a larger image act on those frequencies only, so here they
apply to *learned* spectra too (RoPE-Mixed, Cayley, Circulant, ComRoPE, general STRING): each method is a factor
``gamma[k, n]`` per axis ``k`` and pair ``n``, ``freqs' = gamma * freqs``, computed from the (detached) frequencies.

``s_k`` is the scale along axis ``k``: the test extent over the training extent, in coordinate units (with grid
coordinates, 14 patches at training and 24 at test give ``s = 24 / 14``; with normalised coordinates the extent is 1
whatever the resolution, and ``s = 1``). ``L_k`` is the training extent in coordinate units (14 above).

* position interpolation (:func:`interpolation_factors`): ``gamma = 1 / s_k`` -- the same as ``r -> r / s``;
* NTK-aware (:func:`ntk_factors`): ``gamma = s_k ** (-t)``, ``t`` the position of the pair's wavelength
  ``2 pi / |freqs[k, n]|`` on a log scale between the axis's shortest (``t = 0``, kept) and longest (``t = 1``,
  interpolated) wavelength. For RoPE with base ``b`` on ``d/2`` pairs, ``t = 2n / (d - 2)``: raising the base to
  ``b * s ** (d / (d - 2))``, the NTK-aware rule, exactly;
* YaRN (:func:`yarn_factors`): ``rho = L_k / wavelength``, the turns a pair makes across the training extent;
  ``gamma = 1`` where ``rho > beta``, ``1 / s_k`` where ``rho < alpha``, linear in ``rho`` between
  (``gamma = ramp + (1 - ramp) / s``); with the attention factor ``0.1 ln s + 1`` on q and k
  (:func:`yarn_attention_factor`, logits times its square), ``s`` the ratio of token counts ``prod_k s_k``;
* low-frequency cap (:func:`cap_factors`, after RIFLEx): a pair that did not complete a turn across the training
  extent (wavelength ``>= L_k``) but would across the test extent ``s_k L_k`` is slowed to
  ``|freq| = margin * 2 pi / (s_k L_k)``, so it still does not wrap.

:class:`ResolutionScaling` names one method with its parameters; :func:`scale_frequencies` applies it to a
frequency tensor; :class:`ScaledEncoding` wraps an encoding (its RoPE form with scaled frequencies, differentiable
in the wrapped encoding's parameters, so it serves at evaluation and in fine-tuning); :func:`apply_resolution_scaling`
wraps every encoding of a model in place. Coordinate augmentation in training (shift, jitter, rescale) acts on the
coordinates: :mod:`ropekit.coords.augment`.

Shape legend: ``Hp`` heads owning parameters, ``c`` coordinate dimension, ``P = d / 2`` pairs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from .ops.angles import wide_dtype
from .base import PositionEncoding
from .ops.forms import RoPEForm
from .ops.products import basis_change
from .ops.rotation import apply_frequency_rope

__all__ = ["SCALING_METHODS", "ResolutionScaling", "interpolation_factors", "ntk_factors", "yarn_factors",
           "cap_factors", "yarn_attention_factor", "scaling_factors", "scale_frequencies", "ScaledEncoding",
           "apply_resolution_scaling", "remove_resolution_scaling"]

SCALING_METHODS = ("none", "pi", "ntk", "yarn", "cap")

Scale = Union[float, Sequence[float], Tensor]


def _per_axis(value: Scale, freqs: Tensor, what: str) -> Tensor:
    """``value`` as ``(c, 1)`` in float64 on ``freqs``' device (a scalar is the same for every axis)."""
    c = freqs.shape[-2]
    t = torch.as_tensor(value, dtype=torch.float64, device=freqs.device).reshape(-1)
    if t.numel() == 1:
        t = t.expand(c)
    if t.numel() != c:
        raise ValueError(f"{what} needs 1 or {c} values (one per axis), got {t.numel()}")
    if not bool(torch.isfinite(t).all()) or bool((t <= 0).any()):
        raise ValueError(f"{what} must be finite and positive, got {t.tolist()}")
    return t.to(wide_dtype(freqs.device)).unsqueeze(-1)  # (c, 1)


def _magnitudes(freqs: Tensor) -> Tensor:
    if freqs.dim() < 2:
        raise ValueError(f"freqs must be (..., c, d/2), got {tuple(freqs.shape)}")
    if not bool(torch.isfinite(freqs).all()):
        raise ValueError("freqs must be finite")
    return freqs.detach().to(wide_dtype(freqs.device)).abs()


def interpolation_factors(freqs: Tensor, scale: Scale) -> Tensor:
    """Position interpolation: ``gamma[k, n] = 1 / s_k`` (``r -> r / s``).

    Args:
        freqs: ``(..., c, P)``.
        scale: ``s`` (one number, or one per axis).

    Returns:
        ``(..., c, P)`` float64 (float32 where the device has no float64).
    """
    w = _magnitudes(freqs)
    return (1.0 / _per_axis(scale, freqs, "scale")).expand_as(w).clone()


def ntk_factors(freqs: Tensor, scale: Scale) -> Tensor:
    """NTK-aware scaling by wavelength: ``gamma[k, n] = s_k ** (-t[k, n])`` with
    ``t = log(w_max / |w|) / log(w_max / w_min)`` over the non-zero ``|freqs[..., k, :]|`` of each axis (and head).

    The fastest pair of an axis is kept, the slowest interpolated by ``1 / s``; an axis with one distinct non-zero
    frequency is kept. Zero frequencies get 1 (they never turn).

    Args:
        freqs: ``(..., c, P)``.
        scale: ``s``, one number or one per axis.

    Returns:
        ``(..., c, P)`` float64.
    """
    w = _magnitudes(freqs)
    s = _per_axis(scale, freqs, "scale")
    nz = w > 0
    w_max = w.amax(dim=-1, keepdim=True)
    w_min = torch.where(nz, w, torch.full_like(w, math.inf)).amin(dim=-1, keepdim=True)
    span = torch.log(w_max / w_min)  # (..., c, 1); 0 (or NaN for an all-zero axis) where nothing to spread
    usable = torch.isfinite(span) & (span > 0)
    t = torch.where(nz & usable, torch.log(w_max / torch.where(nz, w, w_max)) / torch.where(usable, span, 1.0),
                    torch.zeros_like(w))
    return torch.exp(-t * torch.log(s))


def yarn_factors(freqs: Tensor, scale: Scale, train_extent: Scale, alpha: float = 1.0, beta: float = 32.0) -> Tensor:
    """YaRN's per-pair ramp: ``rho = L_k |freqs[k, n]| / (2 pi)``, ``ramp = clip((rho - alpha) / (beta - alpha), 0, 1)``,
    ``gamma = ramp + (1 - ramp) / s_k``.

    Args:
        freqs: ``(..., c, P)``.
        scale: ``s``, one number or one per axis.
        train_extent: ``L``, the training extent in coordinate units, one number or one per axis.
        alpha, beta: the ramp's ends in turns across ``L`` (``0 <= alpha < beta``; YaRN's 1-D defaults 1 and 32).

    Returns:
        ``(..., c, P)`` float64.
    """
    if not (0.0 <= alpha < beta) or not math.isfinite(beta):
        raise ValueError(f"yarn needs 0 <= alpha < beta < inf, got alpha={alpha}, beta={beta}")
    w = _magnitudes(freqs)
    s = _per_axis(scale, freqs, "scale")
    rho = _per_axis(train_extent, freqs, "train_extent") * w / (2 * math.pi)
    ramp = ((rho - alpha) / (beta - alpha)).clamp(0.0, 1.0)
    return ramp + (1.0 - ramp) / s


def cap_factors(freqs: Tensor, scale: Scale, train_extent: Scale, margin: float = 0.9) -> Tensor:
    """Low-frequency cap (after RIFLEx): a pair with ``2 pi / L' < |w| <= 2 pi / L`` (no full turn across the
    training extent ``L``, one across the test extent ``L' = s L``) is slowed to ``|w'| = margin * 2 pi / L'``;
    other pairs are kept. Only ``s > 1`` caps anything.

    Args:
        freqs: ``(..., c, P)``.
        scale: ``s``, one number or one per axis.
        train_extent: ``L`` in coordinate units, one number or one per axis.
        margin: in ``(0, 1]``; RIFLEx uses 0.9 (a little less than one turn across ``L'``).

    Returns:
        ``(..., c, P)`` float64.
    """
    if not 0.0 < margin <= 1.0:
        raise ValueError(f"cap margin must be in (0, 1], got {margin}")
    w = _magnitudes(freqs)
    lo = _per_axis(train_extent, freqs, "train_extent")
    hi = lo * _per_axis(scale, freqs, "scale")
    target = margin * 2 * math.pi / hi  # (c, 1)
    capped = (w > target) & (w * lo <= 2 * math.pi) & (hi > lo)
    return torch.where(capped, target / torch.where(capped, w, torch.ones_like(w)), torch.ones_like(w))


def yarn_attention_factor(scale: Scale) -> float:
    """YaRN's factor on q and k, ``0.1 ln s + 1`` with ``s = prod_k s_k`` (the ratio of token counts; logits are
    multiplied by its square); 1 for ``s <= 1``."""
    t = torch.as_tensor(scale, dtype=torch.float64).reshape(-1)
    if t.numel() == 0 or not bool(torch.isfinite(t).all()) or bool((t <= 0).any()):
        raise ValueError(f"scale must be finite and positive, got {t.tolist()}")
    s = float(t.prod())
    return 0.1 * math.log(s) + 1.0 if s > 1.0 else 1.0


@dataclass(frozen=True)
class ResolutionScaling:
    """One resolution-scaling method and its parameters (see the module docstring).

    Attributes:
        method: ``"none"``, ``"pi"`` (position interpolation), ``"ntk"``, ``"yarn"`` or ``"cap"``.
        scale: ``s``, test extent over training extent; one number or one per axis.
        train_extent: ``L`` in coordinate units (``"yarn"`` and ``"cap"``; e.g. the training grid in patches).
        alpha, beta: YaRN's ramp.
        attention_factor: the factor on q and k; ``None``: YaRN's ``0.1 ln s + 1`` for ``"yarn"``, 1 otherwise.
        margin: the cap's margin.
    """

    method: str = "none"
    scale: Any = 1.0
    train_extent: Any = None
    alpha: float = 1.0
    beta: float = 32.0
    attention_factor: Optional[float] = None
    margin: float = 0.9

    def __post_init__(self) -> None:
        if self.method not in SCALING_METHODS:
            raise ValueError(f"unknown scaling method {self.method!r}; known: {', '.join(SCALING_METHODS)}")
        if self.method in ("yarn", "cap") and self.train_extent is None:
            raise ValueError(f"scaling method {self.method!r} needs train_extent (the training extent in "
                             f"coordinate units)")
        if self.attention_factor is not None and not (math.isfinite(self.attention_factor)
                                                      and self.attention_factor > 0):
            raise ValueError(f"attention_factor must be finite and positive, got {self.attention_factor}")

    def to_dict(self) -> dict:
        """The fields as JSON values (what ``ViTConfig.resolution_scaling`` records); ``from_dict`` reads it."""
        def plain(v: Any) -> Any:
            if isinstance(v, Tensor):
                v = v.tolist()
            return [float(x) for x in v] if isinstance(v, (list, tuple)) else (None if v is None else float(v))

        return {"method": self.method, "scale": plain(self.scale), "train_extent": plain(self.train_extent),
                "alpha": float(self.alpha), "beta": float(self.beta),
                "attention_factor": plain(self.attention_factor), "margin": float(self.margin)}

    @classmethod
    def from_dict(cls, d: Any, *, source: str = "resolution_scaling") -> "ResolutionScaling":
        """Build from a mapping of the fields (``to_dict``'s; missing ones at their defaults).

        Raises:
            ValueError: not a mapping, an unknown field or a bad value (one line, prefixed by ``source``).
        """
        if not isinstance(d, dict):
            raise ValueError(f"{source} must be a mapping of ResolutionScaling fields, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{source}: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        try:
            return cls(**d)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from None

    def factor(self) -> float:
        """The factor on q and k (logits times its square)."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        return yarn_attention_factor(self.scale) if self.method == "yarn" else 1.0


def scaling_factors(freqs: Tensor, scaling: ResolutionScaling) -> Tensor:
    """``gamma`` ``(..., c, P)`` (float64) of ``scaling`` for ``freqs`` ``(..., c, P)``."""
    m = scaling.method
    if m == "none":
        return torch.ones_like(_magnitudes(freqs))
    if m == "pi":
        return interpolation_factors(freqs, scaling.scale)
    if m == "ntk":
        return ntk_factors(freqs, scaling.scale)
    if m == "yarn":
        return yarn_factors(freqs, scaling.scale, scaling.train_extent, scaling.alpha, scaling.beta)
    return cap_factors(freqs, scaling.scale, scaling.train_extent, scaling.margin)


def scale_frequencies(freqs: Tensor, scaling: ResolutionScaling) -> Tensor:
    """``freqs * gamma`` in ``freqs``' dtype: differentiable in ``freqs`` (``gamma`` is computed from their detached
    values, a constant of the step)."""
    return freqs * scaling_factors(freqs, scaling).to(freqs.dtype)


class _ScaledState(NamedTuple):
    form: RoPEForm  # the scaled form, basis without the attention factor
    factor: float
    coords: Tensor


def _drop_inner_prefix(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    inner = prefix + "inner."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner):]] = state_dict.pop(key)


def _add_inner_prefix(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    inner = prefix + "inner."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)


class ScaledEncoding(PositionEncoding):
    """A commuting encoding with its RoPE form's frequencies scaled (``name="scaled"``).

    ``R'(r) = a * R(0) P^T RoPE_{gamma freqs}(r) P`` (``a`` the attention factor): the wrapped encoding's rotation
    with scaled frequencies; with ``ResolutionScaling("none")`` its logits are the wrapped encoding's. Prefix tokens
    are transformed as the wrapped encoding transforms them (times ``a``). Differentiable in the wrapped encoding's
    parameters (through ``rope_form(basis_gradient=True)``: for ComRoPE the eigenbasis derivative, which exists where
    a block's frequencies are distinct), so a model can be fine-tuned with the scaling in place. ``ropekit.nn``'s
    attention folds it as any commuting encoding (the factor ``a`` goes into the merged basis).

    Args:
        pe: a commuting encoding (``pe.rope_kind`` is not ``None``).
        scaling: a :class:`ResolutionScaling`.

    Raises:
        ValueError: ``pe`` has no RoPE form.
    """

    name = "scaled"
    label = "scaled"
    rope_kind = "scaled"
    _native_half_pairs = True

    def __init__(self, pe: PositionEncoding, scaling: ResolutionScaling) -> None:
        if not isinstance(pe, PositionEncoding) or pe.rope_kind is None or not pe.is_rotation:
            raise ValueError(f"resolution scaling needs a commuting encoding, got "
                             f"{getattr(pe, 'name', type(pe).__name__)}")
        if not isinstance(scaling, ResolutionScaling):
            raise ValueError(f"scaling must be a ResolutionScaling, got {type(scaling).__name__}")
        super().__init__(pe.head_dim, pe.coord_dim, pe.num_heads, pe.per_head, layout=pe.layout, pairs=pe.pairs)
        self.backend = pe.backend
        self.inner = pe
        self.scaling = scaling
        # the state dict holds the wrapped encoding's tensors under its own names: a scaled model's checkpoint
        # loads into the unscaled model and back (the scaling is a transform, it has no tensors of its own)
        self.register_state_dict_post_hook(_drop_inner_prefix)
        self.register_load_state_dict_pre_hook(_add_inner_prefix)

    def param_dtype(self) -> torch.dtype:
        """The wrapped encoding's parameter dtype."""
        return self.inner.param_dtype()

    def reset_parameters(self) -> None:
        self.inner.reset_parameters()

    def no_weight_decay(self) -> set:
        return {f"inner.{n}" for n in self.inner.no_weight_decay()}

    def scaled_form(self) -> Tuple[RoPEForm, float]:
        """The wrapped encoding's RoPE form with scaled frequencies (no ``eigen``), and the attention factor."""
        form = self.inner.rope_form(basis_gradient=True)
        return RoPEForm(form.basis, scale_frequencies(form.freqs, self.scaling), form.prefix, form.pairs,
                        blocks=form.blocks), self.scaling.factor()

    def rope_form(self, basis_gradient: bool = False) -> RoPEForm:
        """:meth:`scaled_form` with the attention factor merged into the basis (``a P``; ``a I`` for the RoPE
        family when ``a != 1``), as folding merges it into the q/k projection."""
        form, a = self.scaled_form()
        if a == 1.0:
            return form
        if form.basis is None:
            d = self.head_dim
            basis = a * torch.eye(d, dtype=form.freqs.dtype if form.freqs.is_floating_point() else torch.float32,
                                  device=form.freqs.device).to(self.param_dtype()).unsqueeze(0)
            return form._replace(basis=basis)
        return form._replace(basis=a * form.basis, blocks=None if form.blocks is None else a * form.blocks)

    def generators(self) -> Tensor:
        raise NotImplementedError("a scaled encoding has a RoPE form, not generators of its own")

    def _prepare(self, coords: Tensor, dtype: torch.dtype) -> _ScaledState:
        form, a = self.scaled_form()
        return _ScaledState(form, a, coords)

    def _encode(self, x: Tensor, data: _ScaledState, num_prefix_tokens: int, dtype: torch.dtype) -> Tensor:
        form, a, coords = data
        with torch.autocast(device_type=x.device.type, enabled=False):
            return self._encode_wide(x, form, a, coords, num_prefix_tokens, dtype)

    @staticmethod
    def _encode_wide(x: Tensor, form: RoPEForm, a: float, coords: Tensor, num_prefix_tokens: int,
                     dtype: torch.dtype) -> Tensor:
        y = x.to(dtype)
        if form.basis is not None:
            y = basis_change(y, form.basis.to(dtype))  # (B, H, N, d)
        if a != 1.0:
            y = y * a
        if num_prefix_tokens and form.prefix is not None:
            p0 = num_prefix_tokens
            y = torch.cat([basis_change(y[:, :, :p0], form.prefix.to(dtype)), y[:, :, p0:]], dim=2)
        f = form.freqs[0] if form.freqs.shape[0] == 1 else form.freqs  # (c, P) or (H, c, P)
        y, _ = apply_frequency_rope(y, None, coords, f, num_prefix_tokens=num_prefix_tokens, pairs=form.pairs,
                                    backend="torch")
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.scaling}"


def apply_resolution_scaling(model: nn.Module, scaling: ResolutionScaling) -> List[ScaledEncoding]:
    """Wrap every commuting encoding held by an attention layer of ``model`` (any module with a ``pe`` attribute
    holding a ``PositionEncoding``) in a :class:`ScaledEncoding`, in place; an encoding shared by several layers is
    wrapped once and stays shared. Already scaled encodings are re-wrapped around their inner encoding; encodings
    without a RoPE form (LieRE with ``c >= 2``, relaxed STRING, the tensor product) are left as they are.

    Returns:
        The wrappers, one per distinct encoding.
    """
    wrapped: dict = {}
    for m in model.modules():
        pe = getattr(m, "pe", None)
        if not isinstance(pe, PositionEncoding):
            continue
        inner = pe.inner if isinstance(pe, ScaledEncoding) else pe
        if inner.rope_kind is None or not inner.is_rotation:
            continue
        if id(inner) not in wrapped:
            wrapped[id(inner)] = ScaledEncoding(inner, scaling)
        m.pe = wrapped[id(inner)]
    return list(wrapped.values())


def remove_resolution_scaling(model: nn.Module) -> None:
    """Undo :func:`apply_resolution_scaling`: every ``ScaledEncoding`` held by a layer is replaced by the encoding
    it wraps (in place)."""
    for m in model.modules():
        pe = getattr(m, "pe", None)
        if isinstance(pe, ScaledEncoding):
            m.pe = pe.inner
