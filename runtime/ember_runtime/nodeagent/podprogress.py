"""A waiting replica's download progress, live on its pod: the `ember.dev/ModelDownload` condition.

Prewarm waits for the cache with no API credentials (it runs the replica author's image), and
its only way to the status, the termination message, needs it to exit. The agent, which does
the download, knows the bytes and the rate itself: every `tick_seconds` it lists the pods bound
to its node (from the API server's watch cache), and for each pod whose files are not all in
the cache it writes the pod's condition at once (the first pass that sees it waiting) and then
every `every_seconds`:

    status True, reason ModelDownloading,
    message `node-a: 1.2 of 3.4 GB in the node cache, ETA 3m03s (12.0 MB/s over 1m40s)`

(`contract.download`: the text prewarm's exit carries too; the rate is over this pod's wait so
far). Once the files are in, one write sets it False (ModelCached). The operator shows a pod
whose prewarm is running with this condition True as ModelDownloading (status.pod_failure). The
chart's ValidatingAdmissionPolicy lets the agent's token change only this condition, and only
on pods bound to its own node.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from ember_runtime.contract import reasons
from ember_runtime.contract.cache import MODEL_DOWNLOAD_CONDITION
from ember_runtime.contract.config import FetchFile
from ember_runtime.contract.download import Observation, progress_message
from ember_runtime.kube import ApiError, KubeClient
from ember_runtime.nodeagent.cache import ContentCache
from ember_runtime.nodeagent.fetcher import PodFetch, Unresolved

log = logging.getLogger("ember_runtime.nodeagent.podprogress")

CONDITION = MODEL_DOWNLOAD_CONDITION
CACHED = "ModelCached"
SMP = "application/strategic-merge-patch+json"


@dataclass
class _Waiting:
    first: Observation  # when this pass first saw the pod wait, and the bytes then
    reported_at: float | None = None


class DownloadReports:
    def __init__(
        self,
        cache: ContentCache,
        reader: KubeClient,
        node: str,
        fetch_of: PodFetch,
        *,
        every_seconds: float = 30.0,
        tick_seconds: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cache, self.reader, self.node = cache, reader, node
        self.fetch_of = fetch_of  # what the agent fetches for a pod (Fetcher.fetch_of)
        self.every_seconds, self.tick_seconds = every_seconds, tick_seconds
        self.clock = clock
        self._waiting: dict[str, _Waiting] = {}  # pod uid → its wait

    async def run(self) -> None:
        while True:
            try:
                await self.once()
            except (ApiError, httpx.HTTPError, KeyError, ValueError) as err:
                log.warning("reporting download progress on %s: %s", self.node, err)
            await asyncio.sleep(self.tick_seconds)

    async def once(self) -> None:
        params = {"fieldSelector": f"spec.nodeName={self.node}", "resourceVersion": "0"}
        listed = await self.reader.get("/api/v1/pods", params)
        seen: set[str] = set()
        for pod in listed["items"]:
            uid = pod["metadata"]["uid"]
            try:
                fetch = self.fetch_of(pod)
            except Unresolved:  # its InferenceDeployment not read yet: the next tick
                seen.add(uid)  # a wait already under way keeps its start
                continue
            if fetch is None or (pod.get("metadata") or {}).get("deletionTimestamp"):
                continue
            seen.add(uid)
            await self._pod(pod, uid, fetch.files)
        for uid in set(self._waiting) - seen:
            del self._waiting[uid]

    async def _pod(self, pod: dict[str, Any], uid: str, files: list[FetchFile]) -> None:
        now = self.clock()
        total = sum(f.size_bytes for f in files)
        done = sum(self._done(f) for f in files)
        if not all(self.cache.has(f.sha256, f.size_bytes) for f in files):
            wait = self._waiting.setdefault(uid, _Waiting(Observation(now, done)))
            if wait.reported_at is None or now - wait.reported_at >= self.every_seconds:
                note = self._note(files)
                message = progress_message(
                    self.node, wait.first, Observation(now, done), total, note
                )
                wait.reported_at = now  # a refused write is tried again in 30 s, not each tick
                await self._write(pod, "True", reasons.MODEL_DOWNLOADING, message)
            return
        self._waiting.pop(uid, None)
        if _condition(pod).get("status") == "True":
            await self._write(pod, "False", CACHED, f"{self.node}: all files are in the node cache")

    def _done(self, f: FetchFile) -> int:
        if self.cache.has(f.sha256, f.size_bytes):
            return f.size_bytes
        try:
            return min(self.cache.partial(f.sha256).stat().st_size, f.size_bytes)
        except OSError:
            return 0

    def _note(self, files: list[FetchFile]) -> str:
        for f in files:
            try:
                line = (self.cache.waiting / f.sha256).read_text().strip()
            except OSError:
                continue
            if line:
                return f"; {line}"
        return ""

    async def _write(self, pod: dict[str, Any], status: str, reason: str, message: str) -> None:
        meta = pod["metadata"]
        before = _condition(pod)
        changed = before.get("status") != status
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        cond = {
            "type": CONDITION,
            "status": status,
            "reason": reason,
            "message": message,
            "lastTransitionTime": now if changed else before.get("lastTransitionTime", now),
        }
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status"
        await self.reader.send("PATCH", path, {"status": {"conditions": [cond]}}, SMP)


def _condition(pod: dict[str, Any]) -> dict[str, Any]:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == CONDITION:
            return dict(cond)
    return {}
