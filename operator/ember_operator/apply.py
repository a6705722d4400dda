"""Server-side apply of child manifests, skipped when the live object already matches.

Why the `kubernetes` client, sync, in Kopf's threaded handlers: it is the client the design names,
its ApiClient carries kubeconfig/in-cluster auth without extra code, and the sync handlers run in
Kopf's thread pool so they never block the event loop. We call the generic `call_api` rather than
DynamicClient because DynamicClient runs API discovery on start-up and keeps a cache per
resource (slow and memory-hungry at 1,000 objects), while we only ever touch four fixed kinds.

Zero writes in steady state: before applying, the desired manifest is compared as a *subset* of
the live object (defaults added by the API server are ignored, quantities compared by value).
Only when something we own differs — a deleted child, a hand edit, a new spec — do we PATCH.

One apply per change, not one per event, and little kept in memory: every child carries the
digest of the manifest it was applied from (`ember.dev/spec-digest`), so an owner's reconcile
compares digests — not whole bodies — and the operator's index of children keeps only their
metadata and status. The applier also remembers what it last wrote or checked per child (digest,
generation, resourceVersion): watches lag our own writes, and an owner event that sees a stale
child must not re-apply what was just written. A change made by anyone else arrives as the
child's own watch event with its full body, and `correct` compares that (as a subset, see
above) and re-applies if it drifted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kubernetes
import orjson
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from ember_operator import metrics, quantity
from ember_operator.settings import FIELD_MANAGER

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KindInfo:
    prefix: str
    plural: str


KINDS: dict[str, KindInfo] = {
    "ConfigMap": KindInfo("/api/v1", "configmaps"),
    "Service": KindInfo("/api/v1", "services"),
    "Deployment": KindInfo("/apis/apps/v1", "deployments"),
    "PodDisruptionBudget": KindInfo("/apis/policy/v1", "poddisruptionbudgets"),
    # Per served namespace, not per object: the runtime's identity (see reconcile.ensure_identity).
    "ServiceAccount": KindInfo("/api/v1", "serviceaccounts"),
    "RoleBinding": KindInfo("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
}


def matches(desired: Any, live: Any) -> bool:
    """True when every field of `desired` has the same value in `live` (extra live fields ok)."""
    if isinstance(desired, Mapping):
        if not isinstance(live, Mapping):
            return False
        return all(k in live and matches(v, live[k]) for k, v in desired.items() if v is not None)
    if isinstance(desired, list):
        if not isinstance(live, list) or len(desired) != len(live):
            return False
        return all(matches(d, v) for d, v in zip(desired, live, strict=True))
    return quantity.same(desired, live)


def object_path(kind: str, namespace: str, name: str | None = None) -> str:
    info = KINDS[kind]
    path = f"{info.prefix}/namespaces/{namespace}/{info.plural}"
    return f"{path}/{name}" if name else path


ChildId = tuple[str, str, str]  # kind, namespace, name


DIGEST_ANNOTATION = "ember.dev/spec-digest"


@dataclass(frozen=True)
class Applied:
    """A child as we last wrote or verified it."""

    digest: str
    generation: int  # metadata.generation (0 for kinds without one)
    resource_version: str


def child_id(manifest: Mapping[str, Any]) -> ChildId:
    meta = manifest["metadata"]
    return manifest["kind"], meta["namespace"], meta["name"]


def stamp(manifest: dict[str, Any]) -> str:
    """Put the digest of `manifest` (as rendered, without the stamp) on it; return the digest."""
    meta = manifest["metadata"]
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items()}
    annotations.pop(DIGEST_ANNOTATION, None)
    unstamped = {**manifest, "metadata": {**meta, "annotations": annotations}}
    if not annotations:
        unstamped["metadata"].pop("annotations")
    text = json.dumps(unstamped, sort_keys=True).encode()
    value = hashlib.sha256(text).hexdigest()[:32]
    meta["annotations"] = {**annotations, DIGEST_ANNOTATION: value}
    return value


def digest_of(obj: Mapping[str, Any] | None) -> str | None:
    if obj is None:
        return None
    return ((obj.get("metadata") or {}).get("annotations") or {}).get(DIGEST_ANNOTATION)


def _versions(obj: Mapping[str, Any]) -> tuple[int, str]:
    meta = obj.get("metadata") or {}
    return int(meta.get("generation") or 0), str(meta.get("resourceVersion") or "")


def _owned(manifest: Mapping[str, Any]) -> dict[str, Any]:
    # apiVersion/kind are not part of listed items; everything else must match.
    return {k: v for k, v in manifest.items() if k not in ("apiVersion", "kind")}


class Applier:
    """The operator's writes to children, all through one field manager."""

    def __init__(self, api: ApiClient, timeout: float) -> None:
        self.api = api
        self.timeout = timeout
        self._applied: dict[ChildId, Applied] = {}
        self._lock = threading.Lock()

    def _call(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: list[tuple[str, str]] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        return request(
            self.api,
            method,
            path,
            body=body,
            query=query,
            content_type=content_type,
            timeout=self.timeout,
        )

    def apply(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply; force, because this operator is the controller of its children."""
        meta = manifest["metadata"]
        path = object_path(manifest["kind"], meta["namespace"], meta["name"])
        query = [("fieldManager", FIELD_MANAGER), ("force", "true")]
        result = self._call(
            "PATCH",
            path,
            # Serialized here, once (JSON is YAML): a dict would be walked by the client's
            # sanitizer and then encoded by the standard library.
            body=orjson.dumps(manifest),
            query=query,
            content_type="application/apply-patch+yaml",
        )
        metrics.API_WRITES.labels(kind=manifest["kind"], verb="apply").inc()
        log.info("applied %s %s/%s", manifest["kind"], meta["namespace"], meta["name"])
        self._remember(manifest, result)
        return result

    def _remember(self, manifest: Mapping[str, Any], live: Mapping[str, Any]) -> None:
        generation, version = _versions(live)
        with self._lock:
            self._applied[child_id(manifest)] = Applied(
                str(digest_of(manifest)), generation, version
            )

    def forget(self, ident: ChildId) -> None:
        """The child is gone (deleted, or its owner is): the next ensure must apply it."""
        with self._lock:
            self._applied.pop(ident, None)

    def delete(self, kind: str, namespace: str, name: str) -> None:
        self.forget((kind, namespace, name))
        try:
            self._call("DELETE", object_path(kind, namespace, name))
            metrics.API_WRITES.labels(kind=kind, verb="delete").inc()
        except ApiException as exc:
            if exc.status != 404:
                raise

    def in_sync(self, ident: ChildId, digest: str, live: Mapping[str, Any] | None) -> bool:
        """An owner's view: the child (from the index) carries this digest, or we just wrote
        it and the watch has not caught up. Hand edits that keep the digest are the child
        event's business (`correct`)."""
        if digest_of(live) == digest:
            return True
        with self._lock:
            last = self._applied.get(ident)
        return last is not None and last.digest == digest

    def verified(self, ident: ChildId, digest: str, live: Mapping[str, Any]) -> bool:
        """A child event that cannot be drift: the same object version we wrote or checked, or
        (kinds with a generation) only its status moved since."""
        with self._lock:
            last = self._applied.get(ident)
        if last is None or last.digest != digest or digest_of(live) != digest:
            return False
        generation, version = _versions(live)
        return version == last.resource_version or 0 < generation == last.generation

    def correct(self, manifest: Mapping[str, Any], live: Mapping[str, Any]) -> bool:
        """A child's own watch event: re-apply if its fresh body drifted from `manifest`. Events
        older than our last write (a lower generation) are skipped: the write supersedes them."""
        if matches(_owned(manifest), live):
            self._remember(manifest, live)
            return False
        with self._lock:
            last = self._applied.get(child_id(manifest))
        generation, _ = _versions(live)
        if last is not None and last.digest == digest_of(manifest) and generation < last.generation:
            return False
        self.apply(manifest)
        return True


# The API server's 403 for a create in a namespace that is being deleted (NamespaceLifecycle
# admission): the object goes with its namespace, so there is nothing to report or retry.
TERMINATING = "because it is being terminated"


def namespace_terminating(exc: ApiException) -> bool:
    """True for a write refused only because its namespace is being deleted."""
    return exc.status == 403 and TERMINATING in (exc.body or "")


def request(
    api: ApiClient,
    method: str,
    path: str,
    *,
    body: Any = None,  # a dict, or bytes already serialized (only for non-JSON content types)
    query: list[tuple[str, str]] | None = None,
    content_type: str = "application/json",
    timeout: float = 30.0,
) -> dict[str, Any]:
    """One API call through the client's auth and connection pool; JSON in, dict out."""
    serialized = api.param_serialize(
        method=method,
        resource_path=path,
        query_params=query or [],
        header_params={"Accept": "application/json", "Content-Type": content_type},
        body=body,
        auth_settings=["BearerToken"],
    )
    response = api.call_api(*serialized, _request_timeout=timeout)
    response.read()  # type: ignore[no-untyped-call]
    data: bytes = response.data or b""
    if not 200 <= response.status <= 299:
        raise ApiException.from_response(http_resp=response, body=data.decode(), data=None)
    return dict(orjson.loads(data)) if data else {}


def api_client() -> ApiClient:
    """In-cluster credentials when running in a pod, else the kubeconfig ($KUBECONFIG)."""
    config = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=config)
    except kubernetes.config.ConfigException:
        # Pass $KUBECONFIG explicitly: the library reads it once, at import time.
        kubernetes.config.load_kube_config(
            config_file=os.environ.get("KUBECONFIG"), client_configuration=config
        )
    config.connection_pool_maxsize = 16  # one per executor thread plus slack
    return ApiClient(config)
