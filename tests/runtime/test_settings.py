"""The runtime's settings (server/settings.py): file < $EMBER_* < flags, clear errors, and no
model of its own: the test model is the tests' (tests/support)."""

from __future__ import annotations

from pathlib import Path

import pytest
from ember_runtime.contract.manifest import resolve_model_path
from ember_runtime.server import __main__ as server_main
from ember_runtime.server import settings


def test_with_no_config_and_no_model_the_server_refuses_to_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("EMBER_CONFIG", raising=False)
    monkeypatch.delenv("EMBER_MODEL", raising=False)
    monkeypatch.setattr(settings, "DEFAULT_CONFIG_PATH", tmp_path / "no-configmap.yaml")
    with pytest.raises(ValueError, match=r"nothing to serve: no config file .* and no --model"):
        settings.load_settings(["--port", "9200"])
    assert server_main.main(["--port", "9200"]) == 2
    assert "nothing to serve" in capsys.readouterr().err


def test_a_model_alone_is_served_from_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("EMBER_CONFIG", raising=False)
    monkeypatch.setattr(settings, "DEFAULT_CONFIG_PATH", tmp_path / "no-configmap.yaml")
    monkeypatch.setenv("EMBER_MODEL", "/models/m.gguf")
    loaded = settings.load_settings([])
    assert (loaded.config.model_name, loaded.config.model_dir) == ("m", "/models")
    assert loaded.model_path == Path("/models/m.gguf")


def test_settings_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        "modelName: m\nmodelDir: /models\nserver: {port: 9000, maxQueue: 5}\n"
        "engine: {threads: 1, maxBatchSize: 8}\n"
    )
    monkeypatch.setenv("EMBER_MAX_QUEUE", "7")
    monkeypatch.setenv("EMBER_PORT", "9100")
    loaded = settings.load_settings(["--config", str(config), "--port", "9200"])
    assert loaded.config.server.port == 9200  # flag beats env beats file
    assert loaded.config.server.max_queue == 7
    assert loaded.config.engine.max_batch_size == 8


def test_bad_override_is_a_clear_error(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("modelName: m\nmodelDir: /models\n")
    with pytest.raises(ValueError, match="maxBatchSize"):
        settings.load_settings(["--config", str(config), "--max-batch-size", "0"])


def test_config_and_log_level_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The names the operator's pod spec and the README use: $EMBER_CONFIG (the mounted
    ConfigMap, reloaded for the thermal policy) and $EMBER_LOG_LEVEL; kebab-case flags."""
    config = tmp_path / "config.yaml"
    config.write_text("modelName: m\nmodelDir: /models\nserver: {maxBodyBytes: 4096}\n")
    monkeypatch.setenv("EMBER_CONFIG", str(config))
    monkeypatch.setenv("EMBER_LOG_LEVEL", "debug")
    loaded = settings.load_settings(["--api-key-file", "/k", "--engine", "llamacpp"])
    assert loaded.config_path == config
    assert loaded.config.server.max_body_bytes == 4096
    assert loaded.config.server.api_key_file == "/k"
    assert loaded.log_level == "debug"


def test_a_bad_flag_exits_2_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert server_main.main(["--port", "eighty"]) == 2
    err = capsys.readouterr().err
    assert "invalid runtime settings" in err and "port" in err


def test_model_path_falls_back_to_a_gguf_in_model_dir(tmp_path: Path) -> None:
    (tmp_path / "b.gguf").write_bytes(b"")
    (tmp_path / "a.gguf").write_bytes(b"")
    config = tmp_path / "config.yaml"
    config.write_text(f"modelName: m\nmodelDir: {tmp_path}\n")
    loaded = settings.load_settings(["--config", str(config)])
    assert resolve_model_path(loaded.config) == tmp_path / "a.gguf"
