"""The mathematics the encodings are built from: pure functions on tensors, no modules, no parameters.

Each module holds one concept; the encoding classes (one file each in :mod:`ropekit.encodings`), their execution
(:mod:`ropekit.encodings.prepared`, :mod:`ropekit.encodings.fold`) and the model-level tools (scaling, parameter
counts) import from here, never the other way round -- a module here imports only torch and other modules here
(and, in :mod:`~ropekit.encodings.ops.rotation`, :mod:`ropekit.kernels` to register the fused kernels).

* :mod:`~ropekit.encodings.ops.angles` -- angles ``theta = r . freqs``, their cos/sin tables, the rotation of pairs;
* :mod:`~ropekit.encodings.ops.rotation` -- the per-token rotation of frequency RoPE and its execution paths
  (PyTorch or the fused kernel);
* :mod:`~ropekit.encodings.ops.blocks` -- block-diagonal operators and block exponentials;
* :mod:`~ropekit.encodings.ops.expm` -- exponentials of skew matrices that stay orthogonal;
* :mod:`~ropekit.encodings.ops.skew` -- skew matrices, the Cayley transform, the real Schur form;
* :mod:`~ropekit.encodings.ops.forms` -- the RoPE form record and the pieces encodings build it from;
* :mod:`~ropekit.encodings.ops.frequencies` -- initial frequencies and pairwise generators;
* :mod:`~ropekit.encodings.ops.products` -- products with a basis that stay float32-accurate under TF32;
* :mod:`~ropekit.encodings.ops.validation` -- the finiteness check of coordinates.

The public functions of these modules are gathered in one namespace, :mod:`ropekit.encodings.functional`.
"""
