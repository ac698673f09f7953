"""Image-text models: captioned RGB-D scenes, a text tower and SigLIP contrastive training (the retrieval task).

>>> from ropekit.multimodal import RetrievalConfig, train_retrieval                        # doctest: +SKIP
>>> from ropekit.classification import TrainConfig
>>> cfg = RetrievalConfig(TrainConfig.from_dict({"data.name": "captioned-scenes", "model.pe": "cayley",
...                                                 "optim.epochs": 4, "run.out": "runs/retrieval"}))
>>> train_retrieval(cfg).final["mean_recall"]

The data are :mod:`ropekit.data.captioned`, the tokenizer :mod:`ropekit.data.text`, the text tower
:class:`ropekit.nn.TextTransformer`; this package holds the loss, the recall metric, the dual encoder
(:mod:`ropekit.multimodal.retrieval`), the depth hard negatives (:mod:`ropekit.multimodal.hard_negatives`) and
the task of ``ropekit train --task retrieval``
(:mod:`ropekit.multimodal.train`).
"""

from .hard_negatives import depth_hard_negative_accuracy, depth_relation_share, flip_depth_relation
from .retrieval import RECALL_KS, DualEncoder, recall_ranks, retrieval_recall, siglip_loss
from .train import (RetrievalConfig, RetrievalOptions, RetrievalResult, RetrievalTask, build_retrieval_task,
                    load_retrieval_run, train_retrieval)

__all__ = ["siglip_loss", "retrieval_recall", "recall_ranks", "DualEncoder", "RECALL_KS", "RetrievalConfig",
           "RetrievalOptions", "RetrievalTask", "RetrievalResult", "build_retrieval_task", "train_retrieval",
           "load_retrieval_run", "flip_depth_relation", "depth_relation_share", "depth_hard_negative_accuracy"]
