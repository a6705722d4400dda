"""Plain-dict access to the API server for the tests (the generated client's typed models are
all-Optional, which buries assertions in None checks)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

from ember_operator.apply import request
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException
from pydantic.alias_generators import to_camel

__all__ = [
    "condition",
    "count_writes",
    "create",
    "delete",
    "get",
    "items",
    "merge_patch",
    "path",
    "request",
    "true_condition",
    "watch",
]

INFD = "/apis/ember.dev/v1alpha1/namespaces/{ns}/inferencedeployments"
PATHS = {
    "infd": INFD,
    "deployments": "/apis/apps/v1/namespaces/{ns}/deployments",
    "replicasets": "/apis/apps/v1/namespaces/{ns}/replicasets",
    "services": "/api/v1/namespaces/{ns}/services",
    "configmaps": "/api/v1/namespaces/{ns}/configmaps",
    "pdbs": "/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets",
    "pods": "/api/v1/namespaces/{ns}/pods",
    "events": "/api/v1/namespaces/{ns}/events",
}


def path(kind: str, ns: str, name: str = "") -> str:
    base = PATHS[kind].format(ns=ns)
    return f"{base}/{name}" if name else base


def get(api: ApiClient, kind: str, ns: str, name: str) -> dict[str, Any] | None:
    try:
        return request(api, "GET", path(kind, ns, name))
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def items(api: ApiClient, kind: str, ns: str, **query: str) -> list[dict[str, Any]]:
    params = [(to_camel(k), v) for k, v in query.items()]  # label_selector → labelSelector
    listing = request(api, "GET", path(kind, ns), query=params)
    return list(listing.get("items") or [])


def create(api: ApiClient, kind: str, ns: str, body: dict[str, Any]) -> dict[str, Any]:
    return request(api, "POST", path(kind, ns), body=body)


def delete(api: ApiClient, kind: str, ns: str, name: str, **query: str) -> None:
    params = [(k, v) for k, v in query.items()]
    request(api, "DELETE", path(kind, ns, name), query=params)


def condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    """`obj`'s status condition of type `kind`, whatever its status; {} when it has none."""
    conds = ((obj or {}).get("status") or {}).get("conditions") or []
    return next((c for c in conds if c["type"] == kind), {})


def true_condition(api: ApiClient, ns: str, name: str, kind: str) -> dict[str, Any] | None:
    """The InferenceDeployment's condition `kind` while it is True, else None (a wait probe)."""
    found = condition(get(api, "infd", ns, name), kind)
    return found if found.get("status") == "True" else None


def merge_patch(api: ApiClient, kind: str, ns: str, name: str, body: dict[str, Any]) -> None:
    request(
        api, "PATCH", path(kind, ns, name), body=body, content_type="application/merge-patch+json"
    )


def _lines(api: ApiClient, url_path: str, rv: str, seconds: int) -> Iterator[dict[str, Any]]:
    serialized = api.param_serialize(
        method="GET",
        resource_path=url_path,
        query_params=[("watch", "1"), ("resourceVersion", rv), ("timeoutSeconds", str(seconds))],
        header_params={"Accept": "application/json"},
        auth_settings=["BearerToken"],
    )
    response = api.call_api(*serialized, _request_timeout=seconds + 15)
    buffer = b""
    for chunk in response.response.stream(4096):
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            if line.strip():
                yield json.loads(line)


def watch(api: ApiClient, kind: str, ns: str, seconds: int) -> Iterator[dict[str, Any]]:
    """Events of `kind` in `ns` from now on, for `seconds` (the server ends the watch)."""
    rv = request(api, "GET", path(kind, ns))["metadata"]["resourceVersion"]
    yield from _lines(api, path(kind, ns), rv, seconds)


def count_writes(
    api: ApiClient, ns: str, kinds: list[str], seconds: int, sink: list[str] | None = None
) -> list[str]:
    """Every ADDED/MODIFIED/DELETED of `kinds` in `ns` during `seconds`: each is one write that
    bumped a resourceVersion (no-op requests never reach a watch). `sink` fills as events come."""
    seen: list[str] = [] if sink is None else sink
    lock = threading.Lock()

    def follow(kind: str) -> None:
        for event in watch(api, kind, ns, seconds):
            name = event["object"].get("metadata", {}).get("name")
            with lock:
                seen.append(f"{event['type']} {kind}/{name}")

    threads = [threading.Thread(target=follow, args=(k,)) for k in kinds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 30)
    return seen


def fail_prewarm(api: ApiClient, ns: str, pod: str, message: str, restarts: int = 3) -> None:
    """A prewarm failure as the kubelet reports it, written to the pod's status subresource
    (kwok nodes have no kubelet): `message` is the line the prewarm container writes."""
    failed = {
        "name": "prewarm",
        "image": "x",
        "imageID": "",
        "ready": False,
        "restartCount": restarts,
        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": message}},
    }
    request(
        api,
        "PATCH",
        f"{path('pods', ns, pod)}/status",
        body={"status": {"initContainerStatuses": [failed]}},
        content_type="application/strategic-merge-patch+json",
    )
