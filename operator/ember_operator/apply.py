"""Server-side apply of child manifests, skipped when the live object already matches.

Why the `kubernetes` client, sync, in Kopf's threaded handlers: it is the client the design names,
its ApiClient carries kubeconfig/in-cluster auth without extra code, and the sync handlers run in
Kopf's thread pool so they never block the event loop. We call the generic `call_api` rather than
DynamicClient because DynamicClient runs API discovery on start-up and keeps a cache per
resource (slow and memory-hungry at 1,000 objects), while we only ever touch four fixed kinds.

Zero writes in steady state: before applying, the desired manifest is compared as a *subset* of
the live object (defaults added by the API server are ignored, quantities compared by value).
Only when something we own differs — a deleted child, a hand edit, a new spec — do we PATCH.

One apply per change, not one per event: the live objects come from watches, which lag our own
writes, so `ensure` also remembers what it last applied to each child (a digest of the manifest
and the generation the API server gave it). An owner event that sees a stale child does not
re-apply what was just written; a change made by anyone else arrives as the child's own watch
event, and `correct` compares that fresh body and re-applies if it drifted.
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


@dataclass(frozen=True)
class Applied:
    digest: str
    generation: int  # metadata.generation the write produced (0 for kinds without one)


def child_id(manifest: Mapping[str, Any]) -> ChildId:
    meta = manifest["metadata"]
    return manifest["kind"], meta["namespace"], meta["name"]


def digest(manifest: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:32]


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
            body=json.loads(json.dumps(manifest)),
            query=query,
            content_type="application/apply-patch+yaml",
        )
        metrics.API_WRITES.labels(kind=manifest["kind"], verb="apply").inc()
        log.info("applied %s %s/%s", manifest["kind"], meta["namespace"], meta["name"])
        generation = int((result.get("metadata") or {}).get("generation") or 0)
        with self._lock:
            self._applied[child_id(manifest)] = Applied(digest(manifest), generation)
        return result

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

    def ensure(
        self, desired: list[dict[str, Any]], live: Mapping[str, Mapping[str, Any] | None]
    ) -> dict[str, dict[str, Any]]:
        """Apply each manifest whose live counterpart (by kind, from a watch) differs, unless this
        exact manifest is what we last wrote there; return what was written."""
        written: dict[str, dict[str, Any]] = {}
        for manifest in desired:
            current = live.get(manifest["kind"])
            if current is not None and matches(_owned(manifest), current):
                continue
            with self._lock:
                last = self._applied.get(child_id(manifest))
            if last is not None and last.digest == digest(manifest):
                continue  # our write is on its way through the watch
            written[manifest["kind"]] = self.apply(manifest)
        return written

    def correct(self, manifest: Mapping[str, Any], live: Mapping[str, Any]) -> bool:
        """A child's own watch event: re-apply if its fresh body drifted from `manifest`. Events
        older than our last write (a lower generation) are skipped: the write supersedes them."""
        if matches(_owned(manifest), live):
            return False
        with self._lock:
            last = self._applied.get(child_id(manifest))
        generation = int((live.get("metadata") or {}).get("generation") or 0)
        if last is not None and last.digest == digest(manifest) and generation < last.generation:
            return False
        self.apply(manifest)
        return True


def request(
    api: ApiClient,
    method: str,
    path: str,
    *,
    body: Any = None,
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
    text = response.data.decode() if response.data else ""
    if not 200 <= response.status <= 299:
        raise ApiException.from_response(http_resp=response, body=text, data=None)
    return dict(json.loads(text)) if text else {}


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
