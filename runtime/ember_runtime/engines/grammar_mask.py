"""llama.cpp's grammar sampler as a mask over a logits row, for the numpy sampler (the
`GrammarMask` stage of engines/sampling.py's chain). engines/grammar.py writes the grammars;
this module applies them, one request at a time, on the model's vocabulary.

The row goes into a `llama_token_data` array the size of the vocabulary (ids laid out once);
llama.cpp sets the logit of every token the grammar forbids to -inf. Applied before any filter,
so a top_k or top_p prefilter never drops a token the grammar allows.

With `free_until` (a grammar that admits any text until that marker, as tool calls under
`tool_choice: auto`), checking the whole vocabulary every step would cost most of a step for
nothing: until the marker appears, while no partial marker or UTF-8 sequence is open, only the
risky tokens (those holding the marker's first character, or not UTF-8 on their own) can be
refused, so only they are checked. Every other token is one the full check would allow too.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ember_runtime.engines.base import InvalidRequestError
from ember_runtime.engines.llama_native import Vocab

# llama_token_data: {int32 id; float logit; float p}
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


class Grammar:
    """One request's grammar: its llama.cpp sampler, the mask it puts on each row, and the
    tokens it accepted (see the module docstring for `free_until` and `risky`)."""

    __slots__ = ("_arr", "_data", "_ll", "_piece", "_risky", "_smpl", "_sub", "_tail", "_until")

    def __init__(
        self,
        vocab: Vocab,
        text: str,
        *,
        free_until: bytes = b"",
        risky: Callable[[bytes], np.ndarray] | None = None,
    ) -> None:
        ll = vocab.ll
        smpl = ll.llama_sampler_init_grammar(vocab.handle, text.encode(), b"root")
        if not smpl:
            raise InvalidRequestError(
                "llama.cpp could not compile the grammar for response_format",
                param="response_format",
            )
        self._ll, self._smpl = ll, smpl
        self._data = np.zeros(vocab.size, dtype=_TOKEN_DATA)
        self._data["id"] = np.arange(vocab.size, dtype=np.int32)
        self._arr = self._array(self._data)
        lazy = bool(free_until) and risky is not None
        self._until, self._tail = free_until, (b"" if lazy else None)
        self._risky = risky
        self._piece = functools.partial(vocab.token_bytes, special=True)
        self._sub: tuple[np.ndarray, Any] | None = None

    def _array(self, data: np.ndarray) -> Any:
        ll = self._ll
        return ll.llama_token_data_array(
            data=data.ctypes.data_as(ll.llama_token_data_p), size=len(data), selected=-1
        )

    def mask(self, row: np.ndarray) -> np.ndarray:
        """`row` with every token the grammar forbids now at -inf (a copy)."""
        if self.in_free_text():
            return self._mask_risky(row)
        self._data["logit"] = row
        self._apply(self._data, self._arr)
        out: np.ndarray = self._data["logit"].copy()
        return out

    def _apply(self, data: np.ndarray, arr: Any) -> None:
        arr.size, arr.selected, arr.sorted = len(data), -1, False
        self._ll.llama_sampler_apply(self._smpl, ctypes.byref(arr))

    def _mask_risky(self, row: np.ndarray) -> np.ndarray:
        if self._sub is None:
            assert self._risky is not None
            ids = self._risky(self._until[:1])
            sub = np.zeros(len(ids), dtype=_TOKEN_DATA)
            sub["id"] = ids
            self._sub = (sub, self._array(sub))
        sub, arr = self._sub
        sub["logit"] = row[sub["id"]]
        self._apply(sub, arr)
        out = row.copy()
        out[sub["id"]] = sub["logit"]
        return out

    def in_free_text(self) -> bool:
        """Whether the text so far leaves the grammar in its free state (see above)."""
        tail = self._tail
        if tail is None or not _utf8_whole(tail):
            return False
        return not any(self._until.startswith(tail[-n:]) for n in range(1, len(tail) + 1))

    def accept(self, tok: int) -> None:
        self._ll.llama_sampler_accept(self._smpl, tok)
        if self._tail is not None:
            tail = self._tail + self._piece(tok)
            keep = len(self._until) - 1
            self._tail = None if self._until in tail else tail[max(0, len(tail) - keep) :]

    def free(self) -> None:
        if self._smpl:
            self._ll.llama_sampler_free(self._smpl)
            self._smpl = None


class Grammars:
    """Grammars over one model's vocabulary; the risky tokens of each marker are found once
    (a pass over the whole vocabulary) and shared by every request."""

    __slots__ = ("_risky", "_vocab")

    def __init__(self, vocab: Vocab) -> None:
        self._vocab = vocab
        self._risky: dict[bytes, np.ndarray] = {}  # by the marker's first byte

    def compile(self, text: str, *, free_until: str = "") -> Grammar:
        """The grammar `text` (GBNF, rule `root`); a 400 when llama.cpp cannot parse it."""
        return Grammar(self._vocab, text, free_until=free_until.encode(), risky=self.risky)

    def risky(self, first: bytes) -> np.ndarray:
        """Tokens a free-text grammar may refuse: those holding `first` (as the grammar sees
        them, special text included) or not UTF-8 on their own."""
        ids = self._risky.get(first)
        if ids is None:
            ids = np.fromiter(
                (
                    t
                    for t, p in enumerate(self._vocab.all_pieces())
                    if first in p or not _utf8_ok(p)
                ),
                np.int32,
            )
            self._risky[first] = ids
        return ids


def _utf8_whole(text: bytes) -> bool:
    """Whether `text` does not end inside a UTF-8 sequence."""
    for back in range(1, min(4, len(text)) + 1):
        byte = text[-back]
        if byte & 0xC0 != 0x80:  # the last lead byte: is its sequence complete?
            need = 1 if byte < 0x80 else 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return back >= need
    return True


def _utf8_ok(piece: bytes) -> bool:
    try:
        piece.decode()
    except UnicodeDecodeError:
        return False
    return piece[:1] not in (b"", b"\0")  # llama.cpp's grammar refuses these outright
