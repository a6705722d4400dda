"""Fixtures for prewarm: model dirs of generated files, configs on disk, the CLI as a subprocess."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from ember_runtime.contract.config import ModelFile, RuntimeConfig

from tests.support.model import default_model_path, sha256_file

CLI = [sys.executable, "-m", "ember_runtime.prewarm"]


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    """The real Gemma 3 270M GGUF, assembled once into the user cache."""
    return default_model_path()


@dataclass
class Setup:
    model_dir: Path
    target: Path
    termination_log: Path
    config: RuntimeConfig
    config_path: Path

    def write(self, config: RuntimeConfig) -> None:
        self.config = config
        self.config_path.write_text(config.to_yaml())


MakeSetup = Callable[..., Setup]


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A private directory on the memory-backed /dev/shm, like the pod's emptyDir medium=Memory."""
    path = Path(tempfile.mkdtemp(prefix="ember-prewarm-test-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def make_setup(tmp_path: Path, shm_dir: Path) -> MakeSetup:
    """Write `files` (name → bytes, or name → existing path to link) into a model dir."""

    def make(files: dict[str, bytes | Path], **config_fields: object) -> Setup:
        model_dir, target = tmp_path / "models", shm_dir / "model"
        for rel, content in files.items():
            dest = model_dir / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, Path):
                os.symlink(content, dest)  # the model volume is read, never written
            else:
                dest.write_bytes(content)
        specs = [
            ModelFile(
                path=rel, sha256=sha256_file(model_dir / rel), size_bytes=_size(model_dir / rel)
            )
            for rel in files
        ]
        fields: dict[str, object] = {
            "model_name": "test",
            "model_dir": str(model_dir),
            "files": specs,
            "prewarm_dir": str(target),
            "termination_log": str(tmp_path / "termination-log"),
        }
        fields.update(config_fields)
        config = RuntimeConfig.model_validate(fields)
        setup = Setup(model_dir, target, tmp_path / "termination-log", config, tmp_path / "c.yaml")
        setup.write(config)
        return setup

    return make


def _size(path: Path) -> int:
    return path.stat().st_size


def run_cli(*args: str | Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *map(str, args)], capture_output=True, text=True, timeout=timeout, check=False
    )
