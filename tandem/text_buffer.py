"""TextBuffer: text grown piece by piece, at the cost of each piece.

`text += piece` on a str held by an object copies the whole text every time: O(length) a token
for the detokenizer's text, a step for a server stream's. A StringIO appends in place, and a
reader that wants only the new part reads only that (`between`).
"""
from __future__ import annotations

import io


class TextBuffer:
    def __init__(self, text: str = ""):
        self._io = io.StringIO(newline="")  # (no newline translation: the text as it came)
        self.length = self._io.write(text)  # characters

    @property
    def text(self) -> str:
        """The whole text (a copy)."""
        return self._io.getvalue()

    def append(self, piece: str) -> None:
        self._io.seek(self.length)
        self.length += self._io.write(piece)

    def between(self, start: int, end: int) -> str:
        """Characters start .. end - 1."""
        self._io.seek(start)
        return self._io.read(max(0, end - start))

    def cut(self, length: int) -> None:
        """Keep the first length characters."""
        self._io.truncate(length)
        self.length = length
