"""Random-weight GGUFs in the tensor shapes of real models, for GPU benchmarks.

Decode and prefill speed depend on tensor shapes and types, not on the weights' values, and the
device machine cannot download models nor receive a multi-GB file, so the GPU benchmark
(`bench/gpu_bench.py`) writes its models there:

* `gemma3-270m`: Gemma 3 270M (arch `gemma3`, 18 layers, 640 wide, 4 heads / 1 KV head of 256,
  FFN 2048, 262,144-token vocabulary, tied embeddings), every matrix Q8_0 (the packaged
  Q4_K_M file mixes Q8_0, Q5_0, Q4_K and Q6_K: ~1.1x the bytes here);
* `llama-8b`: Llama 3.1 8B (arch `llama`, 32 layers, 4096 wide, 32 heads / 8 KV heads,
  FFN 14,336, 128,256-token vocabulary, separate output matrix), every matrix Q4_0 (~4.4 GiB,
  like a Q4_K_M file's 4.6 GiB).

The tokenizer is a synthetic SentencePiece vocabulary (llama.cpp's `llama` tokenizer): the
words of the benchmark's prompts, single characters, byte-fallback tokens and filler pieces up
to the real vocabulary size, so prompts tokenize to about as many tokens as with a real
tokenizer. The output rows of special and byte tokens are zero, so greedy decoding never picks
end-of-sequence (every request generates exactly `max_tokens`, on every server) nor a lone byte
(which would stream as an empty chunk).

    python bench/gpu_models.py --out DIR [--only gemma3-270m,llama-3b,llama-8b]
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, TokenType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.runtime_bench import PROMPTS, QUESTIONS, SYSTEM

SPECIALS = ["<pad>", "</s>", "<s>", "<unk>"]  # ids 0..3: Gemma's order (eos 1, bos 2, unk 3)
BLOCK = {GGMLQuantizationType.Q4_0: (32, 18), GGMLQuantizationType.Q8_0: (32, 34)}
# Quantized block scale (f16): keeps activations O(1) through the residual stream, so no
# inf/NaN logits whatever the random values.
SCALE = {GGMLQuantizationType.Q4_0: 0.002, GGMLQuantizationType.Q8_0: 0.0002}


@dataclass(frozen=True)
class Shape:
    arch: str
    layers: int
    embedding: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    context: int
    rope_base: float
    qtype: GGMLQuantizationType
    tied: bool


SHAPES = {
    "gemma3-270m": Shape(
        "gemma3", 18, 640, 2048, 4, 1, 256, 262_144, 32_768, 1e6, GGMLQuantizationType.Q8_0, True
    ),
    # Llama 3.2 3B, Q8_0: 3.4 GB, like the published Q8_0 files (bench/prewarm_bench.py's
    # ≥ 2 GB model).
    "llama-3b": Shape(
        "llama", 28, 3072, 8192, 24, 8, 128, 128_256, 131_072, 5e5, GGMLQuantizationType.Q8_0, True
    ),
    "llama-8b": Shape(
        "llama",
        32,
        4096,
        14_336,
        32,
        8,
        128,
        128_256,
        131_072,
        5e5,
        GGMLQuantizationType.Q4_0,
        False,
    ),
}


def vocabulary(size: int) -> list[str]:
    """Specials, 256 byte tokens, single characters, the prompts' words, then filler pieces."""
    pieces = list(SPECIALS) + [f"<0x{b:02X}>" for b in range(256)]
    seen = set(pieces)
    text = " ".join([*PROMPTS, SYSTEM, *QUESTIONS])
    chars = sorted(
        set(text) | set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
    )
    words = sorted(set(re.findall(r"[A-Za-z']+|[0-9]+|[^\sA-Za-z0-9]", text)))
    # SentencePiece merges adjacent pairs only into pieces that exist, so a word is reachable
    # only if its every prefix is a piece too.
    prefixes = [w[:n] for w in (*(f"▁{w}" for w in words), *words) for n in range(2, len(w) + 1)]
    for piece in ["▁", *chars, *prefixes]:
        if piece not in seen and piece != " ":
            seen.add(piece)
            pieces.append(piece)
    i = 0
    while len(pieces) < size:  # filler: pronounceable, so generated text reads as words
        piece = f"▁{'bcdfghklmnprstvz'[i % 16]}{'aeiou'[(i // 16) % 5]}{i // 80}"
        i += 1
        if piece not in seen:
            seen.add(piece)
            pieces.append(piece)
    return pieces[:size]


def quantized(
    rng: np.random.Generator, rows: int, cols: int, qtype: GGMLQuantizationType
) -> np.ndarray:
    """A (rows, bytes per row) uint8 array of random blocks with a fixed, small scale."""
    per_block, size = BLOCK[qtype]
    blocks = cols // per_block
    data = np.frombuffer(rng.bytes(rows * blocks * size), dtype=np.uint8).copy()
    view = data.reshape(rows, blocks, size)
    view[:, :, 0:2] = np.frombuffer(np.float16(SCALE[qtype]).tobytes(), dtype=np.uint8)
    return data.reshape(rows, blocks * size)


def zero_rows(tensor: np.ndarray, rows: int) -> None:
    tensor[:rows] = 0  # scale 0: these tokens' logits are exactly 0, below every real one


def write_model(name: str, out: Path, seed: int = 0) -> Path:
    shape = SHAPES[name]
    path = out / f"{name}-random.gguf"
    if path.exists():
        return path
    rng = np.random.default_rng(seed)
    began = time.monotonic()
    writer = GGUFWriter(str(path), shape.arch)
    _metadata(writer, shape, name)
    q, hd = shape.qtype, shape.head_dim
    embd = quantized(rng, shape.vocab, shape.embedding, q)
    zero_rows(embd, len(SPECIALS) + 256)
    writer.add_tensor("token_embd.weight", embd, raw_dtype=q)
    ones = np.ones(shape.embedding, dtype=np.float32)
    for layer in range(shape.layers):
        p = f"blk.{layer}."
        writer.add_tensor(p + "attn_norm.weight", ones)
        writer.add_tensor(
            p + "attn_q.weight", quantized(rng, shape.heads * hd, shape.embedding, q), raw_dtype=q
        )
        writer.add_tensor(
            p + "attn_k.weight",
            quantized(rng, shape.kv_heads * hd, shape.embedding, q),
            raw_dtype=q,
        )
        writer.add_tensor(
            p + "attn_v.weight",
            quantized(rng, shape.kv_heads * hd, shape.embedding, q),
            raw_dtype=q,
        )
        writer.add_tensor(
            p + "attn_output.weight",
            quantized(rng, shape.embedding, shape.heads * hd, q),
            raw_dtype=q,
        )
        writer.add_tensor(p + "ffn_norm.weight", ones)
        writer.add_tensor(
            p + "ffn_gate.weight", quantized(rng, shape.ffn, shape.embedding, q), raw_dtype=q
        )
        writer.add_tensor(
            p + "ffn_up.weight", quantized(rng, shape.ffn, shape.embedding, q), raw_dtype=q
        )
        writer.add_tensor(
            p + "ffn_down.weight", quantized(rng, shape.embedding, shape.ffn, q), raw_dtype=q
        )
        if shape.arch == "gemma3":
            head_ones = np.ones(hd, dtype=np.float32)
            writer.add_tensor(p + "attn_q_norm.weight", head_ones)
            writer.add_tensor(p + "attn_k_norm.weight", head_ones)
            writer.add_tensor(p + "post_attention_norm.weight", ones)
            writer.add_tensor(p + "post_ffw_norm.weight", ones)
    writer.add_tensor("output_norm.weight", ones)
    if not shape.tied:
        output = quantized(rng, shape.vocab, shape.embedding, q)
        zero_rows(output, len(SPECIALS) + 256)
        writer.add_tensor("output.weight", output, raw_dtype=q)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    size = path.stat().st_size
    print(f"{path.name}: {size / 2**30:.2f} GiB in {time.monotonic() - began:.0f} s", flush=True)
    return path


def _metadata(writer: GGUFWriter, shape: Shape, name: str) -> None:
    writer.add_name(f"{name} (random weights)")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.embedding)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_base)
    writer.add_layer_norm_rms_eps(1e-6 if shape.arch == "gemma3" else 1e-5)
    if shape.arch == "gemma3":
        writer.add_sliding_window(512)
    else:
        writer.add_rope_dimension_count(shape.head_dim)
        writer.add_vocab_size(shape.vocab)
    writer.add_file_type(2 if shape.qtype == GGMLQuantizationType.Q4_0 else 7)
    tokens = vocabulary(shape.vocab)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([float(len(t)) if i >= 260 else 0.0 for i, t in enumerate(tokens)])
    types = [TokenType.CONTROL] * len(SPECIALS) + [TokenType.BYTE] * 256
    types[3] = TokenType.UNKNOWN
    writer.add_token_types(types + [TokenType.NORMAL] * (len(tokens) - len(types)))
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", default="gemma3-270m,llama-8b")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.only.split(","):
        print(write_model(name, args.out))


if __name__ == "__main__":
    main()
