"""The InferenceDeployment as every process finds it on the API server: its group, version and
paths, the node label naming a site, and the typed read-only view of the spec fields the node
side reads.

The operator's pydantic models (`ember_operator.api.models`) are the CRD's source of truth: they
generate its schema, every bound and rule included, and the API server validates each object
against it. The gateway and the node agent read such validated objects and need a handful of
fields: `SpecView` names those, with the CRD's names and defaults, and ignores everything else,
so a field added to the CRD changes nothing here. It is the one reader of `spec.model` on the
node side (the gateway takes its name, the node agent its http source and files:
`config.fetch_from_spec`) and of `spec.server` (the gateway: the port, the API key's Secret).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from ember_runtime.contract.thermal import DEFAULT_MAX_BATCH_SIZE

GROUP: Final = "ember.dev"
VERSION: Final = "v1alpha1"
KIND: Final = "InferenceDeployment"
PLURAL: Final = "inferencedeployments"
API_VERSION: Final = f"{GROUP}/{VERSION}"

# The node label whose value names a node's site: the operator places and rolls out by it, the
# gateway routes to its own site's nodes, the node agent shares its cache with them (the chart
# may point the agent at a label a kubelet cannot set on itself instead: its `siteLabel`).
SITE_LABEL: Final = "ember.dev/site"
DEFAULT_PORT: Final = 8080  # spec.server.port's default (the CRD's)


def collection_path(namespace: str) -> str:
    """The InferenceDeployments of `namespace`, as a REST path (list, watch)."""
    return f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}"


def object_path(namespace: str, name: str) -> str:
    return f"{collection_path(namespace)}/{name}"


class _View(BaseModel):
    """camelCase as stored, unknown fields ignored, never written back."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True
    )


class SecretKeyRef(_View):
    name: str
    key: str


class ServerView(_View):
    port: int = Field(default=DEFAULT_PORT, ge=1, le=65535)
    api_key_secret_ref: SecretKeyRef | None = None


class SecretName(_View):
    name: str


class HttpSourceView(_View):
    urls: dict[str, str] = Field(default_factory=dict)  # by files[].path
    secret_ref: SecretName | None = None


class SourceView(_View):
    http: HttpSourceView | None = None  # the only source the node side fetches


class FileView(_View):
    path: str
    sha256: str
    size_bytes: int


class ModelView(_View):
    name: str = Field(min_length=1)
    source: SourceView = Field(default_factory=SourceView)
    files: list[FileView] = Field(default_factory=list)


class AdapterView(_View):
    """`spec.adapters[]`: the gateway routes its name, the node agent fetches its url."""

    name: str = Field(min_length=1)
    path: str
    url: str | None = None
    sha256: str
    size_bytes: int
    scale: float = 1.0


class ScalingView(_View):
    """`spec.scaling`, read by the gateway that drives it (the CRD's defaults)."""

    min_replicas: int = Field(default=0, ge=0)
    max_replicas: int = Field(default=1, ge=1)
    idle_seconds: int = Field(default=300, ge=5)
    target_in_flight: int | None = Field(default=None, ge=1)
    priority: int = 0


class EngineView(_View):
    max_batch_size: int = Field(default=DEFAULT_MAX_BATCH_SIZE, ge=1)


class SpecView(_View):
    model: ModelView
    server: ServerView = Field(default_factory=ServerView)
    replicas: int = Field(default=1, ge=0)
    engine: EngineView = Field(default_factory=EngineView)
    adapters: list[AdapterView] = Field(default_factory=list)
    scaling: ScalingView | None = None


def read_model(model: Any) -> ModelView:
    """A `spec.model`-shaped value (the spec's, or the one a rollout keeps in its status) as the
    API server returns it; raises ValueError (pydantic's) on a shape the CRD would refuse."""
    return ModelView.model_validate(model)


def read_spec(obj: Mapping[str, Any]) -> SpecView:
    """An InferenceDeployment's spec, typed; raises ValueError as `read_model` does."""
    return SpecView.model_validate(obj.get("spec"))
