"""A GGUF that holds only a tokenizer (no tensors): what `ember_runtime.vocabulary` compares,
for a draft model whose vocabulary differs from the served one's."""

from __future__ import annotations

from pathlib import Path

import gguf

OTHER_TOKENS = ["<pad>", "</s>", "<s>", "a", "b", "c", "ab", "bc", "abc", " "]


def write_vocab_gguf(
    out: Path,
    tokens: list[str] | None = None,
    *,
    tokenizer: str = "llama",
    bos: int = 2,
    eos: int = 1,
) -> Path:
    """A tokenizer-only GGUF at `out` (by default a 10-token vocabulary unlike any model's)."""
    writer = gguf.GGUFWriter(out, "llama")
    writer.add_tokenizer_model(tokenizer)
    writer.add_token_list(tokens if tokens is not None else OTHER_TOKENS)
    writer.add_bos_token_id(bos)
    writer.add_eos_token_id(eos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
