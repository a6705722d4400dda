"""Runtime settings: the operator's ConfigMap file, then `EMBER_*` environment, then flags.

The ConfigMap (`RuntimeConfig`) is the contract with the operator; flags exist so a developer can
run `python -m ember_runtime.server --model x.gguf` without one (with neither, it refuses to
start: it has no model of its own). Precedence, lowest first: built-in defaults < config file
(`--config`, `$EMBER_CONFIG`, `/etc/ember/config.yaml`) < environment (`EMBER_PORT`,
`EMBER_THREADS`, ...) < command-line flags.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, CliApp, SettingsConfigDict

from ember_runtime.contract.config import (
    CONFIG_ENV,
    DEFAULT_CONFIG_PATH,
    RuntimeConfig,
    load_config,
)
from ember_runtime.server.health import DEFAULT_WINDOW_SECONDS

# Override -> (section, camelCase field) in RuntimeConfig.
_OVERRIDES: dict[str, tuple[str, str]] = {
    "host": ("server", "host"),
    "port": ("server", "port"),
    "api_key_file": ("server", "apiKeyFile"),
    "max_queue": ("server", "maxQueue"),
    "request_timeout": ("server", "requestTimeoutSeconds"),
    "max_body_bytes": ("server", "maxBodyBytes"),
    "engine": ("engine", "kind"),
    "threads": ("engine", "threads"),
    "context_length": ("engine", "contextLength"),
    "max_batch_size": ("engine", "maxBatchSize"),
    "sysfs_root": ("sensors", "sysfsRoot"),
}


class ServerSettings(BaseSettings):
    """Ember's inference sidecar. Flags and EMBER_* variables override the config file."""

    # As the node agent and device plugin take theirs. Unset overrides leave the config file's
    # values alone; set ones are validated with the rest of the config by `RuntimeConfig` (one
    # validation path for all three sources).

    model_config = SettingsConfigDict(
        env_prefix="EMBER_",
        frozen=True,
        cli_prog_name="python -m ember_runtime.server",
        cli_kebab_case=True,
        env_ignore_empty=True,
        cli_hide_none_type=True,
    )

    config: Path | None = Field(default=None, description=f"RuntimeConfig YAML (${CONFIG_ENV})")
    model: Path | None = Field(default=None, description="GGUF file to serve (default: config's)")
    host: str | None = None
    port: int | None = None
    api_key_file: str | None = None
    max_queue: int | None = None
    request_timeout: float | None = None
    max_body_bytes: int | None = None
    engine: Literal["llamacpp", "tensorrt-llm"] | None = None
    threads: int | None = None
    context_length: int | None = None
    max_batch_size: int | None = None
    sysfs_root: str | None = None
    log_level: str = "info"
    # Not in the ConfigMap: the window of the pod's ember.dev/Health condition (server.health).
    health_window_seconds: int = Field(
        default=DEFAULT_WINDOW_SECONDS,
        ge=1,
        le=86_400,
        description="window of the ember.dev/Health condition's counts and TTFT p99, seconds",
    )


@dataclass(frozen=True)
class Settings:
    config: RuntimeConfig
    model_path: Path | None  # an explicit --model wins over the config's files
    log_level: str
    config_path: Path | None = None  # the file the thermal policy is reloaded from, if any
    health_window_seconds: int = DEFAULT_WINDOW_SECONDS


def load_settings(argv: Sequence[str] | None = None) -> Settings:
    args = list(sys.argv[1:] if argv is None else argv)
    flags = CliApp.run(ServerSettings, cli_args=args)
    base = _base_config(flags.config, flags.model)
    data: dict[str, Any] = base.model_dump(mode="json", by_alias=True)
    for name, (section, key) in _OVERRIDES.items():
        value = getattr(flags, name)
        if value is not None:
            data[section][key] = value
    config = RuntimeConfig.model_validate(data)
    return Settings(
        config=config,
        model_path=flags.model,
        log_level=flags.log_level,
        config_path=_config_path(flags.config),
        health_window_seconds=flags.health_window_seconds,
    )


def _config_path(path: Path | None) -> Path | None:
    """`--config` or `$EMBER_CONFIG` (both in `path`), else the mounted file if there is one."""
    if path is not None:
        return path
    return DEFAULT_CONFIG_PATH if DEFAULT_CONFIG_PATH.exists() else None


def _base_config(path: Path | None, model: Path | None) -> RuntimeConfig:
    found = _config_path(path)
    if found is not None:
        return load_config(found)
    if model is None:
        # No built-in model: the product serves what it is told to (the tests' model is
        # tests/support/model.py's, and they pass it with --model).
        raise ValueError(
            f"nothing to serve: no config file (--config, ${CONFIG_ENV} or {DEFAULT_CONFIG_PATH}) "
            "and no --model ($EMBER_MODEL)"
        )
    return RuntimeConfig(model_name=model.stem, model_dir=str(model.parent))


def read_api_key(config: RuntimeConfig) -> str | None:
    if config.server.api_key_file is None:
        return None
    key = Path(config.server.api_key_file).read_text().strip()
    if not key:
        raise ValueError(f"the API key file {config.server.api_key_file} is empty")
    return key
