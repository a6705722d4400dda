"""Settings of the NPU device plugin, from flags (`--contexts-per-device 4`) or the environment
(`EMBER_DP_CONTEXTS_PER_DEVICE=4`); flags win.

The plugin runs once per node (a DaemonSet), so its settings are node-scoped and separate from
the per-deployment `RuntimeConfig` the operator renders.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# Kubernetes extended resource names: <dns-subdomain>/<name>.
RESOURCE_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
PositiveSeconds = Annotated[float, Field(gt=0, le=3600)]


class PluginSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="EMBER_DP_",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_prog_name="python -m ember_runtime.deviceplugin",
        extra="forbid",
        frozen=True,
    )

    resource_name: str = Field(default="ember.dev/npu", pattern=RESOURCE_NAME_PATTERN)
    contexts_per_device: int = Field(
        default=4, ge=1, le=256, description="Schedulable units (ACL contexts) per physical NPU."
    )
    device_plugin_dir: Path = Field(
        default=Path("/var/lib/kubelet/device-plugins"),
        description="The kubelet's device plugin dir: holds kubelet.sock and our socket.",
    )
    socket_name: str = Field(default="ember-npu.sock", pattern=r"^[A-Za-z0-9][-A-Za-z0-9_.]*$")
    pod_resources_socket: Path = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
    dev_root: Path = Field(default=Path("/dev"), description="Where device nodes are found.")
    device_glob: str = Field(default="davinci[0-9]*", description="Device nodes, under devRoot.")
    control_nodes: list[str] = Field(
        default_factory=lambda: ["davinci_manager", "devmm_svm", "hisi_hdc"],
        description="Shared control nodes under devRoot, handed to every allocation if present.",
    )
    host_dev_root: Path | None = Field(
        default=None,
        description="devRoot as the container runtime sees it on the host, for DeviceSpec host "
        "paths (the DaemonSet mounts the host's /dev at /host/dev: a /dev mount would hide the "
        "kubelet's /dev/termination-log). Unset: devRoot.",
    )
    container_dev_dir: str = Field(default="/dev", description="Where nodes appear in containers.")
    rescan_interval_seconds: PositiveSeconds = Field(
        default=0.5, description="Fallback rescan period; inotify usually reports first."
    )
    health_command: list[str] = Field(
        default_factory=list,
        description="argv run per device (no shell); {index}, {name}, {path} are substituted; "
        "a non-zero exit marks the device unhealthy. Empty: node presence only.",
    )
    health_interval_seconds: PositiveSeconds = 0.5
    health_timeout_seconds: PositiveSeconds = 0.8
    checkpoint_path: Path = Path("/var/lib/ember/deviceplugin/allocations.json")
    reconcile_interval_seconds: PositiveSeconds = Field(
        default=10.0, description="How often allocations are checked against PodResources."
    )
    commit_window_seconds: float = Field(
        default=0.004,
        ge=0,
        le=0.1,
        description=(
            "Once concurrent Allocate calls shared a checkpoint write, the next write waits up "
            "to this long for more callers to join it (fewer device flushes), less once as many "
            "are waiting as the last write held. The kubelet's own serial calls never wait. "
            "0: write as soon as the previous write is done."
        ),
    )
    release_grace_seconds: float = Field(
        default=60.0,
        ge=0,
        description=(
            "An allocation that never shows up in PodResources is released after this; after a "
            "kubelet restart, so is one whose container the new kubelet does not list again."
        ),
    )
    node_ordinal: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="Set: context IDs are ordinal*idSpace + n, unique across the fleet.",
    )
    id_space: int = Field(default=65536, ge=1, le=1 << 20, description="Context IDs per node.")
    register_retry_seconds: PositiveSeconds = 1.0
    metrics_enabled: bool = True
    metrics_host: str = "0.0.0.0"  # noqa: S104 - Prometheus scrapes the pod IP
    metrics_port: int = Field(default=9402, ge=0, le=65535, description="0: any free port.")
    log_level: str = Field(default="INFO", pattern=r"^(DEBUG|INFO|WARNING|ERROR)$")

    @field_validator("control_nodes")
    @classmethod
    def _plain_names(cls, names: list[str]) -> list[str]:
        for name in names:
            if not name or "/" in name or name in {".", ".."}:
                raise ValueError(f"control node {name!r} must be a plain file name under devRoot")
        return names

    @model_validator(mode="after")
    def _not_kubelet_socket(self) -> PluginSettings:
        if self.socket_name == "kubelet.sock":
            raise ValueError("socketName must not be kubelet.sock (that is the kubelet's socket)")
        return self

    def host_path(self, node: Path) -> Path:
        """Where the container runtime finds a device node this plugin discovered."""
        if self.host_dev_root is None:
            return node
        return self.host_dev_root / node.relative_to(self.dev_root)

    @property
    def plugin_socket(self) -> Path:
        return self.device_plugin_dir / self.socket_name

    @property
    def kubelet_socket(self) -> Path:
        return self.device_plugin_dir / "kubelet.sock"
