"""LoRA adapter GGUFs for the test model, written with the `gguf` package the way llama.cpp's
`convert_lora_to_gguf.py` writes them: `general.type` "adapter", `adapter.type` "lora",
`adapter.lora.alpha`, the base's `general.architecture`, and for each adapted weight
`<base tensor>.lora_a` (ggml shape [n_in, rank]) and `<base tensor>.lora_b` ([rank, n_out]).

The weights are random from a fixed seed: a test adapter has to change greedy output visibly
(so "the adapter was applied" is observable) and keep the logits finite, nothing more.
"""

from __future__ import annotations

import functools
from pathlib import Path

import gguf
import numpy as np

RANK = 8
ALPHA = 16.0  # llama.cpp scales B·A by alpha / rank (here 2) times the adapter's scale
TARGETS = ("attn_q", "attn_v", "ffn_up")
# Entries of A and B drawn from N(0, SIGMA^2): (alpha/rank)·B·A·x moves each output by about
# 2·SIGMA^2·sqrt(rank)·|x|, a fraction of the base weights' own effect: enough to change the
# greedy text, not enough to break it (0.05 broke it into "2022/2022/...", and at 0.02 one of
# the two test adapters left the greedy reply as the base's).
SIGMA = 0.03


@functools.cache
def _base_shapes(base: Path) -> tuple[str, tuple[tuple[str, int, int], ...]]:
    """The base's architecture and (tensor name, n_in, n_out) of every targeted weight."""
    reader = gguf.GGUFReader(base)
    field = reader.fields["general.architecture"]
    arch = bytes(field.parts[field.data[0]]).decode()
    shapes = []
    for t in reader.tensors:
        parts = t.name.split(".")  # blk.N.attn_q.weight
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in TARGETS:
            shapes.append((t.name, int(t.shape[0]), int(t.shape[1])))  # ggml order: ne0=n_in
    return arch, tuple(shapes)


def write_lora(
    base: Path,
    out: Path,
    *,
    seed: int,
    architecture: str | None = None,
    transpose: bool = False,
) -> Path:
    """A rank-`RANK` LoRA of `base` at `out`. `architecture` overrides the base's (a wrong-base
    adapter llama.cpp refuses); `transpose` swaps A's shape (mismatched tensor shapes)."""
    arch, shapes = _base_shapes(base)
    writer = gguf.GGUFWriter(out, architecture or arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, ALPHA)
    rng = np.random.default_rng(seed)
    for name, n_in, n_out in shapes:
        a = rng.normal(0.0, SIGMA, (n_in, RANK) if transpose else (RANK, n_in))
        b = rng.normal(0.0, SIGMA, (n_out, RANK))
        # numpy shapes are ggml's reversed: (rank, n_in) is ne = [n_in, rank].
        writer.add_tensor(f"{name}.lora_a", a.astype(np.float32))
        writer.add_tensor(f"{name}.lora_b", b.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
