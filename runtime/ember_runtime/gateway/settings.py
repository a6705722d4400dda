"""The gateway's settings: flags (`--probe-interval 0.4`) or `EMBER_GATEWAY_*` environment (the
chart's: `EMBER_GATEWAY_PROBE_INTERVAL=0.4`); flags win. Read through pydantic-settings, as the
runtime server, the node agent and the device plugin read theirs."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Self

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="EMBER_GATEWAY_",
        cli_prog_name="python -m ember_runtime.gateway",
        cli_kebab_case=True,
        cli_hide_none_type=True,
        env_ignore_empty=True,  # the chart passes SELECTOR="" for "every InferenceDeployment"
        extra="forbid",
        frozen=True,
    )

    host: str = "0.0.0.0"  # noqa: S104 - a LAN service
    port: int = Field(default=8080, ge=1, le=65535)
    namespace: str = Field(default="", description="InferenceDeployments' namespace")
    selector: str = Field(default="", description="their label selector")
    site: str = Field(default="", description="only replicas on nodes of this site")
    static: Path | None = Field(
        default=None, description="a routes file instead of the API server (routes.load_static)"
    )
    snapshot: Path | None = Field(
        default=None,
        description="keep the last known routes here, for a restart while the API server is away",
    )
    probe_interval: float = Field(default=0.4, gt=0, description="seconds between probes")
    probe_timeout: float = Field(default=0.5, gt=0, description="a probe's timeout, seconds")
    upstream_timeout: float = Field(
        default=600.0, gt=0, description="the longest wait for a replica's next bytes, seconds"
    )
    prefix_chars: int = Field(default=256, ge=1, description="prompt characters hashed")
    load_factor: float = Field(default=1.25, ge=1.0, description="bounded-load factor c")
    hold_max_requests: int = Field(
        default=64, ge=0, description="requests held per scaled model while it has no replica"
    )
    hold_timeout: float = Field(
        default=120.0, gt=0, description="the longest a request is held, seconds"
    )
    scale_interval: float = Field(
        default=1.0, gt=0, description="seconds between the scaler's passes"
    )
    swap_interval: float = Field(
        default=30.0,
        gt=0,
        description="longest wait for a swapped-out model's pod to go before another",
    )
    swap_order: Literal["priority-lru", "ollama"] = Field(
        default="priority-lru",
        description="who is scaled down for room: lowest priority, then least recently used; "
        "or ollama: Ollama's rule (keep-alive, then name), the benchmark's baseline",
    )
    log_level: str = "info"

    @model_validator(mode="after")
    def _a_source_of_routes(self) -> Self:
        if self.static is None and not self.namespace:
            raise ValueError("--namespace (the API server) or --static (a routes file) is required")
        return self
