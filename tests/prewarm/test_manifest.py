"""`resolve_model_path`: the runtime loads the prewarmed copy only when it is complete."""

from __future__ import annotations

import io
import threading

import pytest
from ember_runtime.contract.manifest import MANIFEST_NAME, manifest_matches, resolve_model_path
from ember_runtime.prewarm.checks import Preflight
from ember_runtime.prewarm.copy import CopyOptions
from ember_runtime.prewarm.run import prewarm

from tests.prewarm.conftest import MakeSetup, Setup


def _prewarmed(make_setup: MakeSetup) -> Setup:
    s = make_setup({"model-00001-of-00002.gguf": b"a" * 100, "model-00002-of-00002.gguf": b"b"})
    prewarm(Preflight(s.config), CopyOptions(), io.StringIO(), threading.Event())
    return s


def test_prewarmed_path_for_every_shard(make_setup: MakeSetup) -> None:
    s = _prewarmed(make_setup)
    assert resolve_model_path(s.config) == s.target / "model-00001-of-00002.gguf"
    second = s.config.files[1]
    assert resolve_model_path(s.config, second) == s.target / "model-00002-of-00002.gguf"


def test_source_path_when_target_is_incomplete_or_stale(make_setup: MakeSetup) -> None:
    s = _prewarmed(make_setup)
    source = s.model_dir / "model-00001-of-00002.gguf"

    (s.target / "model-00002-of-00002.gguf").write_bytes(b"bb")  # truncated/grown copy
    assert resolve_model_path(s.config) == source

    s = _prewarmed(make_setup)
    newer = s.config.files[0].model_copy(update={"sha256": "1" * 64})
    changed = s.config.model_copy(update={"files": [newer, s.config.files[1]]})
    assert not manifest_matches(changed, s.target)
    assert resolve_model_path(changed) == source

    (s.target / MANIFEST_NAME).unlink()
    assert resolve_model_path(s.config) == source

    no_prewarm = s.config.model_copy(update={"prewarm_dir": None})
    assert resolve_model_path(no_prewarm) == source


def test_no_files_is_an_error(make_setup: MakeSetup) -> None:
    s = make_setup({"m": b"m"})
    with pytest.raises(ValueError, match="no model files"):
        resolve_model_path(s.config.model_copy(update={"files": []}))
