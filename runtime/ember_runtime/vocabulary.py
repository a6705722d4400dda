"""Whether a draft model speaks the served model's vocabulary (`engine.draftModel`, issue 48).

A draft's tokens go into the served model's batch as token ids and are kept where the served
model draws the same id, so the two must give every id the same text: the same tokenizer, the
same token list (compared by the digest of its elements, `gguf_header.read_header`), the same
begin and end tokens. Read from the GGUF headers alone, in a few kilobytes: prewarm checks it
before it copies anything (reason `DraftVocabularyMismatch`), and the engine again at load.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ember_runtime.gguf_header import LongArray, Value, read_header

_KEYS = {
    "model": "tokenizer.ggml.model",
    "bos": "tokenizer.ggml.bos_token_id",
    "eos": "tokenizer.ggml.eos_token_id",
}
_TOKENS = "tokenizer.ggml.tokens"


@dataclass(frozen=True)
class Vocabulary:
    tokenizer: Value | None
    size: int
    tokens_sha256: str | None
    bos: Value | None
    eos: Value | None


def vocabulary(path: Path) -> Vocabulary:
    """The vocabulary of the GGUF at `path`; raises GGUFHeaderError or OSError."""
    header = read_header(path, digest_strings=True)
    tokens = header.get(_TOKENS)
    size, digest = (tokens.length, tokens.sha256) if isinstance(tokens, LongArray) else (0, None)
    return Vocabulary(
        header.get(_KEYS["model"]), size, digest, header.get(_KEYS["bos"]), header.get(_KEYS["eos"])
    )


def difference(served: Path, draft: Path) -> str | None:
    """Why `draft` cannot draft for `served` (one line naming the first difference), or None."""
    a, b = vocabulary(served), vocabulary(draft)
    if a.size == 0:
        return f"{served.name} has no {_TOKENS}"
    checks = [
        ("tokenizer", a.tokenizer, b.tokenizer),
        ("vocabulary size", a.size, b.size),
        ("token list (sha256)", a.tokens_sha256, b.tokens_sha256),
        ("begin token", a.bos, b.bos),
        ("end token", a.eos, b.eos),
    ]
    for what, mine, theirs in checks:
        if mine != theirs:
            shown = [str(v)[:12] if what.startswith("token list") else v for v in (mine, theirs)]
            return (
                f"{draft.name} has another vocabulary than {served.name}: "
                f"{what} {shown[1]} against {shown[0]}"
            )
    return None
