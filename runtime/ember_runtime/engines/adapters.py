"""LoRA adapters on the llama.cpp engine's shared base (the runtime slice of issue 47).

Each adapter of `engine.adapters` is checked and loaded once, at start, on the decode thread:
its file must match the configured sha256 (the config names the bytes it vouches for, as for
the model's own files) and llama.cpp must accept it as a LoRA of this very base. One that
fails either check is refused, not fatal: the base and the other adapters keep serving, the
log says why, and so do `/admin/state` (`refusedAdapters`) and a request that names it. The
architecture is compared here first only to give that reason in words; llama.cpp's own check
(`llama_adapter_lora_init`: architecture, tensor names and shapes) is what decides.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ember_runtime.engines.llama_native import LlamaContext
from ember_runtime.gguf_header import GGUFHeaderError, read_header

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """One `engine.adapters` entry, its path resolved."""

    name: str
    path: Path
    sha256: str
    scale: float = 1.0


@dataclass(frozen=True, slots=True)
class LoadedAdapter:
    handle: Any  # llama_adapter_lora *, freed with the model
    scale: float


def sha256_of(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def refusal(spec: AdapterSpec, base_arch: str) -> str | None:
    """Why `spec` cannot be served on a base of `base_arch`, before asking llama.cpp; None if
    nothing is known against it."""
    if not spec.path.is_file():
        return f"adapter file not found: {spec.path}"
    actual = sha256_of(spec.path)
    if actual != spec.sha256:
        return f"sha256 mismatch: the file has {actual}, engine.adapters says {spec.sha256}"
    try:
        header = read_header(spec.path)
    except (GGUFHeaderError, OSError) as exc:
        return f"not a GGUF file: {exc}"
    arch = header.get("general.architecture")
    if header.get("general.type") != "adapter" or header.get("adapter.type") != "lora":
        return "not a LoRA adapter GGUF (general.type adapter, adapter.type lora)"
    if arch != base_arch:
        return f"an adapter for another base: architecture {arch!r}, the model is {base_arch!r}"
    return None


def load_all(
    native: LlamaContext, specs: Sequence[AdapterSpec]
) -> tuple[dict[str, LoadedAdapter], dict[str, str]]:
    """(served adapters by name, refused ones' reasons by name), each refusal logged."""
    served: dict[str, LoadedAdapter] = {}
    refused: dict[str, str] = {}
    base_arch = native.architecture()
    for spec in specs:
        reason = refusal(spec, base_arch)
        handle = native.load_adapter(spec.path) if reason is None else None
        if reason is None and handle is None:
            reason = "llama.cpp refused it as a LoRA of this model (tensor names or shapes)"
        if reason is not None:
            log.error("LoRA adapter %s is not served: %s", spec.name, reason)
            refused[spec.name] = reason
            continue
        served[spec.name] = LoadedAdapter(handle, spec.scale)
        log.info("LoRA adapter %s loaded from %s (scale %g)", spec.name, spec.path, spec.scale)
    return served, refused
