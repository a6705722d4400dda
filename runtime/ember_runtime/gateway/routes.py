"""What the gateway serves, as data: model name → its replicas and its API key.

`build` is pure: the InferenceDeployments, their pods, the site's node names and the API keys
read from Secrets go in; the routes and the conflicts come out. Kubernetes discovery
(`discovery.KubeDiscovery`) and a static file (`load_static`, a site without an API server or a
test) both end here.

Two InferenceDeployments serving one model name: the older one (creationTimestamp, then
namespace/name) keeps the name; the other is reported as a conflict (a log line and the
`ember_gateway_model_conflicts` gauge) and serves nothing through the gateway. A union would
mix two API keys and two engine configurations under one name; adding a second object must not
change where the first one's traffic goes.

Adapters: each `spec.adapters[].name` is a route of its own to the base's replicas, API key
and owner (the body's `model` is forwarded unchanged: the runtime serves the adapter by that
name). Adapter names take part in the conflict rule exactly as model names do.

Scaling: a route of an InferenceDeployment with `spec.scaling` carries that view and what the
scaler needs beside it (`spec.replicas`, the in-flight target, the priority); `scaling` None
means the gateway neither holds its requests nor scales it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ember_runtime.contract.cache import INSTANCE_LABEL
from ember_runtime.contract.resource import ScalingView, SpecView, read_spec
from ember_runtime.durable import replace_file

log = logging.getLogger(__name__)
SNAPSHOT_VERSION = "ember.dev/gateway-routes.v2"


@dataclass(frozen=True, slots=True)
class Backend:
    key: str  # namespace/pod (or the URL, for a static replica)
    url: str  # http://podIP:port


@dataclass(frozen=True, slots=True)
class ModelRoute:
    name: str  # the served model name (OpenAI `model`)
    owner: str  # namespace/name of the InferenceDeployment
    api_key: str | None  # what clients must present, and what the gateway sends its replicas
    backends: tuple[Backend, ...]
    scaling: ScalingView | None = None  # None: not scaled by the gateway, requests not held
    replicas: int = 1  # spec.replicas as last seen (what the scaler compares against)
    target_in_flight: int = 1  # requests one replica takes (scaling's, else maxBatchSize)
    priority: int = 0  # scaling.priority: who may be swapped out for whom
    # Live state, neither saved in a snapshot nor part of what a route is (compared):
    # a pod of it waits for room (PodScheduled=False, Unschedulable);
    unschedulable: bool = dataclasses.field(default=False, compare=False)
    # its pods that exist, terminating and pending ones too (a victim's memory is free only
    # once its pod is gone).
    pods: int = dataclasses.field(default=0, compare=False)


@dataclass(frozen=True, slots=True)
class Conflict:
    model: str
    kept: str
    refused: str


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    meta: Mapping[str, Any] = obj.get("metadata") or {}
    return meta


def ident(obj: Mapping[str, Any]) -> str:
    meta = _meta(obj)
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def key_ref(obj: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """(namespace, Secret name, key) of an InferenceDeployment's API key, if it has one (an
    unreadable spec has none: it is not routed at all, and `build` says why)."""
    try:
        return _key_ref(obj, read_spec(obj))
    except ValueError:
        return None


def _key_ref(obj: Mapping[str, Any], spec: SpecView) -> tuple[str, str, str] | None:
    ref = spec.server.api_key_secret_ref
    return None if ref is None else (str(_meta(obj).get("namespace", "")), ref.name, ref.key)


def _reachable(pod: Mapping[str, Any]) -> bool:
    """It has an address and is not terminating (its runtime drains: no new work)."""
    return not _meta(pod).get("deletionTimestamp") and bool((pod.get("status") or {}).get("podIP"))


def pod_ready(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    return ready and _reachable(pod)


def unschedulable(pod: Mapping[str, Any]) -> bool:
    """Pending because no node has room: requests == limits (the operator's sizing), so the
    scheduler, not an OOM kill, is what says a model does not fit."""
    status = pod.get("status") or {}
    if status.get("phase") != "Pending" or _meta(pod).get("deletionTimestamp"):
        return False
    return any(
        c.get("type") == "PodScheduled" and c.get("status") == "False"
        and c.get("reason") == "Unschedulable"
        for c in status.get("conditions") or []
    )  # fmt: skip


def _owned(deployment: Mapping[str, Any], pods: Iterable[Mapping[str, Any]]) -> list[Any]:
    namespace, name = _meta(deployment).get("namespace"), _meta(deployment).get("name")
    return [
        pod
        for pod in pods
        if _meta(pod).get("namespace") == namespace
        and (_meta(pod).get("labels") or {}).get(INSTANCE_LABEL) == name
    ]


def runtime_running(pod: Mapping[str, Any]) -> bool:
    """Its runtime container runs (Ready or not yet), it has an IP and is not terminating. The
    runtime listens only once its engine is loaded (its lifespan runs before the socket opens)
    and reports `draining` in its admin state, so the gateway's own probe answering is what the
    kubelet's readiness probe would say, a probe period and a status write sooner."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    running = any(
        c.get("name") == "runtime" and (c.get("state") or {}).get("running") for c in statuses
    )
    return running and _reachable(pod)


def _backends(
    deployment: Mapping[str, Any],
    port: int,
    pods: Iterable[Mapping[str, Any]],
    nodes: frozenset[str] | None,
    *,
    early: bool = False,
) -> tuple[Backend, ...]:
    """Ready pods of the site; with `early` (a scaled model: requests may be held for it) also
    those whose runtime runs but is not Ready yet, routed once the gateway's probe answers
    (`runtime_running`): a replica woken from zero serves its held requests without waiting
    for the kubelet's next readiness probe and status write."""
    namespace = _meta(deployment).get("namespace")
    out = []
    for pod in pods:
        meta = _meta(pod)
        if nodes is not None and (pod.get("spec") or {}).get("nodeName") not in nodes:
            continue  # another site's replica: across the WAN, not ours to route to
        if pod_ready(pod) or (early and runtime_running(pod)):
            ip = pod["status"]["podIP"]
            host = f"[{ip}]" if ":" in ip else ip
            out.append(Backend(f"{namespace}/{meta.get('name')}", f"http://{host}:{port}"))
    return tuple(sorted(out, key=lambda b: b.key))


def build(
    deployments: Iterable[Mapping[str, Any]],
    pods: Iterable[Mapping[str, Any]],
    keys: Mapping[tuple[str, str, str], str],
    nodes: frozenset[str] | None = None,
) -> tuple[dict[str, ModelRoute], list[Conflict]]:
    """`keys`: the API keys read so far, by `key_ref`. A deployment whose key has not been read
    is left out (serving it open would skip its authentication)."""
    pods = list(pods)
    routes: dict[str, ModelRoute] = {}
    conflicts: list[Conflict] = []
    ordered = sorted(
        deployments, key=lambda d: (str(_meta(d).get("creationTimestamp", "")), ident(d))
    )
    for deployment in ordered:
        try:
            spec = read_spec(deployment)  # the fields the gateway reads (contract.resource)
        except ValueError as exc:  # a spec the CRD would not have accepted
            log.warning("%s: unreadable spec, not routed: %s", ident(deployment), exc)
            continue
        ref = _key_ref(deployment, spec)
        if ref is not None and ref not in keys:
            continue
        api_key = keys[ref] if ref is not None else None
        base = _route(deployment, spec, api_key, _owned(deployment, pods), nodes)
        for name in [spec.model.name, *(a.name for a in spec.adapters)]:
            if name in routes:
                conflicts.append(Conflict(name, routes[name].owner, ident(deployment)))
            else:
                routes[name] = dataclasses.replace(base, name=name)
    return routes, conflicts


def _route(
    deployment: Mapping[str, Any],
    spec: SpecView,
    api_key: str | None,
    pods: list[Any],
    nodes: frozenset[str] | None,
) -> ModelRoute:
    """The base model's route; its adapters' routes differ only by name."""
    scaling = spec.scaling
    target = scaling.target_in_flight if scaling else None
    return ModelRoute(
        spec.model.name,
        ident(deployment),
        api_key,
        _backends(deployment, spec.server.port, pods, nodes, early=scaling is not None),
        scaling=scaling,
        replicas=spec.replicas,
        target_in_flight=target or spec.engine.max_batch_size,
        priority=scaling.priority if scaling else 0,
        unschedulable=scaling is not None and any(unschedulable(p) for p in pods),
        pods=len(pods),
    )


def load_static(path: Path) -> dict[str, ModelRoute]:
    """A JSON file: {"models": [{"name", "apiKeyFile"?, "replicas": [url, ...]}]}."""
    data = json.loads(path.read_text())
    routes: dict[str, ModelRoute] = {}
    for entry in data["models"]:
        name = str(entry["name"])
        if name in routes:
            raise ValueError(f"{path}: model {name!r} is listed twice")
        key_file = entry.get("apiKeyFile")
        api_key = Path(key_file).read_text().strip() if key_file else None
        if key_file and not api_key:
            raise ValueError(f"{path}: the API key file {key_file} is empty")
        backends = tuple(Backend(str(url), str(url).rstrip("/")) for url in entry["replicas"])
        routes[name] = ModelRoute(name, f"static/{name}", api_key, backends)
    return routes


def dumps(routes: Mapping[str, ModelRoute]) -> bytes:
    """The last known routes as a snapshot (`loads` reads it back)."""
    models = [
        {
            "name": r.name,
            "owner": r.owner,
            "apiKey": r.api_key,
            "backends": [{"key": b.key, "url": b.url} for b in r.backends],
            "scaling": r.scaling.model_dump(by_alias=True) if r.scaling else None,
            "replicas": r.replicas,
            "targetInFlight": r.target_in_flight,
            "priority": r.priority,
        }
        for r in sorted(routes.values(), key=lambda r: r.name)
    ]
    return json.dumps({"version": SNAPSHOT_VERSION, "models": models}, indent=1).encode()


def loads(data: bytes) -> dict[str, ModelRoute]:
    doc = json.loads(data)
    if doc.get("version") != SNAPSHOT_VERSION:
        raise ValueError(f"not a {SNAPSHOT_VERSION} snapshot: {doc.get('version')!r}")
    routes: dict[str, ModelRoute] = {}
    for m in doc["models"]:
        backends = tuple(Backend(str(b["key"]), str(b["url"])) for b in m["backends"])
        key, scaling = m.get("apiKey"), m.get("scaling")
        routes[str(m["name"])] = ModelRoute(
            str(m["name"]),
            str(m["owner"]),
            str(key) if key else None,
            backends,
            scaling=ScalingView.model_validate(scaling) if scaling is not None else None,
            replicas=int(m["replicas"]),
            target_in_flight=int(m["targetInFlight"]),
            priority=int(m["priority"]),
        )
    return routes


def save_snapshot(path: Path, data: bytes) -> None:
    """Owner-only: it holds API keys."""
    replace_file(path, data, 0o600)
