"""Labels on the agent's own Node that say which models its cache holds, for the scheduler.

For every complete file under `sha256/`, the Node carries `cache.ember.dev/<digest16>: "true"`
(`ember_runtime.contract.cache.cache_label`); the operator gives http-sourced pods a *preferred*
nodeAffinity term for it, so a replica that is rescheduled, added or rolled lands where its
model already is. A label, not the `ember.dev/cache` annotation site sharing writes, because
node affinity matches labels only; and on every node, site or none.

Written like the annotations: a merge patch of only what changed (set the new digests, null the
ones gone), when the cache changes (the fetcher says so) or a periodic look at the cache finds
a difference (a file removed by hand: no API call otherwise); the Node is read again now and
then, so a label someone else removed comes back. The chart's admission policy lets the
agent's token set only this prefix, only to "true", only on its own Node.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import suppress

from ember_runtime.contract.cache import CACHE_LABEL_PREFIX, cache_label
from ember_runtime.kube import API_ERRORS, ApiError
from ember_runtime.nodeagent.cache import ContentCache
from ember_runtime.nodeagent.site import MERGE_PATCH, Api

log = logging.getLogger("ember_runtime.nodeagent.labels")

HELD = "true"
RETRY_SECONDS = 5.0  # after a transient API error (unreachable, 5xx, 409)


def _refused(err: Exception) -> bool:
    return isinstance(err, ApiError) and err.status == 403


def label_patch(current: dict[str, str], desired: dict[str, str]) -> dict[str, str | None]:
    """The merge patch from `current` to `desired` (cache labels only): None deletes."""
    patch: dict[str, str | None] = {k: v for k, v in desired.items() if current.get(k) != v}
    patch.update({k: None for k in current if k not in desired})
    return patch


class CacheLabels:
    def __init__(
        self,
        cache: ContentCache,
        api: Api,
        node: str,
        *,
        resync_seconds: float = 60.0,
        reread_seconds: float = 600.0,
    ) -> None:
        self.cache, self.api, self.node = cache, api, node
        self.resync_seconds, self.reread_seconds = resync_seconds, reread_seconds
        self._dirty = asyncio.Event()
        self.writes = 0

    def changed(self) -> None:
        """The cache changed: bring the labels up to date (soon, once)."""
        self._dirty.set()

    def desired(self) -> dict[str, str]:
        return {cache_label(sha): HELD for sha in self.cache.held()}

    async def _read(self) -> dict[str, str]:
        node = await self.api.get(f"/api/v1/nodes/{self.node}")
        labels = (node.get("metadata") or {}).get("labels") or {}
        return {k: str(v) for k, v in labels.items() if k.startswith(CACHE_LABEL_PREFIX)}

    async def run(self) -> None:
        """Keep the labels in step with the cache until cancelled; retry while the API is away."""
        current: dict[str, str] | None = None  # what the Node carries, as last read or written
        read_at = 0.0
        while True:
            self._dirty.clear()  # before reading the cache: a later change sets it again
            try:
                if current is None or time.monotonic() - read_at >= self.reread_seconds:
                    current, read_at = await self._read(), time.monotonic()
                desired = self.desired()
                if patch := label_patch(current, desired):
                    body = {"metadata": {"labels": patch}}
                    await self.api.send("PATCH", f"/api/v1/nodes/{self.node}", body, MERGE_PATCH)
                    self.writes += 1
                    log.info("cache labels on %s: %s", self.node, sorted(desired) or "none")
                    current = desired
            except API_ERRORS as err:
                # A refusal (403: RBAC or the own-node policy, e.g. a token not bound to a pod
                # on this node) will not change in 5 s: try again at the resync pace, so a
                # misconfigured fleet does not send two requests per node every 5 s forever.
                pause = self.resync_seconds if _refused(err) else RETRY_SECONDS
                log.warning(
                    "labelling %s with its cache: %s; again in %.0fs", self.node, err, pause
                )
                current = None  # read again: the write may or may not have landed
                await asyncio.sleep(pause)
                continue
            # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a cancellation
            # that lands as the event is set, and the agent's shutdown then waits forever.
            with suppress(TimeoutError):
                async with asyncio.timeout(self.resync_seconds):
                    await self._dirty.wait()
