"""The prewarm manifest, and where the runtime loads the model from: prewarm writes it, the
runtime server reads it.

Prewarm writes `MANIFEST_NAME` into the target directory *last*, after every file has been
verified and renamed into place, so its presence means "this directory is complete"
(prewarm/manifest.py writes it durably). The runtime calls `resolve_model_path(config)` to learn
which copy to map:

    path = resolve_model_path(config)          # the first file in config.files
    Llama(model_path=str(path), use_mmap=True)  # maps the shm pages; nothing is copied again

It returns the prewarmed file when the manifest matches the config (same paths, sizes and
sha256, and the files on disk still have those sizes), and the source file otherwise — so a
pod without prewarm, or with a stale or partial target, still starts from the model volume.
All shards of a split GGUF come from the same directory, which llama.cpp requires.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ember_runtime.contract.config import ModelFile, RuntimeConfig

MANIFEST_NAME = ".ember-prewarm.json"
MANIFEST_VERSION = 1


class ManifestEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str
    size_bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    source_mtime_ns: int


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int = MANIFEST_VERSION
    model_name: str
    engine_kind: str
    files: list[ManifestEntry]


def read_manifest(target_dir: Path) -> Manifest | None:
    """The manifest in `target_dir`, or None when it is absent or unreadable."""
    try:
        raw = (target_dir / MANIFEST_NAME).read_text()
        return Manifest.model_validate(json.loads(raw))
    except (OSError, ValueError, ValidationError):
        # A torn or foreign manifest is the same as none: the directory is re-filled.
        return None


def encode_manifest(manifest: Manifest) -> bytes:
    return manifest.model_dump_json(indent=2).encode()


def manifest_matches(config: RuntimeConfig, target_dir: Path) -> bool:
    """True when `target_dir` holds exactly the config's files, verified by an earlier run.

    The config's sha256 is the contract, so the source's mtime is recorded but not compared:
    a remounted model volume may show new mtimes for the same bytes.
    """
    manifest = read_manifest(target_dir)
    if manifest is None or manifest.version != MANIFEST_VERSION:
        return False
    recorded = {(e.path, e.size_bytes, e.sha256) for e in manifest.files}
    wanted = {(f.path, f.size_bytes, f.sha256) for f in config.files}
    if recorded != wanted:
        return False
    return all(_has_size(target_dir / f.path, f.size_bytes) for f in config.files)


def _has_size(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except OSError:
        return False


def resolve_model_path(
    config: RuntimeConfig, file: ModelFile | None = None, *, explicit: Path | None = None
) -> Path:
    """The one answer to "which file does the runtime load": `explicit` (`--model`) when given;
    else `file` (default: the first configured file) from prewarm's copy when
    `config.prewarm_dir` holds a matching manifest, else from the source under
    `config.model_dir`; with no files configured (a developer's run), the first GGUF in
    `model_dir`. Raises ValueError when there is none of these."""
    if explicit is not None:
        return explicit
    if file is None:
        if not config.files:
            found = sorted(Path(config.model_dir).glob("*.gguf"))
            if not found:
                raise ValueError(f"config lists no model files and {config.model_dir} no .gguf")
            return found[0]
        file = config.files[0]
    if config.prewarm_dir is not None:
        target = Path(config.prewarm_dir)
        if manifest_matches(config, target):
            return target / file.path
    return config.source_file(file)
