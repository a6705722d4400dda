"""Runtime settings: the operator's ConfigMap file, then `EMBER_*` environment, then flags.

The ConfigMap (`RuntimeConfig`) is the contract with the operator; flags exist so a developer can
run `python -m ember_runtime.server --model x.gguf` without one. Precedence, lowest first:
built-in defaults < config file (`--config`, `$EMBER_CONFIG`, `/etc/ember/config.yaml`) <
environment (`EMBER_PORT`, `EMBER_THREADS`, ...) < command-line flags.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ember_runtime.contract.config import (
    CONFIG_ENV,
    DEFAULT_CONFIG_PATH,
    RuntimeConfig,
    load_config,
)
from ember_runtime.prewarm.manifest import resolve_model_path as prewarmed

# flag/env name -> (section, camelCase field) in RuntimeConfig
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
_INTS = {"port", "max_queue", "max_body_bytes", "threads", "context_length", "max_batch_size"}


@dataclass(frozen=True)
class Settings:
    config: RuntimeConfig
    model_path: Path | None  # an explicit --model wins over the config's files
    log_level: str
    config_path: Path | None = None  # the file the thermal policy is reloaded from, if any


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ember_runtime.server", description="Ember's inference sidecar."
    )
    p.add_argument("--config", type=Path, help=f"RuntimeConfig YAML (default ${CONFIG_ENV})")
    p.add_argument("--model", type=Path, help="GGUF file to serve (default: the config's)")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--api-key-file")
    p.add_argument("--max-queue", type=int)
    p.add_argument("--request-timeout", type=float)
    p.add_argument("--max-body-bytes", type=int)
    p.add_argument("--engine", choices=["llamacpp", "tensorrt-llm"])
    p.add_argument("--threads", type=int)
    p.add_argument("--context-length", type=int)
    p.add_argument("--max-batch-size", type=int)
    p.add_argument("--sysfs-root")
    p.add_argument("--log-level", default=os.environ.get("EMBER_LOG_LEVEL", "info"))
    return p


def load_settings(argv: list[str] | None = None) -> Settings:
    args = parser().parse_args(argv)
    model: Path | None = args.model
    base = _base_config(args.config, model)
    data: dict[str, Any] = base.model_dump(mode="json", by_alias=True)
    for name, (section, key) in _OVERRIDES.items():
        env = os.environ.get(f"EMBER_{name.upper()}")
        if env is not None:
            data[section][key] = int(env) if name in _INTS else env
        flag = getattr(args, name)
        if flag is not None:
            data[section][key] = flag
    config = RuntimeConfig.model_validate(data)  # one validation path for all three sources
    return Settings(
        config=config,
        model_path=model,
        log_level=args.log_level,
        config_path=_config_path(args.config),
    )


def _config_path(path: Path | None) -> Path | None:
    env = os.environ.get(CONFIG_ENV)
    if path is not None:
        return path
    if env is not None:
        return Path(env)
    return DEFAULT_CONFIG_PATH if DEFAULT_CONFIG_PATH.exists() else None


def _base_config(path: Path | None, model: Path | None) -> RuntimeConfig:
    env = os.environ.get(CONFIG_ENV)
    if path is not None or env is not None or DEFAULT_CONFIG_PATH.exists():
        return load_config(path)
    if model is None:
        from ember_runtime.models import default_model_path  # noqa: PLC0415 - dev-only path

        model = default_model_path()
    return RuntimeConfig(model_name=model.stem, model_dir=str(model.parent))


def resolve_model_path(config: RuntimeConfig, explicit: Path | None = None) -> Path:
    """`--model`, else prewarm's copy or the source (prewarm decides), else a GGUF in model_dir."""
    if explicit is not None:
        return explicit
    if config.files:
        return prewarmed(config)
    found = sorted(Path(config.model_dir).glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file in {config.model_dir} and none configured")
    return found[0]


def read_api_key(config: RuntimeConfig) -> str | None:
    if config.server.api_key_file is None:
        return None
    key = Path(config.server.api_key_file).read_text().strip()
    if not key:
        raise ValueError(f"the API key file {config.server.api_key_file} is empty")
    return key
