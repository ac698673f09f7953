"""Fitting ropekit into the ecosystem: other libraries' models, streaming, export.

Each module is imported on its own (``import ropekit`` imports none of them), so an optional dependency is needed
only by the module that uses it:

* :mod:`ropekit.integrations.timm` -- ``apply_pe(model, name, ...)`` turns a timm ``VisionTransformer`` or ``Eva``
  into one whose attention applies any ``create_pe`` encoding (``pip install ropekit[timm]``).
* :mod:`ropekit.integrations.transformers` -- ``apply_pe(model, name, ...)`` for Qwen2-VL, Qwen2.5-VL and Qwen3-VL
  (vision tower and multimodal RoPE), starting as the model's own function (``pip install ropekit[transformers]``).
* :mod:`ropekit.integrations.video_stream` -- ``VideoStream(model)``: a video ViT fed one tubelet at a time with a
  KV cache of encoded keys.

* :mod:`ropekit.integrations.export` -- ``export_onnx`` / ``export_program``: one folded export for every image
  size (``pip install ropekit[export]``).

Related: fine-tuning a 2-D checkpoint into RGB-D is :mod:`ropekit.train.finetune`, linear attention
:mod:`ropekit.nn.linear_attention`, canonical coordinates :mod:`ropekit.coords`, ONNX export of folded models
``docs/integrations/export.md``.
"""

__all__: list = []
