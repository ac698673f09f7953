"""A word-level tokenizer over a closed vocabulary (the caption grammar's, :data:`ropekit.data.captioned.VOCABULARY`).

>>> tok = Tokenizer()                                   # the captioned-scenes vocabulary, 32 tokens of context
>>> ids = tok(["a big red 3", "the blue square is behind the red 3"])    # int64 (2, 32), 0 = <pad>
>>> tok.decode(ids[0])
'a big red 3'

Text is lower-cased and split on white space, with ``.`` and ``,`` as words of their own. Token 0 is ``<pad>``
(padding at the end, up to ``context_length``), token 1 is ``<unk>``, then the vocabulary in its order.

Errors, each one line: an empty query (nothing but white space) is a ``ValueError``; a word outside the
vocabulary is a ``ValueError`` naming it (``unknown="error"``, the default) or becomes ``<unk>``
(``unknown="unk"``); a text longer than ``context_length`` words is a ``ValueError`` (``truncate=False``, the
default) or is cut.
"""

from __future__ import annotations

import re
from typing import Dict, List, Sequence, Union

import torch
from torch import Tensor

__all__ = ["Tokenizer", "PAD", "UNK", "split_words"]

PAD, UNK = "<pad>", "<unk>"
_SPLIT = re.compile(r"[.,]|[^\s.,]+")

Text = Union[str, Sequence[str]]


def split_words(text: Text) -> List[str]:
    """``"The red 3." -> ["the", "red", "3", "."]``; a list of words is lower-cased and passed through."""
    if isinstance(text, str):
        return _SPLIT.findall(text.lower())
    return [str(w).lower() for w in text]


class Tokenizer:
    """Words to ids and back over a fixed vocabulary.

    Args:
        vocabulary: the known words (default: the captioned-scenes grammar's); ``<pad>`` and ``<unk>`` come first.
        context_length: ``L``, the length every encoded text is padded to.
        unknown: ``"error"`` (a word outside the vocabulary raises ``ValueError``) or ``"unk"`` (it becomes
            ``<unk>``).
        truncate: cut texts longer than ``L`` instead of raising ``ValueError``.
    """

    def __init__(self, vocabulary: Sequence[str] = (), context_length: int = 32, unknown: str = "error",
                 truncate: bool = False) -> None:
        if not vocabulary:
            from .captioned import VOCABULARY

            vocabulary = VOCABULARY
        if unknown not in ("error", "unk"):
            raise ValueError(f"unknown must be 'error' or 'unk', got {unknown!r}")
        if context_length < 1:
            raise ValueError(f"context_length must be >= 1, got {context_length}")
        words = [w.lower() for w in vocabulary]
        if len(set(words)) != len(words) or PAD in words or UNK in words:
            raise ValueError("vocabulary must hold distinct words, without <pad> and <unk>")
        self.words: List[str] = [PAD, UNK, *words]
        self.index: Dict[str, int] = {w: i for i, w in enumerate(self.words)}
        self.context_length, self.unknown, self.truncate = int(context_length), unknown, bool(truncate)

    pad_id = 0
    unk_id = 1

    @property
    def vocab_size(self) -> int:
        """Number of ids (the vocabulary plus ``<pad>`` and ``<unk>``)."""
        return len(self.words)

    def encode(self, text: Text) -> List[int]:
        """The ids of one text (without padding).

        Raises:
            ValueError: an empty text; an unknown word (``unknown="error"``); more than ``context_length`` words
                (``truncate=False``).
        """
        words = split_words(text)
        if not words:
            raise ValueError("empty text: a caption or query needs at least one word")
        ids = [self.index.get(w, self.unk_id) for w in words]
        if self.unknown == "error" and self.unk_id in ids:
            bad = [w for w, i in zip(words, ids) if i == self.unk_id]
            raise ValueError(f"unknown word(s) {', '.join(map(repr, dict.fromkeys(bad)))} in {' '.join(words)!r}; "
                             f"the vocabulary has {len(self.words) - 2} words, e.g. "
                             f"{', '.join(self.words[2:12])} (use unknown='unk' to map them to <unk>)")
        if len(ids) > self.context_length:
            if not self.truncate:
                raise ValueError(f"text of {len(ids)} words is longer than the context of {self.context_length}: "
                                 f"{' '.join(words)[:60]!r}... (raise context_length or use truncate=True)")
            ids = ids[: self.context_length]
        return ids

    def __call__(self, texts: Sequence[Text]) -> Tensor:
        """int64 ``(B, L)`` ids of ``B`` texts, each padded with ``<pad>`` (0) to ``L = context_length``."""
        if isinstance(texts, str):
            texts = [texts]
        out = torch.full((len(texts), self.context_length), self.pad_id, dtype=torch.long)
        for i, t in enumerate(texts):
            ids = self.encode(t)
            out[i, : len(ids)] = torch.as_tensor(ids)
        return out

    def decode(self, ids: Union[Tensor, Sequence[int]]) -> str:
        """The words of ``ids`` (``<pad>`` left out) joined by spaces."""
        return " ".join(self.words[int(i)] for i in (ids.tolist() if isinstance(ids, Tensor) else ids)
                        if int(i) != self.pad_id)

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, context_length={self.context_length}, "
                f"unknown={self.unknown!r})")
