"""Where the routes come from: a watch of the API server, or a static file.

`KubeDiscovery` lists and watches, with the gateway's own ServiceAccount token and read-only
verbs: the InferenceDeployments of its namespace (optionally a label selector), their runtime
pods, and with a site set the Nodes labelled `ember.dev/site=<site>` (a pod on another node is
another site's). It reads (`get`, no list) the API key Secret each InferenceDeployment names.
Every watch event rebuilds the routes (`routes.build`) and hands them to the fleet.

Offline: when the API server stops answering, the watches fail and are retried every few
seconds; the fleet keeps the last routes it was given, and its probes keep taking replicas out
and putting them back, so the site keeps serving for as long as the control plane is away.
With a `snapshot` file (the chart's: an in-memory emptyDir, which outlives a container restart
but not the pod), every change of the routes is written there, and a gateway that starts is
given those routes until its first list answers: a gateway restarted while the API server is
away still serves the site.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from ember_runtime.contract.cache import INSTANCE_LABEL
from ember_runtime.contract.resource import SITE_LABEL, collection_path
from ember_runtime.gateway import routes as routing
from ember_runtime.gateway.fleet import Fleet
from ember_runtime.gateway.metrics import GatewayMetrics
from ember_runtime.kube import API_ERRORS, KubeClient

log = logging.getLogger(__name__)
RETRY_SECONDS = 3.0


def static(path: Path) -> Callable[[Fleet, GatewayMetrics], Coroutine[Any, Any, None]]:
    async def run(fleet: Fleet, metrics: GatewayMetrics) -> None:
        fleet.update(routing.load_static(path))

    return run


class KubeDiscovery:
    def __init__(
        self,
        reader: KubeClient,
        namespace: str,
        selector: str = "",
        site: str = "",
        snapshot: Path | None = None,
    ) -> None:
        self.reader, self.namespace, self.selector, self.site = reader, namespace, selector, site
        self.snapshot, self._saved = snapshot, b""
        self.deployments: dict[str, dict[str, Any]] = {}
        self.pods: dict[str, dict[str, Any]] = {}
        self.nodes: dict[str, dict[str, Any]] = {}
        self.keys: dict[tuple[str, str, str], str] = {}
        self._dirty = asyncio.Event()

    async def run(self, fleet: Fleet, metrics: GatewayMetrics) -> None:
        watches = [
            self._watch(
                collection_path(self.namespace),
                {"labelSelector": self.selector} if self.selector else {},
                self.deployments,
            ),
            self._watch(
                f"/api/v1/namespaces/{self.namespace}/pods",
                {"labelSelector": INSTANCE_LABEL},
                self.pods,
            ),
        ]
        if self.site:
            watches.append(
                self._watch(
                    "/api/v1/nodes", {"labelSelector": f"{SITE_LABEL}={self.site}"}, self.nodes
                )
            )
        self._restore(fleet)
        tasks = [asyncio.create_task(w) for w in watches]
        try:
            while True:
                await self._dirty.wait()
                self._dirty.clear()
                await self._read_keys()
                self._publish(fleet, metrics)
        finally:
            for task in tasks:
                task.cancel()

    def _publish(self, fleet: Fleet, metrics: GatewayMetrics) -> None:
        nodes = frozenset(n["metadata"]["name"] for n in self.nodes.values()) if self.site else None
        served, conflicts = routing.build(
            self.deployments.values(), self.pods.values(), self.keys, nodes
        )
        for c in conflicts:
            log.warning(
                "model %s: %s serves it already; %s is not routed", c.model, c.kept, c.refused
            )
        metrics.conflicts.set(len(conflicts))
        fleet.update(served)
        self._save(served)

    def _restore(self, fleet: Fleet) -> None:
        if self.snapshot is None or not self.snapshot.exists():
            return
        try:
            self._saved = self.snapshot.read_bytes()
            routes = routing.loads(self._saved)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning(
                "the routes snapshot %s is unreadable (%s): starting empty", self.snapshot, exc
            )
            return
        fleet.update(routes)
        log.info(
            "serving %d models from %s until the API server answers", len(routes), self.snapshot
        )

    def _save(self, served: dict[str, routing.ModelRoute]) -> None:
        """On change only: a watch event that moves nothing writes nothing."""
        if self.snapshot is None or (data := routing.dumps(served)) == self._saved:
            return
        try:
            routing.save_snapshot(self.snapshot, data)
            self._saved = data
        except OSError as exc:
            log.warning("writing the routes snapshot %s: %s", self.snapshot, exc)

    async def _read_keys(self) -> None:
        """The API key of every InferenceDeployment, read again on each change (a rotated key
        takes effect with the object's next event or the watch's next resync)."""
        wanted = {ref for d in self.deployments.values() if (ref := routing.key_ref(d))}
        for ref in wanted:
            namespace, name, key = ref
            try:
                secret = await self.reader.get(f"/api/v1/namespaces/{namespace}/secrets/{name}")
                value = base64.b64decode((secret.get("data") or {}).get(key, "")).decode().strip()
            except (*API_ERRORS, binascii.Error, UnicodeDecodeError) as exc:
                # keep the key we had: an unreachable API server is not "no key"
                log.warning("reading the API key %s/%s: %s", namespace, name, exc)
                continue
            if value:
                self.keys[ref] = value
            else:
                log.warning("Secret %s/%s has no key %s: model not routed", namespace, name, key)
                self.keys.pop(ref, None)
        for ref in set(self.keys) - wanted:
            del self.keys[ref]

    async def _watch(
        self, path: str, params: dict[str, str], into: dict[str, dict[str, Any]]
    ) -> None:
        """List, then watch from the list's version; on any failure keep `into` as it is (the
        last known state) and list again after RETRY_SECONDS."""
        while True:
            try:
                listed = await self.reader.get(path, params)
                into.clear()
                into.update({routing.ident(o): o for o in listed["items"]})
                self._dirty.set()
                version: str | None = listed["metadata"]["resourceVersion"]
                while version is not None:
                    version = await self._watch_once(
                        path, {**params, "resourceVersion": version}, into
                    )
            except API_ERRORS as exc:
                log.warning("watching %s: %s; the last known state keeps serving", path, exc)
                await asyncio.sleep(RETRY_SECONDS)

    async def _watch_once(
        self, path: str, params: dict[str, str], into: dict[str, dict[str, Any]]
    ) -> str | None:
        version = params["resourceVersion"]
        async for event in self.reader.watch(path, {**params, "allowWatchBookmarks": "true"}):
            kind, obj = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                return None  # 410 Gone: list again
            version = (obj.get("metadata") or {}).get("resourceVersion", version)
            if kind == "DELETED":
                into.pop(routing.ident(obj), None)
            elif kind in ("ADDED", "MODIFIED"):
                into[routing.ident(obj)] = obj
            else:
                continue
            self._dirty.set()
        return version
