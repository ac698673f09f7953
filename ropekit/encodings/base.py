"""The interface every position encoding implements, and the checks they all share.

Shape legend: ``B`` batch, ``H`` (``Hq``) query heads, ``Hk`` key heads (``Hk`` divides ``H``: grouped-query
attention), ``N`` tokens in the sequence, ``P0 = num_prefix_tokens`` prefix tokens (CLS, registers) at the
front of ``N``, ``M = N - P0`` tokens with coordinates, ``d`` head dimension, ``c`` coordinate dimension,
``Hp`` heads that own parameters (1 when shared by heads, else ``H``).

Coordinates are ``(M, c)`` when shared by the whole batch (an image grid) or ``(B, M, c)`` per example
(RGB-D patches, point clouds); with ``c = 1`` also ``(M,)`` positions or ``(B, M)`` position ids. Rotations
are computed in float32 (float64 when the input is float64) with autocast disabled, and the result is cast
back to the input dtype.

Two-step use: ``state = pe.prepare(coords)`` computes everything that depends on the parameters and the
coordinates but not on q/k (angles, cos/sin tables, bases, block exponentials); ``pe.apply(q, k, state)``
then costs only the per-token work. A model computes the state of a shared encoding once per forward pass
and hands it to every layer; ``pe(q, k, coords)`` is the one-call form of the two.

Conventions (constructor options of every encoding):

* ``layout="bhnd"`` (default): q and k are ``(B, H, N, d)``; ``"bnhd"``: ``(B, N, H, d)`` (flash-attn,
  torchtune). Outputs keep the input layout.
* ``pairs="interleaved"`` (default): rotation plane ``n`` is ``(x_2n, x_2n+1)``; ``"half"``: plane ``n`` is
  ``(x_n, x_{n + d/2})``, the ``rotate_half`` convention of HF transformers / Llama checkpoints. For an
  encoding that mixes planes (Cayley, LieRE, ...), ``"half"`` is the same encoding with its coordinates
  relabelled (``R' = S^T R S`` for the fixed permutation ``S`` taking one convention to the other).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from .ops.angles import wide_dtype
from .ops.forms import RoPEForm, no_rope_form
from .ops.rotation import check_backend
from .ops.validation import check_finite, check_real

__all__ = ["PositionEncoding", "PEState", "check_coords", "coord_precision", "keep_encodings_fp32", "normalize_coords",
           "LAYOUTS", "PAIRS"]

LAYOUTS = ("bhnd", "bnhd")
_LOW_FLOATS = (torch.float16, torch.bfloat16)
PAIRS = ("interleaved", "half")


def _autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """Disable autocast on ``device_type`` (a no-op context when it is not enabled: entering one costs time)."""
    enabled = torch.is_autocast_enabled(device_type)
    return torch.autocast(device_type=device_type, enabled=False) if enabled else contextlib.nullcontext()


def _cast(x: Tensor, dtype: torch.dtype) -> Tensor:
    return x if x.dtype == dtype else x.to(dtype)


def coord_precision(coords: Tensor, dtype: torch.dtype) -> Tensor:
    """Coordinates as an encoding's ``_prepare`` receives them: never rounded to a narrower dtype.

    Every encoding forms its angles (and generator sums) in float64 from these, so a coordinate keeps its own
    precision up to the angle: float64 and float32 coordinates pass as they are, bf16 / float16 ones are widened to
    ``dtype`` (exactly), integer ones become float64 (float32 on devices without float64), exact up to ``2^53``
    (``2^24``) -- rounded to a float32 compute dtype an int64 coordinate at ``2^24 + 1`` would turn by the wrong
    angle, and a float64 one near ``1e5`` would lose ~1e-3 of it. Costs what the cast to ``dtype`` cost before.

    Args:
        coords: ``(M, c)`` or ``(B, M, c)``, real dtype.
        dtype: the compute dtype (float32 or float64).
    """
    if coords.dtype in (torch.float32, torch.float64):
        return coords
    if coords.is_floating_point():
        return coords.to(dtype)
    return coords.to(wide_dtype(coords.device))


def _expected(num_tokens: Any, coord_dim: int, batch: Any) -> str:
    """Human-readable expected coordinate shape (built only when an error is raised: formatting a symbolic
    token count into a string would make ``torch.compile`` specialise on it)."""
    return f"({num_tokens}, {coord_dim}) or ({batch if batch is not None else 'B'}, {num_tokens}, {coord_dim})"


def check_coords(coords: Tensor, coord_dim: int, num_tokens: int | None, batch: int | None = None,
                 name: str = "coords") -> None:
    """Validate a coordinate tensor; raise ``ValueError`` naming the expected shape.

    Args:
        coords: ``(M, c)`` or ``(B, M, c)``, real dtype.
        coord_dim: expected ``c``.
        num_tokens: expected ``M`` (``None`` skips that check).
        batch: expected ``B`` for per-example coordinates (``None`` skips that check).
        name: what the errors call the tensor (``"coords"``, ``"k_coords"``).

    Raises:
        ValueError: wrong type, dtype, rank, coordinate dimension, token count or batch; or NaN / infinite
            values, naming their count (``"3 non-finite values (NaN or infinite) in coords ..."``).

    The finiteness check (``ropekit.encodings.ops.validation.check_finite``, shared by every execution path) reads
    the values at every call, so values written in place since an earlier call are seen too. On the CPU it raises
    at once; on an accelerator, and inside ``torch.compile``, it counts the bad entries on the device without a
    host synchronisation, and ``check_deferred_coords()`` raises this error later (the training engine calls it
    every ``log_every`` steps and before each checkpoint). ``set_coord_validation("eager" | "deferred" | "off")`` overrides that choice.
    """
    if not isinstance(coords, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape {_expected(num_tokens, coord_dim, batch)}, "
                         f"got {type(coords).__name__}")
    check_real(coords, name)
    if coords.dim() not in (2, 3):
        raise ValueError(f"{name} must have shape {_expected(num_tokens, coord_dim, batch)}, got {tuple(coords.shape)}")
    if coords.shape[-1] != coord_dim:
        raise ValueError(
            f"{name} have {coords.shape[-1]} coordinate dimensions but the encoding was built for "
            f"coord_dim={coord_dim}: expected shape {_expected(num_tokens, coord_dim, batch)}, "
            f"got {tuple(coords.shape)}"
        )
    if num_tokens is not None and coords.shape[-2] != num_tokens:
        raise ValueError(
            f"{name} hold {coords.shape[-2]} tokens but the input has {num_tokens} tokens after the prefix: "
            f"expected shape {_expected(num_tokens, coord_dim, batch)}, got {tuple(coords.shape)}"
        )
    if coords.dim() == 3 and batch is not None and coords.shape[0] != batch:
        raise ValueError(f"per-example {name} have batch {coords.shape[0]}, input has {batch}: "
                         f"expected {_expected(num_tokens, coord_dim, batch)}")
    check_finite(coords, name)


def normalize_coords(coords: Tensor, coord_dim: int, num_tokens: int | None = None,
                     batch: int | None = None) -> Tensor:
    """Bring 1-D position forms to ``(M, 1)`` / ``(B, M, 1)``; other shapes pass through unchanged.

    With ``coord_dim == 1``: ``(M,)`` positions become ``(M, 1)``; ``(B, M)`` position ids (HF's
    ``position_ids``) become ``(B, M, 1)``. A 2-D tensor whose last dimension is 1 is read as ``(M, 1)``
    unless ``num_tokens`` (the expected ``M``) says it is ``(B, 1)``.
    """
    if coord_dim != 1 or not isinstance(coords, Tensor):
        return coords
    if coords.dim() == 1:
        return coords.unsqueeze(-1)  # (M, 1)
    if coords.dim() == 2:
        if coords.shape[-1] != 1:
            return coords.unsqueeze(-1)  # (B, M) -> (B, M, 1)
        if num_tokens is not None and coords.shape[0] != num_tokens and num_tokens == 1 and (
                batch is None or coords.shape[0] == batch):
            return coords.unsqueeze(-1)  # (B, 1) position ids of one token per example
    return coords


def keep_encodings_fp32(module: nn.Module, enabled: bool = True) -> nn.Module:
    """:meth:`PositionEncoding.keep_fp32` on every position encoding inside ``module`` (a whole model): a later
    ``module.to(torch.bfloat16)`` or ``module.half()`` casts everything else and leaves the encodings in float32.

    Returns:
        ``module``.
    """
    for sub in module.modules():
        if isinstance(sub, PositionEncoding):
            sub.keep_fp32(enabled)
    return module


@dataclass
class PEState:
    """What ``PositionEncoding.prepare`` computed: reusable by every ``apply`` with the same coordinates.

    Attributes:
        q: the encoding's own precomputed data for the query coordinates (angles, cos/sin, bases, ...).
        k: the same for the key coordinates (the same object as ``q`` when no ``k_coords`` were given).
        num_prefix_tokens: leading tokens left unrotated.
        q_tokens, k_tokens: ``M`` of the query / key coordinates.
        q_batch, k_batch: ``B`` of per-example coordinates, ``None`` when shared by the batch.
        dtype: compute dtype (float32, or float64).
        separate_k: whether keys have coordinates of their own.
    """

    q: Any
    k: Any
    num_prefix_tokens: int
    q_tokens: int
    k_tokens: int
    q_batch: int | None
    k_batch: int | None
    dtype: torch.dtype
    separate_k: bool = False


class PositionEncoding(nn.Module):
    """Base class: a rotary (or rotary-like) position encoding applied to queries and keys.

    Subclasses implement two hooks:

    * ``_prepare(coords, dtype) -> data``: everything that depends on the coordinates and parameters only
      (angles, cos/sin tables, basis changes), computed once per coordinate set and shared by q and k; coords
      arrive as ``(M, c)`` or ``(B, M, c)``, autocast disabled, in their own precision (``coord_precision``:
      float32 or float64 as given, integers as float64; never rounded to the compute dtype ``dtype``, so form
      angles and generator sums in float64 -- ``angles.wide_angles`` -- not in ``coords.dtype``);
    * ``_transform(x, data) -> x``: the action on ``x`` of shape ``(B, H, M, d)`` in the compute dtype, with
      interleaved pairs. ``H`` may be smaller than ``num_heads`` (grouped keys) when parameters are shared by
      heads; the data broadcast over it.

    Class attributes describe the mathematics: ``commuting`` (relative: ``R(r)^T R(s) = R(0)^T R(s - r)``),
    ``post_rotation`` (``R(0) != I``), ``is_rotation`` (``False`` for the tensor-product encoding, which widens
    q and k instead), ``rope_kind`` (how ``rope_form`` writes the encoding as RoPE in a basis; ``None``: it has
    no RoPE form and is never folded). ``ropekit.encodings.registry.register_pe`` sets the rest: ``name``,
    ``label``, ``paper_preset``, ``paper_sharing``, ``bench_rows``, ``bench_vit_options``, ``bench_vit_gpu``.

    Where ``R(0) = P != I``, the rotation splits into the generator part ``R_STR(r) = expm(sum_k r_k L_k)``
    (``generators()``) and ``P`` (``post_rotation_matrix()``) on the side the encoding defines: relaxed STRING
    is ``R(r) = R_STR(r) P``; Cayley-STRING is ``R(r) = RoPE(r) P = P R_STR(r)`` (its generators are
    ``L_k = P^T J_k P``). Either way ``R(r)^T R(s)`` depends on ``s - r`` only for the commuting encodings.
    """

    name: str = "base"
    #: display name in tables and plots
    label: str = "base"
    #: options as the encoding's paper trained it (``create_pe(..., preset="paper")``)
    paper_preset: dict[str, Any] = {}
    #: parameter sharing as the paper trained it (``ropekit.nn``'s ``pe_sharing="auto"``): model, layer or head
    paper_sharing: str = "model"
    #: rows of ``ropekit bench``'s encoding table (``registry.BenchRow``)
    bench_rows: tuple = ()
    #: options in ``ropekit bench``'s training-step table
    bench_vit_options: dict[str, Any] = {}
    #: whether ``ropekit bench``'s training-step table on a GPU has the encoding
    bench_vit_gpu: bool = False
    commuting: bool = True
    post_rotation: bool = False
    is_rotation: bool = True
    #: how ``rope_form`` writes the encoding as RoPE in a basis: ``"rope"`` (already RoPE, ``P = I``), ``"post"``
    #: (RoPE followed by a learned rotation), ``"fixed"`` (a constant basis), ``"string"`` (a learned basis),
    #: ``"relaxed"`` (a post-rotation), ``"blocks"`` (one eigenbasis per skew block); ``None``: no RoPE form
    rope_kind: str | None = None
    #: the encoding handles ``pairs="half"`` itself (no permutation of q/k needed)
    _native_half_pairs: bool = False
    #: the parameter dtype policy (``keep_fp32``): ``False``, a model cast moves the encoding's parameters too
    _keep_fp32: bool = False

    def __init__(self, head_dim: int, coord_dim: int, num_heads: int = 1, per_head: bool = False, *,
                 layout: str = "bhnd", pairs: str = "interleaved") -> None:
        super().__init__()
        if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            raise ValueError(f"{self.name}: head_dim must be a positive even integer, got {head_dim!r}")
        if not isinstance(coord_dim, int) or coord_dim <= 0:
            raise ValueError(f"{self.name}: coord_dim must be a positive integer, got {coord_dim!r}")
        if not isinstance(num_heads, int) or num_heads <= 0:
            raise ValueError(f"{self.name}: num_heads must be a positive integer, got {num_heads!r}")
        self.head_dim = head_dim
        self.coord_dim = coord_dim
        self.num_heads = num_heads
        self.per_head = bool(per_head)
        self.param_heads = num_heads if per_head else 1
        self.layout = "bhnd"
        self.pairs = "interleaved"
        self.backend = "auto"
        self.set_conventions(layout=layout, pairs=pairs)

    def set_conventions(self, *, layout: str | None = None, pairs: str | None = None,
                        backend: str | None = None) -> "PositionEncoding":
        """Set the tensor layout (``"bhnd"`` / ``"bnhd"``), pair convention (``"interleaved"`` / ``"half"``) and
        execution path of the fused rotation (``backend``: ``"auto"``, ``"torch"`` or ``"triton"``).

        ``backend="auto"`` (the default) runs the fused Triton kernels of ``ropekit.kernels`` on CUDA where they
        work (warning once, with the reason, where they do not) and PyTorch operations elsewhere; ``"torch"`` always
        PyTorch operations; ``"triton"`` always the kernels, a ``ValueError`` saying why where they cannot run. It
        governs the encodings' own forward (RoPE family, Cayley, Circulant) and the folded path of
        ``ropekit.nn.Attention``; paths without a kernel (LieRE, relaxed and general STRING, the tensor product,
        ComRoPE applied per token) always run PyTorch operations.

        Returns ``self``. Raises ``ValueError`` for an unknown value.
        """
        if backend is not None:
            self.backend = check_backend(backend)
        if layout is not None:
            if layout not in LAYOUTS:
                raise ValueError(f"{self.name}: layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
            self.layout = layout
        if pairs is not None:
            if pairs not in PAIRS:
                raise ValueError(f"{self.name}: pairs must be one of {', '.join(PAIRS)}, got {pairs!r}")
            self.pairs = pairs
        return self

    def keep_fp32(self, enabled: bool = True) -> "PositionEncoding":
        """Keep the encoding's parameters and buffers in float32 (or wider) when the model is cast to bf16 / float16.

        With it, ``model.to(torch.bfloat16)``, ``model.half()`` and ``model.to(dtype=torch.float16)`` leave this
        encoding's floating-point tensors in float32 (float64 ones become float32: the cast asked for less),
        as norm layers often are kept; device moves and ``.double()`` act as usual. Without it (the default) the
        cast rounds learnable frequencies and bases to the low precision like every other parameter, and the
        rotation turns by those rounded values: at coordinate ``r`` an angle is off by up to ``r * |omega| * 2^-8``
        in bf16 (see docs/execution-paths.md for the figures per encoding). Fixed tables are exact either way.

        Autocast never touches the encoding (its angles and rotation run with autocast disabled), and FSDP's mixed
        precision casts parameters without a module cast: there, keep encodings in float32 by wrapping them in a
        unit of their own with a float32 policy (FSDP2 ``fully_shard(pe, mp_policy=...)``) or by listing the
        encoding class in FSDP1's ``MixedPrecision(_module_classes_to_ignore=...)``.

        Args:
            enabled: ``True`` to keep float32; ``False`` returns to the default. Enabling it also widens any bf16 /
                float16 tensor the encoding holds now to float32 (values as they are: a rounding already done
                is not undone).

        Returns:
            ``self``.
        """
        self._keep_fp32 = bool(enabled)
        if enabled:  # (through _apply: encodings with derived tables rebuild them there)
            self._apply(lambda t: t.float() if t.dtype in _LOW_FLOATS else t)
        return self

    @property
    def keeps_fp32(self) -> bool:
        """Whether :meth:`keep_fp32` is on."""
        return self._keep_fp32

    def _apply(self, fn, recurse=True):
        """``nn.Module._apply`` under the :meth:`keep_fp32` policy: a cast to bf16 / float16 leaves floating-point
        tensors in float32 (at cast time only; nothing per step)."""
        if self._keep_fp32:
            inner = fn

            def fn(t: Tensor) -> Tensor:  # noqa: F811 (the policy wraps the cast)
                out = inner(t)
                if out.dtype in _LOW_FLOATS and t.is_floating_point():
                    return out.float() if t.dtype in _LOW_FLOATS else t.to(device=out.device, dtype=torch.float32)
                return out

        return super()._apply(fn, recurse)

    # ------------------------------------------------------------------ hooks for subclasses
    def _prepare(self, coords: Tensor, dtype: torch.dtype) -> Any:
        raise NotImplementedError

    def _transform(self, x: Tensor, state: Any) -> Tensor:
        raise NotImplementedError

    def _transform_prefix(self, x: Tensor) -> Tensor:
        """Action on prefix tokens ``(B, H, P0, d)``: the identity for rotations."""
        return x

    @property
    def transforms_prefix(self) -> bool:
        """Whether the encoding acts on prefix tokens, i.e. overrides the identity of ``_transform_prefix``."""
        return type(self)._transform_prefix is not PositionEncoding._transform_prefix

    @property
    def out_dim(self) -> int:
        """Width of the encoded q and k (``head_dim`` except for the tensor-product encoding)."""
        return self.head_dim

    # ------------------------------------------------------------------ public API
    def prepare(self, coords: Tensor, num_prefix_tokens: int = 0, *, k_coords: Tensor | None = None,
                dtype: torch.dtype | None = None) -> PEState:
        """Precompute everything that does not depend on q and k.

        Args:
            coords: query coordinates ``(M, c)`` or ``(B, M, c)`` (``c = 1``: also ``(M,)`` or ``(B, M)``).
            num_prefix_tokens: leading tokens of q and k left unrotated (CLS, registers).
            k_coords: key coordinates when keys sit elsewhere than queries (KV cache, cross attention);
                ``None``: keys use ``coords``.
            dtype: compute dtype; ``None``: float64 if the coordinates or parameters are float64, else float32.

        Returns:
            A ``PEState`` for ``apply`` / ``apply_one``, valid as long as the parameters do not change
            (differentiable: gradients reach the parameters and coordinates through it).

        Raises:
            ValueError: on a shape, dtype or non-finite coordinate problem.
        """
        if not isinstance(num_prefix_tokens, int) or num_prefix_tokens < 0:
            raise ValueError(f"num_prefix_tokens must be a non-negative int, got {num_prefix_tokens!r}")
        coords = normalize_coords(coords, self.coord_dim)
        check_coords(coords, self.coord_dim, None)
        if k_coords is not None:
            k_coords = normalize_coords(k_coords, self.coord_dim)
            check_coords(k_coords, self.coord_dim, None, name="k_coords")
        return self._prepare_checked(coords, num_prefix_tokens, k_coords, dtype)

    def _prepare_checked(self, coords: Tensor, num_prefix_tokens: int, k_coords: Tensor | None,
                         dtype: torch.dtype | None) -> PEState:
        """``prepare`` after validation (``forward`` validates against q/k itself and skips a second check)."""
        if dtype is None:
            wide = coords.dtype == torch.float64 or self.param_dtype() == torch.float64
            dtype = torch.float64 if wide else torch.float32
        elif dtype not in (torch.float32, torch.float64):
            raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
        with _autocast_off(coords.device.type):
            q_data = self._prepare(coord_precision(coords, dtype), dtype)
            k_data = q_data if k_coords is None else self._prepare(coord_precision(k_coords, dtype), dtype)
        kc = coords if k_coords is None else k_coords
        return PEState(q=q_data, k=k_data, num_prefix_tokens=num_prefix_tokens, q_tokens=coords.shape[-2],
                       k_tokens=kc.shape[-2], q_batch=coords.shape[0] if coords.dim() == 3 else None,
                       k_batch=kc.shape[0] if kc.dim() == 3 else None, dtype=dtype, separate_k=k_coords is not None)

    def apply(self, q: Tensor, k: Tensor | None, state: PEState) -> tuple[Tensor, Tensor | None]:
        """Encode queries and keys with a prepared state.

        Args:
            q: ``(B, H, Nq, d)`` (``(B, Nq, H, d)`` with ``layout="bnhd"``).
            k: ``(B, Hk, Nk, d)`` with ``Hk`` dividing ``H`` (fewer key heads only when the parameters are shared
                by heads), or ``None``.
            state: from ``prepare``.

        Returns:
            ``(q, k)`` in the input layout and dtype, last dimension ``out_dim`` (``k`` is ``None`` if given so).

        Raises:
            ValueError: shapes that do not match the encoding or the state.
        """
        q_out = self.apply_one(q, state, role="q")
        return q_out, (None if k is None else self.apply_one(k, state, role="k"))

    def apply_one(self, x: Tensor, state: PEState, role: str = "q") -> Tensor:
        """Encode one tensor with a prepared state: ``role="q"`` uses the query coordinates, ``"k"`` the keys'.

        Args:
            x: ``(B, H, N, d)`` (``(B, N, H, d)`` with ``layout="bnhd"``).
            state: from ``prepare``.
            role: ``"q"`` or ``"k"``.

        Returns:
            ``x`` encoded, same layout and dtype, last dimension ``out_dim``.
        """
        xb = self._checked_bhnd(x, state, role)
        out = self._encode(xb, state.q if role == "q" else state.k, state.num_prefix_tokens, state.dtype)
        return self._from_bhnd(out)

    def _checked_bhnd(self, x: Tensor, state: PEState, role: str) -> Tensor:
        """Validate ``x`` against the encoding and a prepared state; return its ``(B, H, N, d)`` view."""
        if role not in ("q", "k"):
            raise ValueError(f"role must be 'q' or 'k', got {role!r}")
        if not isinstance(state, PEState):
            raise ValueError(f"state must come from {self.name}.prepare(...), got {type(state).__name__}")
        xb = self._to_bhnd(x, "q" if role == "q" else "k")
        self._check_heads(xb, role)
        tokens = state.q_tokens if role == "q" else state.k_tokens
        batch = state.q_batch if role == "q" else state.k_batch
        p0 = state.num_prefix_tokens
        if xb.shape[-2] - p0 != tokens:
            raise ValueError(
                f"{role} has {xb.shape[-2]} tokens, {p0} prefix tokens and {tokens} coordinates: expected "
                f"{tokens + p0} tokens (give k_coords when keys sit elsewhere than queries)")
        if batch is not None and batch != xb.shape[0]:
            raise ValueError(f"per-example coords have batch {batch}, {role} has batch {xb.shape[0]}")
        return xb

    def forward(self, q: Tensor, k: Tensor, coords: Tensor, num_prefix_tokens: int = 0,
                k_coords: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Encode queries and keys: ``prepare`` and ``apply`` in one call.

        Args:
            q: ``(B, H, Nq, d)`` (``(B, Nq, H, d)`` with ``layout="bnhd"``).
            k: ``(B, Hk, Nk, d)``, ``Hk`` dividing ``H``.
            coords: ``(Mq, c)`` or ``(B, Mq, c)`` with ``Mq = Nq - num_prefix_tokens``.
            num_prefix_tokens: leading tokens left unrotated (CLS, registers).
            k_coords: ``(Mk, c)`` or ``(B, Mk, c)`` key coordinates; required when ``Nk != Nq``.

        Returns:
            ``(q, k)`` of the input layout, last dimension ``out_dim``, in the input dtype.

        Raises:
            ValueError: on a shape, dtype or non-finite coordinate problem, or q and k of different lengths
                with only one coordinate set.
        """
        qb, kb = self._to_bhnd(q, "q"), self._to_bhnd(k, "k")
        self._check_heads(qb, "q")
        self._check_heads(kb, "k")
        if qb.shape[-2] != kb.shape[-2] and k_coords is None:
            raise ValueError(
                f"q has {qb.shape[-2]} tokens and k has {kb.shape[-2]}: pass k_coords for the keys (KV cache, "
                f"cross attention) -- one coordinate set cannot encode both")
        if not isinstance(num_prefix_tokens, int) or num_prefix_tokens < 0 or num_prefix_tokens > qb.shape[-2]:
            raise ValueError(f"num_prefix_tokens must be an int in [0, {qb.shape[-2]}], got {num_prefix_tokens!r}")
        coords = normalize_coords(coords, self.coord_dim, qb.shape[-2] - num_prefix_tokens, qb.shape[0])
        check_coords(coords, self.coord_dim, qb.shape[-2] - num_prefix_tokens, qb.shape[0])
        if k_coords is not None:
            k_coords = normalize_coords(k_coords, self.coord_dim, kb.shape[-2] - num_prefix_tokens, kb.shape[0])
            check_coords(k_coords, self.coord_dim, kb.shape[-2] - num_prefix_tokens, kb.shape[0], "k_coords")
        state = self._prepare_checked(coords, num_prefix_tokens, k_coords, self._compute_dtype(q))
        return self.apply(q, k, state)

    def rotate(self, x: Tensor, coords: Tensor, num_prefix_tokens: int = 0) -> Tensor:
        """Encode one tensor ``x`` of shape ``(B, H, N, d)`` (separability: KV caches, linear attention)."""
        xb = self._to_bhnd(x, "x")
        self._check_heads(xb, "q")
        if not isinstance(num_prefix_tokens, int) or num_prefix_tokens < 0 or num_prefix_tokens > xb.shape[-2]:
            raise ValueError(f"num_prefix_tokens must be an int in [0, {xb.shape[-2]}], got {num_prefix_tokens!r}")
        coords = normalize_coords(coords, self.coord_dim, xb.shape[-2] - num_prefix_tokens, xb.shape[0])
        check_coords(coords, self.coord_dim, xb.shape[-2] - num_prefix_tokens, xb.shape[0])
        state = self._prepare_checked(coords, num_prefix_tokens, None, self._compute_dtype(x))
        return self.apply_one(x, state, role="q")

    def matrix(self, coords: Tensor) -> Tensor:
        """The explicit matrices ``R(r)``: ``(H, M, d, d)`` for ``(M, c)`` coords, ``(B, H, M, d, d)`` per example.

        Built by applying the encoding to the basis vectors, so it is exactly what ``rotate`` does (pair
        convention included; the layout option does not matter here).
        For tests and diagnostics; not available for the tensor-product encoding.
        """
        if not self.is_rotation:
            raise NotImplementedError(f"{self.name} is not a rotation: it has no matrix R(r)")
        d, h = self.head_dim, self.num_heads
        coords = normalize_coords(coords, self.coord_dim)
        if coords.dim() == 3:
            return torch.stack([self.matrix(c) for c in coords])
        check_coords(coords, self.coord_dim, coords.shape[-2] if coords.dim() >= 2 else -1)
        m = coords.shape[0]
        dtype = torch.float64 if self.param_dtype() == torch.float64 else torch.float32
        eye = torch.eye(d, dtype=dtype, device=coords.device)
        basis = eye[:, None, None, :].expand(d, h, m, d)  # (d, H, M, d): batch j holds e_j at every token
        state = self.prepare(coords, dtype=dtype)
        cols = self._encode(basis, state.q, 0, state.dtype)  # (d, H, M, d): cols[j] = R e_j
        return cols.permute(1, 2, 3, 0)  # (H, M, d, d), [..., :, j] = R e_j

    def rope_form(self, basis_gradient: bool = False) -> RoPEForm:
        """The encoding as RoPE in a basis, ``R(r)^T R(s) = P^T RoPE_freqs(s - r) P``, differentiably in its
        parameters (see ``ropekit.encodings.ops.forms.RoPEForm``); encodings with a ``rope_kind`` implement it.

        Args:
            basis_gradient: for block encodings (``rope_kind == "blocks"``) whose eigenbasis has no derivative
                where frequencies coincide: ``False`` (training, folding) gives a form whose gradient goes through
                the block exponentials instead (exact everywhere); ``True`` (``to_rope``) differentiates the
                eigenbasis itself. Other encodings ignore it.

        Raises:
            ValueError: for an encoding that does not commute or is not a rotation.
        """
        raise no_rope_form(self)

    def rope_batch_key(self) -> tuple | None:
        """Encodings whose keys are equal (and not ``None``) can have their RoPE forms computed together, stacked,
        by their class's :meth:`stacked_rope_form` (``fold.rope_forms``: the per-layer encodings of a model).
        ``None`` (the default): this encoding's form is computed on its own."""
        return None

    @classmethod
    def stacked_rope_form(cls, pes: Sequence["PositionEncoding"], prefix: bool = True) -> RoPEForm:
        """The RoPE forms of ``L`` encodings with one :meth:`rope_batch_key` (of this class), computed together:
        every tensor of the :class:`RoPEForm` carries a leading dimension, ``L``, or 1 where it is the same for all
        (``basis`` and ``prefix`` ``(L | 1, Hp, d, d)`` or ``None``, ``freqs`` ``(L, Hp, c, d/2)``); slice ``l`` is
        ``pes[l].rope_form()``. ``prefix=False``: no prefix token will be transformed, the prefix transform is
        left out (``None``). Implemented by the classes whose :meth:`rope_batch_key` is not ``None``."""
        raise NotImplementedError(f"{cls.__name__} has no stacked RoPE form")

    def to_rope(self) -> tuple[Tensor, Tensor]:
        """``(P, freqs)`` with ``R(r)^T R(s) = P^T RoPE_freqs(s - r) P`` for a commuting encoding.

        Returns:
            ``P`` ``(H, d, d)`` orthogonal and ``freqs`` ``(H, c, d/2)`` (pair ``n`` of ``P x`` turns by
            ``sum_k r_k freqs[k, n]``, as in ``rotation.rotate_pairs``), in the encoding's dtype,
            differentiable in its parameters (``rope_form(basis_gradient=True)`` with the heads expanded; detach
            them to keep a snapshot). For block encodings (comrope, one-coordinate LieRE) ``P`` is the eigenbasis
            of the skew blocks, whose derivative exists only where the frequencies of a block are distinct and
            non-zero; training goes through ``rope_form()`` (what ``ropekit.nn.Attention`` does), exact there too.

        Raises:
            ValueError: for an encoding that does not commute (LieRE with ``c >= 2`` and blocks > 2, relaxed STRING
                in its relaxed configuration) or is not a rotation (the tensor-product encoding).
        """
        form = self.rope_form(basis_gradient=True)
        freqs = form.freqs.to(self.param_dtype())
        p = form.basis
        if p is None:
            p = torch.eye(self.head_dim, dtype=freqs.dtype, device=freqs.device).unsqueeze(0)
            if form.pairs == "half":  # half-split pairs: the permutation to interleaved ones
                d = self.head_dim
                p = p[..., torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)]).to(p.device)]
        return p.expand(self.num_heads, -1, -1), freqs.expand(self.num_heads, -1, -1)

    def generators(self) -> Tensor:
        """The generators ``L_k`` with ``R_STR(r) = expm(sum_k r_k L_k)``: ``(H, c, d, d)`` (interleaved pairs)."""
        raise NotImplementedError(f"{self.name} has no generators")

    def post_rotation_matrix(self) -> Tensor | None:
        """``P = R(0)`` (``(H, d, d)``, orthogonal), or ``None`` if ``P = I``.

        Relaxed STRING: ``R(r) = R_STR(r) P``; Cayley-STRING: ``R(r) = P R_STR(r)`` (see the class docstring).
        """
        return None

    @property
    def active_dim(self) -> int:
        """Dimensions the generators act on (relaxed STRING: ``2m``; all others ``d``)."""
        return self.head_dim

    def no_weight_decay(self) -> set[str]:
        """Names (relative to this module) of learnable parameters to exclude from weight decay."""
        return {name for name, p in self.named_parameters() if p.requires_grad}

    def reset_parameters(self) -> None:
        """Re-initialise parameters and derived buffers exactly as the constructor does (same random draws).

        Makes ``with torch.device("meta"): pe = create_pe(...)``, ``pe.to_empty(device=...)``,
        ``pe.reset_parameters()`` equal to an eager build with the same seed. Subclasses with state define
        ``_init_weights()`` (called by their constructor too); an encoding without any needs nothing.

        Raises:
            NotImplementedError: if the encoding holds tensors but defines no ``_init_weights``.
        """
        init = getattr(self, "_init_weights", None)
        if init is None:
            if any(True for _ in self.parameters()) or any(True for _ in self.buffers()):
                raise NotImplementedError(f"{type(self).__name__} cannot re-initialise its tensors")
            return
        with torch.no_grad():
            init()

    def num_effective_parameters(self) -> int:
        """Learnable numbers that reach the encoding (LieRE stores entries its generators never use)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def extra_repr(self) -> str:
        extra = "" if (self.layout, self.pairs) == ("bhnd", "interleaved") else \
            f", layout={self.layout!r}, pairs={self.pairs!r}"
        return (f"head_dim={self.head_dim}, coord_dim={self.coord_dim}, num_heads={self.num_heads}, "
                f"per_head={self.per_head}" + extra)

    # ------------------------------------------------------------------ internals
    def param_dtype(self) -> torch.dtype:
        """The dtype of the encoding's parameters (the first parameter's; else the first floating buffer's; else
        float32): float64 here gives a float64 prepared state, and a folded copy (``fold``) is built in it."""
        for p in self.parameters():
            return p.dtype
        for b in self.buffers():
            if b.is_floating_point():
                return b.dtype
        return torch.float32

    def _to_bhnd(self, x: Tensor, what: str) -> Tensor:
        """Validate rank and dtype; return the ``(B, H, N, d)`` view of ``x`` for the configured layout."""
        if not isinstance(x, Tensor) or x.dim() != 4:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            form = "(B, N, H, d)" if self.layout == "bnhd" else "(B, H, N, d)"
            raise ValueError(f"{what} must have shape {form} with H={self.num_heads}, d={self.head_dim}"
                             f" (layout={self.layout!r}), got {shape}")
        if not x.is_floating_point():
            raise ValueError(f"{what} must be floating point, got {x.dtype}")
        return x.transpose(1, 2) if self.layout == "bnhd" else x

    def _from_bhnd(self, x: Tensor) -> Tensor:
        return x.transpose(1, 2) if self.layout == "bnhd" else x

    def _check_heads(self, x: Tensor, role: str) -> None:
        """``x`` is ``(B, H, N, d)``: queries need ``num_heads`` heads; keys may have fewer (dividing it) when the
        parameters are shared by heads."""
        h = x.shape[1]
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"{role} has shape {tuple(x.shape)} (as (B, H, N, d)); {self.name} was built for "
                             f"(B, H={self.num_heads}, N, d={self.head_dim})")
        if h == self.num_heads:
            return
        if role == "k" and h > 0 and self.num_heads % h == 0:
            if self.param_heads != 1:
                raise ValueError(
                    f"{self.name} has parameters per head ({self.num_heads} heads) but k has {h} heads: grouped "
                    f"keys need an encoding shared by heads (per_head=False)")
            return
        raise ValueError(f"{role} has shape {tuple(x.shape)} (as (B, H, N, d)); {self.name} was built for "
                         f"(B, H={self.num_heads}, N, d={self.head_dim})"
                         + (" (keys may have a number of heads dividing it)" if role == "k" else ""))

    def _compute_dtype(self, x: Tensor) -> torch.dtype:
        return torch.float64 if x.dtype == torch.float64 else torch.float32

    def _half_to_interleaved(self, x: Tensor) -> Tensor:
        """``(..., d)`` half-split pairs ``(x_n, x_{n+d/2})`` -> interleaved ``(x_2n, x_2n+1)``."""
        return x.unflatten(-1, (2, -1)).transpose(-1, -2).flatten(-2)

    def _interleaved_to_half(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)

    def _transform_any(self, x: Tensor, data: Any) -> Tensor:
        """``_transform`` in the configured pair convention (a permutation around it unless handled natively)."""
        if self.pairs == "interleaved" or self._native_half_pairs:
            return self._transform(x, data)
        y = self._transform(self._half_to_interleaved(x), data)
        return self._interleaved_to_half(y) if self.is_rotation else y

    def _encode(self, x: Tensor, data: Any, num_prefix_tokens: int, dtype: torch.dtype) -> Tensor:
        """Encode ``x`` ``(B, H, N, d)`` with one coordinate set's data; prefix tokens pass through."""
        with _autocast_off(x.device.type):
            if num_prefix_tokens == 0:
                return _cast(self._transform_any(_cast(x, dtype), data), x.dtype)
            prefix, rest = x[:, :, :num_prefix_tokens], x[:, :, num_prefix_tokens:]
            out = torch.cat([self._transform_prefix(_cast(prefix, dtype)),
                             self._transform_any(_cast(rest, dtype), data)], dim=2)
            return _cast(out, x.dtype)
