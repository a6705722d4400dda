"""The node side's one Kubernetes client (the runtime's pod condition, the node agent's reads,
watches, writes and node condition): GETs, watches and writes over httpx with the process's own
ServiceAccount token.

Why not the `kubernetes` package: the node side makes a handful of requests, and this keeps its
token handling explicit — the projected ServiceAccount token is re-read on every request,
because the kubelet rotates it (bound tokens expire; the file is replaced before they do).

Why a strategic-merge patch: `status.conditions` of Pods and Nodes merges by `type`, so the patch
adds or replaces Ember's condition and leaves the kubelet's (Ready, PodScheduled, …) alone. A JSON
merge patch would replace the whole list.

Edge control planes: a pod on a KubeEdge or OpenYurt node reaches the API server through its
node's proxy (MetaServer, YurtHub), which `KUBERNETES_SERVICE_HOST/PORT` point at there.
"""

from __future__ import annotations

import json
import os
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# Where the token and CA are, if not in a pod's usual place (a runtime run by hand on a node).
SA_DIR_ENV = "EMBER_SERVICEACCOUNT_DIR"
STRATEGIC_MERGE = "application/strategic-merge-patch+json"
MERGE_PATCH = "application/merge-patch+json"
WATCH_SECONDS = 300  # the API server ends a watch after this; the caller starts the next one


class ApiError(Exception):
    """The API server answered, with an error status; `status` says which."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text[:300]}")
        self.status = status


# What a caller treats as "the API server is not there for us": it answered with an error
# (a 403 from a misconfigured policy included), did not answer at all, or answered nonsense.
API_ERRORS = (ApiError, httpx.HTTPError, ValueError, KeyError)


@dataclass(frozen=True)
class Endpoint:
    server: str  # https://host:port
    token_file: Path
    ca_file: Path | None

    @classmethod
    def in_cluster(cls) -> Endpoint:
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise RuntimeError("not in a pod: KUBERNETES_SERVICE_HOST is not set")
        host = f"[{host}]" if ":" in host else host  # IPv6 literal
        sa_dir = Path(os.environ.get(SA_DIR_ENV) or SA_DIR)
        return cls(f"https://{host}:{port}", sa_dir / "token", sa_dir / "ca.crt")


def pod_status_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{namespace}/pods/{name}/status"


def node_status_path(name: str) -> str:
    return f"/api/v1/nodes/{name}/status"


class KubeClient:
    """GETs, watches and writes with the process's own token (re-read each time: the kubelet
    rotates it). `timeout` bounds connecting and each request; with `watches`, a read may stay
    quiet for up to `WATCH_SECONDS` (then the API server ends the watch)."""

    def __init__(self, endpoint: Endpoint, timeout: float = 10.0, *, watches: bool = True) -> None:
        self._endpoint = endpoint
        verify: ssl.SSLContext | bool = True
        if endpoint.ca_file is not None:
            verify = ssl.create_default_context(cafile=str(endpoint.ca_file))
        timeout_cfg = httpx.Timeout(timeout, read=WATCH_SECONDS + 30 if watches else timeout)
        self._http = httpx.AsyncClient(base_url=endpoint.server, verify=verify, timeout=timeout_cfg)

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._endpoint.token_file.read_text().strip()}"}

    async def get(self, path: str, params: dict[str, str] | None = None) -> dict[str, Any]:
        resp = await self._http.get(path, params=params, headers=self._auth())
        if resp.status_code >= 300:
            raise ApiError(resp.status_code, resp.text)
        data: dict[str, Any] = resp.json()
        return data

    async def _request(
        self, method: str, path: str, body: dict[str, Any], content_type: str
    ) -> httpx.Response:
        headers = {**self._auth(), "Content-Type": content_type}
        resp = await self._http.request(method, path, content=json.dumps(body), headers=headers)
        if resp.status_code >= 300:
            raise ApiError(resp.status_code, resp.text)
        return resp

    async def send(
        self, method: str, path: str, body: dict[str, Any], content_type: str = "application/json"
    ) -> dict[str, Any]:
        """POST/PUT/PATCH one object; the API server's answer (the object as stored)."""
        data: dict[str, Any] = (await self._request(method, path, body, content_type)).json()
        return data

    async def patch(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """A JSON merge patch (RFC 7386): the fields in `body` replace the stored ones (the
        gateway's `{"spec": {"replicas": n}}` to a scale subresource)."""
        return await self.send("PATCH", path, body, MERGE_PATCH)

    async def patch_condition(self, path: str, condition: dict[str, Any]) -> None:
        """One condition into `path`'s `status.conditions`, merged by type (see above)."""
        body = {"status": {"conditions": [condition]}}
        await self._request("PATCH", path, body, STRATEGIC_MERGE)

    async def watch(self, path: str, params: dict[str, str]) -> AsyncIterator[dict[str, Any]]:
        query = {**params, "watch": "true", "timeoutSeconds": str(WATCH_SECONDS)}
        async with self._http.stream("GET", path, params=query, headers=self._auth()) as resp:
            if resp.status_code >= 300:
                raise ApiError(resp.status_code, (await resp.aread()).decode(errors="replace"))
            async for line in resp.aiter_lines():
                if line.strip():
                    yield json.loads(line)

    async def aclose(self) -> None:
        await self._http.aclose()


class ConditionPatcher:
    """Patches one object's `status.conditions` with one condition (merged by type): the
    `reporter`'s writer, for a pod (the runtime) or a node (the node agent)."""

    def __init__(self, endpoint: Endpoint, path: str, timeout: float = 5.0) -> None:
        self._client, self._path = KubeClient(endpoint, timeout, watches=False), path

    async def write(self, condition: dict[str, Any]) -> None:
        await self._client.patch_condition(self._path, condition)

    async def aclose(self) -> None:
        await self._client.aclose()
