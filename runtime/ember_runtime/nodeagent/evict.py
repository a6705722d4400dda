"""Keep the node cache within its budget: least-recently-used eviction, never of a model in use.

In use means: a pod bound to this node names the digest, a model file or one of its LoRA
adapters (through the InferenceDeployment its pod watch read for it: `Fetcher.fetch_of`),
whatever its phase, as the API server lists them at
the start of the pass; a listed pod the watch has not read yet makes the pass evict nothing. That is
every pod that may still mount the digest's view (render.digest_views) or copy from it, and
the only pods whose mounts the agent could know of: another container's open files and mounts
are in namespaces the agent does not see. A pass whose list fails evicts nothing — the agent
never guesses what is unused. A pod that lands here after the list and names an evicted digest
has it fetched again; prewarm, which holds the file open while copying, is never cut short
(an unlinked file lives on while open), and a running replica reads prewarm's copy.

While a rollout's stage request stands on the agent's own Node (`contract.rollout`), the named
InferenceDeployment's digests are in use too, both its `spec.model` (the version about to be
activated) and its `status.rollout.stableSpec.model` (the version a rollback returns to, so a
rollback needs no WAN fetch): `staged_on_node`, read afresh each pass like the pod list. A Node
or object that cannot be read makes the pass evict nothing; an object that is gone keeps
nothing; a malformed model is logged and keeps nothing.

Recently used: each pass stamps `<root>/used/<digest>` (its mtime) for every digest in use, so
the order survives agent restarts; a blob never in use here counts from its own mtime (when it
was fetched). Over budget (the sum of the complete blobs' sizes; downloads in progress are not
counted and never evicted), the pass removes the unused blobs oldest first until the rest fit,
each with its view, its stamp and its node label. In-use blobs alone over the budget are kept,
and logged.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ember_runtime.contract.cache import USED_DIR, entry_size, is_digest
from ember_runtime.contract.rollout import stable_model
from ember_runtime.kube import KubeClient
from ember_runtime.nodeagent.cache import ContentCache
from ember_runtime.nodeagent.fetcher import PodFetch, SpecResolver, model_fetch
from ember_runtime.nodeagent.labels import CacheLabels
from ember_runtime.nodeagent.stage import requests_of
from ember_runtime.nodeagent.views import DigestViews

log = logging.getLogger("ember_runtime.nodeagent.evict")

InUse = Callable[[], Awaitable[set[str]]]  # raises when it cannot tell


def pods_on_node(reader: KubeClient, node: str, fetch_of: PodFetch) -> InUse:
    """The digests that the pods bound to `node` name, listed afresh from the API server;
    raises (`fetcher.Unresolved`) while one of them is not resolved yet."""

    async def in_use() -> set[str]:
        listed = await reader.get("/api/v1/pods", {"fieldSelector": f"spec.nodeName={node}"})
        fetches = [f for pod in listed["items"] if (f := fetch_of(pod)) is not None]
        return {file.sha256 for fetch in fetches for file in fetch.all_files()}

    return in_use


def staged_on_node(reader: KubeClient, node: str, specs: SpecResolver) -> InUse:
    """The digests the stage requests on `node`'s own Node keep: each named object's spec.model
    and status.rollout.stableSpec.model, read afresh; raises when the Node or an object cannot
    be read (an object that is gone keeps nothing: its rollout is over)."""

    async def in_use() -> set[str]:
        own = await reader.get(f"/api/v1/nodes/{node}")
        used: set[str] = set()
        for namespace, name in sorted(requests_of(own)):
            obj = await specs.read(namespace, name)
            if obj is not None:
                used |= _kept_by(obj, f"{namespace}/{name}")
        return used

    return in_use


def _kept_by(obj: dict[str, Any], where: str) -> set[str]:
    models = {
        "spec.model": (obj.get("spec") or {}).get("model"),
        "status.rollout.stableSpec.model": stable_model(obj),
    }
    used: set[str] = set()
    for field, model in models.items():
        if model is None:
            continue  # no rollout status (yet): only the spec's version to keep
        fetch = model_fetch(model, f"staged {where} {field}")
        used |= {f.sha256 for f in fetch.files} if fetch is not None else set()
    return used


def together(*sources: InUse) -> InUse:
    """In use by any of `sources`; raises if any of them cannot tell."""

    async def in_use() -> set[str]:
        used: set[str] = set()
        for source in sources:
            used |= await source()
        return used

    return in_use


@dataclass(frozen=True)
class Pass:
    """What one pass did: bytes held before, the digests evicted and those kept."""

    held_bytes: int
    evicted: list[str]
    kept: list[str]


class Evictor:
    def __init__(
        self,
        cache: ContentCache,
        views: DigestViews,
        in_use: InUse,
        max_bytes: int,
        *,
        interval_seconds: float = 60.0,
        labels: CacheLabels | None = None,
    ) -> None:
        self.cache, self.views, self.in_use = cache, views, in_use
        self.max_bytes = max_bytes
        self.interval_seconds = interval_seconds
        self.labels = labels
        self.stamps = cache.root / USED_DIR

    async def run(self) -> None:
        while True:
            try:
                await self.once()
            except Exception:  # an unreadable pod list or cache: keep everything this time
                log.exception("cache eviction pass failed; nothing evicted")
            await asyncio.sleep(self.interval_seconds)

    async def once(self) -> Pass:
        used = await self.in_use()  # first: a failure here evicts nothing
        return await asyncio.to_thread(self.evict, used)

    def evict(self, used: set[str]) -> Pass:
        self._stamp(used)
        sizes = {sha: entry_size(self.cache.path(sha)) for sha in self.cache.held()}
        total = sum(sizes.values())
        evicted: list[str] = []
        candidates = sorted((sha for sha in sizes if sha not in used), key=self.last_used)
        left = total
        for sha in candidates:
            if left <= self.max_bytes:
                break
            self._remove(sha)
            evicted.append(sha)
            left -= sizes[sha]
        if left > self.max_bytes:
            log.warning(
                "the models in use here take %d bytes, over the cache budget of %d",
                left,
                self.max_bytes,
            )
        if evicted:
            log.info("evicted %s to fit %d bytes", [s[:12] for s in evicted], self.max_bytes)
            if self.labels is not None:
                self.labels.changed()
        kept = sorted(set(sizes) - set(evicted))
        return Pass(total, evicted, kept)

    def last_used(self, sha: str) -> float:
        for path in (self.stamps / sha, self.cache.path(sha)):
            try:
                return path.stat().st_mtime
            except OSError:
                continue
        return 0.0

    def _stamp(self, used: set[str]) -> None:
        self.stamps.mkdir(parents=True, exist_ok=True)
        now = time.time()
        for sha in used:
            if is_digest(sha) and self.cache.path(sha).exists():
                stamp = self.stamps / sha
                stamp.touch()
                os.utime(stamp, (now, now))

    def _remove(self, sha: str) -> None:
        self.views.remove(sha)  # its hard link would keep the bytes on disk
        self.cache.path(sha).unlink(missing_ok=True)
        (self.stamps / sha).unlink(missing_ok=True)
