"""Character vocabulary for CTC: text normalization, encoding, and greedy decoding to words."""

from __future__ import annotations

import re

import torch
from torch import Tensor

BLANK = 0
SPACE = 1

_BRACKETED = re.compile(r"\[[^\]]*\]|<[^>]*>|\([^)]*\)")
_SPACES = re.compile(r"\s+")


class CharacterVocabulary:
    """Output units of a character CTC model: blank (0), space (1), then ``characters``.

    Args:
        characters: the letters the model spells with. Transcripts are lower-cased; tokens in
            brackets (``[noise]``, ``<unk>``, ``(laughter)``) are removed; other characters not
            in the vocabulary are dropped.
    """

    def __init__(self, characters: str = "abcdefghijklmnopqrstuvwxyz'") -> None:
        if len(set(characters)) != len(characters) or any(c.isspace() for c in characters):
            raise ValueError(f"characters must be distinct and not whitespace: {characters!r}")
        self.characters = characters
        self._index = {c: i + 2 for i, c in enumerate(characters)}

    def __len__(self) -> int:
        return len(self.characters) + 2

    def normalize(self, text: str) -> str:
        """The form of ``text`` that the model is trained on and scored against."""
        text = _BRACKETED.sub(" ", text.lower())
        text = "".join(c if (c in self._index or c.isspace()) else "" for c in text)
        return _SPACES.sub(" ", text).strip()

    def encode(self, text: str) -> list[int]:
        """Ids of a normalized text (spaces included between words)."""
        return [SPACE if c == " " else self._index[c] for c in self.normalize(text)]

    def decode(self, ids: list[int]) -> str:
        """Text of a label sequence (no blanks, repeats already merged)."""
        chars = [" " if i == SPACE else self.characters[i - 2] for i in ids if i != BLANK]
        return _SPACES.sub(" ", "".join(chars)).strip()

    def greedy_decode(self, log_probs: Tensor, lengths: Tensor) -> list[str]:
        """Best-path CTC decoding of ``(batch, frames, units)`` scores to word strings.

        Takes the best unit per frame, merges repeats, then removes blanks.
        """
        best = log_probs.argmax(dim=-1).cpu()
        texts = []
        for row, length in zip(best, lengths.cpu().tolist()):
            path = row[:length]
            if path.numel():
                keep = torch.ones_like(path, dtype=torch.bool)
                keep[1:] = path[1:] != path[:-1]
                path = path[keep]
            texts.append(self.decode([int(i) for i in path if int(i) != BLANK]))
        return texts
