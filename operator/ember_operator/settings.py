"""The operator's own configuration (Helm values end up here as EMBER_OPERATOR_* variables)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

FIELD_MANAGER = "ember-operator"
MANAGED_BY = "ember-operator"


class OperatorSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EMBER_OPERATOR_", frozen=True)

    runtime_image: str = Field(
        default="ghcr.io/ember-dev/ember-runtime:0.1.0", description="Default runtime image."
    )
    runtime_gpu_image: str | None = Field(
        default=None,
        description="Runtime image for accelerator.kind nvidia-gpu (llama.cpp built with CUDA); "
        "unset: runtime_image, which serves those replicas on the CPU.",
    )
    image_pull_policy: str = "IfNotPresent"
    # Lists come from the environment as `a,b` (what the README and the chart write), not JSON.
    namespaces: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Namespaces to watch; empty: the whole cluster."
    )
    metrics_port: int = Field(default=9090, ge=0, le=65535)
    liveness_port: int = Field(default=8081, ge=0, le=65535)
    peering_name: str = "ember-operator"
    default_cpu: str = Field(
        default="1",
        description="CPU request/limit when a spec gives no resources. Threads follow the "
        "limit: 2 threads on 2 busy cores ran at 0.38x of 1 thread, so never oversubscribe.",
    )
    min_load_bandwidth_mib_s: float = Field(
        default=50.0,
        gt=0,
        description="Slowest model load we tolerate (MiB/s); sizes the startup probe so a slow "
        "SD card never gets a loading pod killed.",
    )
    startup_base_seconds: int = Field(default=30, ge=1)
    runtime_overhead_mib: int = Field(
        default=192, ge=0, description="Python + engine resident memory besides the model."
    )
    memory_headroom: float = Field(default=1.10, ge=1.0, description="Multiplier on the total.")
    model_roots: Annotated[list[Path], NoDecode] = Field(
        default_factory=list,
        description="Local directories where the operator may find model files to read GGUF "
        "headers from (hostPath sources are also tried as-is).",
    )
    api_timeout_seconds: float = Field(default=30.0, gt=0)
    model_mount: str = "/models"
    node_cache_root: str = Field(
        default="/var/lib/ember/cache",
        description="The node agent's content-addressed cache on every node (http sources): "
        "mounted read-only where a hostPath source would be.",
    )
    prewarm_mount: str = "/run/ember/prewarm"
    config_mount: str = "/etc/ember"
    run_as_user: int = 65532
    sensors_sysfs_root: str = Field(
        default="/sys",
        description="Host directory the runtime reads thermal zones from. Not /sys (a fake tree "
        "on test fleets): mounted read-only at `host_sys_mount` in the runtime container.",
    )
    host_sys_mount: str = "/host-sys"
    runtime_service_account: str = Field(
        default="ember-runtime",
        description="ServiceAccount the runtime pods run as; the operator creates it (and its "
        "RoleBinding) in every namespace that has an InferenceDeployment.",
    )
    runtime_api_server_host: str = Field(
        default="",
        description="Only for clusters without a working `kubernetes` Service (no kube-proxy): "
        "the API server address runtime pods report their condition to.",
    )
    runtime_api_server_port: int = Field(default=443, ge=1, le=65535)
    runtime_cluster_role: str = Field(
        default="ember-runtime",
        description="The ClusterRole the chart ships for the runtime (patch pods/status only); "
        "bound per namespace, so the operator needs `bind` on exactly this role.",
    )

    @field_validator("namespaces", "model_roots", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [item.strip() for item in value.split(",") if item.strip()]
        return value


def load_settings() -> OperatorSettings:
    return OperatorSettings()
