"""Fused GPU kernels (Triton) of ropekit's per-token work.

* :func:`fused_rotary` -- rotate q and k by the angles ``coords . freqs`` (every commuting encoding reduces to this
  rotation once its basis is folded into the projections), forward and backward, one launch for q and k;
* :func:`fused_basis_rotary` -- ``RoPE(theta) P x``: a learnt basis ``P`` and the rotation in one pass, for an
  encoding such as Cayley-STRING applied to every token (a user's own attention, where ``P`` cannot be folded);
* :func:`available` -- whether the kernel can run on a device (CUDA with Triton; the CPU only under Triton's
  interpreter, ``TRITON_INTERPRET=1``, for tests); :func:`unavailable_reason` says why not.

Both functions are differentiable twice: under ``create_graph`` their backward passes are recorded by autograd (the
rotation's as the same kernel by the negated angles, the basis rotation's as the same map in PyTorch operations),
so second derivatives are exact.

Importing this package does not import Triton; the kernels are compiled on first use.
"""

from .basis import basis_rotary_supported, fused_basis_rotary
from .rotary import available, compile_supported, fused_rotary, unavailable_reason

__all__ = ["available", "basis_rotary_supported", "compile_supported", "fused_basis_rotary", "fused_rotary",
           "unavailable_reason"]
