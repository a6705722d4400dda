"""Incremental detokenization with stop strings, one instance per sequence.

Tokens arrive as byte pieces that may split a UTF-8 character, so bytes go through an incremental
decoder. Stop strings may span tokens, so the tail that could still become a stop string is held
back until it either completes (generation stops, the stop string is never emitted) or diverges.
"""

from __future__ import annotations

import codecs


class TextAssembler:
    __slots__ = ("_decoder", "_held", "_stops")

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = tuple(s for s in stops if s)
        self._held = ""

    def push(self, piece: bytes) -> tuple[str, bool]:
        """Add one token's bytes; return (text safe to emit now, whether a stop string hit)."""
        text = self._held + self._decoder.decode(piece)
        if not self._stops:
            return text, False
        cut = -1
        for stop in self._stops:
            at = text.find(stop)
            if at >= 0 and (cut < 0 or at < cut):
                cut = at
        if cut >= 0:
            self._held = ""
            return text[:cut], True
        keep = self._partial_stop_suffix(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """Whatever is held back (a stop-string prefix or an unfinished UTF-8 sequence)."""
        text = self._held + self._decoder.decode(b"", final=True)
        self._held = ""
        return text

    def _partial_stop_suffix(self, text: str) -> int:
        keep = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(text)), keep, -1):
                if text.endswith(stop[:k]):
                    keep = k
                    break
        return keep
