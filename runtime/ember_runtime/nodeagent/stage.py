"""A rollout's stage requests, read from the agent's own Node only.

Before a site's pods change, the operator annotates the site's Nodes
`stage.ember.dev/<16 hex>: "<namespace>/<name>"` (`contract.rollout.stage_annotation`). The agent
watches its own Node, and nothing else, for them (`fieldSelector=metadata.name=<node>`: another
node's annotations never reach it, whatever they say) and hands the set it last saw to the
Fetcher, which treats each request like a pod's claim: a place to look, never what to fetch.
`contract.rollout.stage_requests` drops a value that is not two object names or whose key does
not match it. The evictor reads the same annotations afresh on each pass (`evict.staged_on_node`):
it does not depend on this watch having caught up.

A watch of its own, not the site watch's view: site sharing may be off, or the node of no site,
and the requests must be seen either way. A removed annotation is a MODIFIED event whose object
no longer carries it (a deleted Node: no requests at all), so removal needs no bookkeeping beyond
comparing sets.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from ember_runtime.contract.rollout import stage_requests
from ember_runtime.kube import API_ERRORS, ApiError
from ember_runtime.nodeagent.site import Api

log = logging.getLogger("ember_runtime.nodeagent.stage")

StageKey = tuple[str, str]  # (namespace, name) of the InferenceDeployment to stage
StageSink = Callable[[frozenset[StageKey]], Awaitable[None]]  # Fetcher.stage
RETRY_SECONDS = 5.0
REFUSED_SECONDS = 60.0  # a 403 (RBAC, e.g. a chart from before this watch) will not pass soon


def requests_of(node: dict[str, Any] | None) -> frozenset[StageKey]:
    """The stage requests a Node object carries (none for a missing Node)."""
    annotations = ((node or {}).get("metadata") or {}).get("annotations")
    return frozenset(stage_requests(annotations))


async def watch_own_node(api: Api, node: str, sink: StageSink) -> None:
    """Until cancelled: list the own Node, then watch it; every event's requests go to `sink`
    (which ignores an unchanged set). While the API server is away the last set stands."""
    params = {"fieldSelector": f"metadata.name={node}"}
    while True:
        try:
            listed = await api.get("/api/v1/nodes", params)
            items = listed.get("items") or []
            await sink(requests_of(items[0] if items else None))
            version: str | None = listed["metadata"]["resourceVersion"]
            while version is not None:
                version = await _watch_once(api, params, version, sink)
        except API_ERRORS as err:
            refused = isinstance(err, ApiError) and err.status == 403
            pause = REFUSED_SECONDS if refused else RETRY_SECONDS
            log.warning("watching %s's stage requests: %s; again in %.0fs", node, err, pause)
            await asyncio.sleep(pause)


async def _watch_once(
    api: Api, params: dict[str, str], version: str, sink: StageSink
) -> str | None:
    """Apply one watch's events; the version to resume from, or None to list again."""
    async for event in api.watch("/api/v1/nodes", {**params, "resourceVersion": version}):
        kind = event.get("type")
        if kind == "ERROR":  # e.g. 410 Gone: the version is too old
            return None
        obj = event.get("object") or {}
        version = (obj.get("metadata") or {}).get("resourceVersion", version)
        await sink(frozenset() if kind == "DELETED" else requests_of(obj))
    return version
