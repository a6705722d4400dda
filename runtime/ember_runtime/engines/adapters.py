"""LoRA adapters on the llama.cpp engine's shared base (issue 47).

Each adapter of `engine.adapters` is checked and loaded on the decode thread: at start, and
again whenever the mounted config's list changes (hot plug: `server.reload`, the engine's
`update_adapters`). Its file must match the configured sha256 (the config names the bytes it
vouches for, as for the model's own files) and llama.cpp must accept it as a LoRA of this very
base. One that fails either check is refused, not fatal: the base and the other adapters keep
serving, the log says why, and so do `/admin/state` (`refusedAdapters`) and a request that
names it. The architecture is compared here first only to give that reason in words;
llama.cpp's own check (`llama_adapter_lora_init`: architecture, tensor names and shapes) is
what decides. A refused adapter is tried again when its file changes (`file_mark`): a file not
there yet (the node agent still fetching it) is served once it arrives.
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

    @property
    def key(self) -> str:
        """This version of the adapter: what the KV cells computed under it are tagged with
        (`Sequence.adapter`), so a name re-pointed at other bytes shares no cells."""
        return f"{self.name}\0{self.sha256}\0{self.scale!r}"


@dataclass(frozen=True, slots=True, eq=False)
class LoadedAdapter:
    """A served adapter (identity-compared: two loads of one file are two handles)."""

    spec: AdapterSpec
    handle: Any  # llama_adapter_lora *: freed when retired and unused, else with the model

    @property
    def scale(self) -> float:
        return self.spec.scale

    @property
    def key(self) -> str:
        return self.spec.key


def file_mark(path: Path) -> tuple[int, int, int] | None:
    """What tells a refused adapter's file changed (inode, size, mtime); None when missing."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


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


LLAMA_REFUSED = "llama.cpp refused it as a LoRA of this model (tensor names or shapes)"


def load_one(native: LlamaContext, spec: AdapterSpec) -> LoadedAdapter | str:
    """The loaded adapter, or why it is refused (logged). Decode thread (llama.cpp's part)."""
    reason = refusal(spec, native.architecture())
    return load_checked(native, spec, reason)


def load_checked(
    native: LlamaContext, spec: AdapterSpec, reason: str | None
) -> LoadedAdapter | str:
    """`load_one` after `refusal` ran elsewhere (off the decode thread: hashing takes time)."""
    handle = native.load_adapter(spec.path) if reason is None else None
    if reason is None and handle is None:
        reason = LLAMA_REFUSED
    if reason is not None:
        log.error("LoRA adapter %s is not served: %s", spec.name, reason)
        return reason
    log.info("LoRA adapter %s loaded from %s (scale %g)", spec.name, spec.path, spec.scale)
    return LoadedAdapter(spec, handle)


def load_all(
    native: LlamaContext, specs: Sequence[AdapterSpec]
) -> tuple[dict[str, LoadedAdapter], dict[str, str]]:
    """(served adapters by name, refused ones' reasons by name), each refusal logged."""
    served: dict[str, LoadedAdapter] = {}
    refused: dict[str, str] = {}
    for spec in specs:
        got = load_one(native, spec)
        if isinstance(got, str):
            refused[spec.name] = got
        else:
            served[spec.name] = got
    return served, refused
