"""Per-digest views of the node cache: what a replica may see of it.

The cache (`cache.ContentCache`, `<root>/sha256/<digest>`) holds the models of every namespace
whose pods ran on this node; a replica runs its author's image, so mounting the cache would let
it read other tenants' private models. A replica's pod instead mounts, for each digest of its
own files, `<root>/views/<digest>/` (render.digest_views), which this module keeps for every
digest that a pod on this node names:

    data          hard link to the verified blob, once it is complete
    data.partial  hard link to the download in progress (prewarm stats it for progress)
    failed        the cache's failure line for the digest (prewarm reports it)
    waiting       why the download waits (a window), for prewarm's message

Hard links, not copies: no bytes are duplicated, and a link to the partial grows with the
download without any further work here. A blob only ever gets its final name once verified,
so `data` is as trustworthy as the cache's name. The pod's hostPath has type Directory: the
kubelet retries the mount until `sync` has made the view (a second or so after the pod lands
here); the kubelet never creates it. A view of a digest no pod here names any more (or one just
evicted) is emptied, never deleted: a pod's mount is bound to the directory itself, so a view
deleted and made again would leave a pod that mounted the first one looking into an empty,
unlinked directory forever. That happens whenever the wanted set is briefly empty, e.g. an
agent restart before its pod watch has read the InferenceDeployments again.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Iterable
from contextlib import suppress
from pathlib import Path

from ember_runtime.contract.cache import (
    VIEW_DATA,
    VIEW_FAILED,
    VIEW_WAITING,
    VIEWS_DIR,
    is_digest,
    partial_name,
)
from ember_runtime.nodeagent.cache import ContentCache

log = logging.getLogger("ember_runtime.nodeagent.views")


class DigestViews:
    def __init__(
        self,
        cache: ContentCache,
        wanted: Callable[[], Iterable[str]],
        interval_seconds: float = 1.0,
    ) -> None:
        self.cache = cache
        self.root = cache.root / VIEWS_DIR
        self._wanted = wanted
        self.interval_seconds = interval_seconds

    def view(self, sha256: str) -> Path:
        return self.root / sha256

    def sync(self, wanted: Iterable[str] | None = None) -> None:
        """Make the view of every wanted digest match the cache; drop the others."""
        wanted = {d for d in (self._wanted() if wanted is None else wanted) if is_digest(d)}
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o755)
        for sha in sorted(wanted):
            self._sync_one(sha)
        for stale in self.existing() - wanted:
            self.remove(stale)

    def remove(self, sha256: str) -> None:
        """Empty a view, keeping its directory (see above): its links go, so it holds no bytes
        and shows nothing; a pod still mounting it keeps the files it has open."""
        if not is_digest(sha256):
            return
        with suppress(FileNotFoundError, NotADirectoryError):
            for entry in self.view(sha256).iterdir():
                with suppress(FileNotFoundError, IsADirectoryError):
                    entry.unlink()

    def existing(self) -> set[str]:
        """The views that show something (a directory kept empty does not count)."""
        try:
            return {
                p.name
                for p in self.root.iterdir()
                if is_digest(p.name) and any(True for _ in p.iterdir())
            }
        except OSError:
            return set()

    def _sync_one(self, sha: str) -> None:
        view = self.view(sha)
        view.mkdir(exist_ok=True)
        view.chmod(0o755)
        link_blob(self.cache.path(sha), view / VIEW_DATA)
        link_blob(self.cache.partial(sha), view / partial_name(VIEW_DATA))
        _mirror(self.cache.failures / sha, view / VIEW_FAILED)
        _mirror(self.cache.waiting / sha, view / VIEW_WAITING)

    async def run(self) -> None:
        while True:
            try:
                # Read on the event loop, which is where the fetcher changes its pods.
                await asyncio.to_thread(self.sync, set(self._wanted()))
            except OSError:
                log.exception("syncing the cache views in %s", self.root)
            await asyncio.sleep(self.interval_seconds)


def link_blob(source: Path, link: Path) -> None:
    """`link` names the same file as `source`, or nothing when `source` is missing."""
    try:
        if os.path.samefile(source, link):
            return
    except FileNotFoundError:
        pass
    if not source.exists():
        link.unlink(missing_ok=True)
        return
    tmp = link.with_name(f".{link.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except FileNotFoundError:  # renamed or dropped by the download meanwhile: next round
        return
    os.replace(tmp, link)


def _mirror(source: Path, copy: Path) -> None:
    """`copy` holds `source`'s one line, or is absent (small files: copied, not linked, so the
    cache's atomic replace of the line never leaves the view on the old inode)."""
    try:
        line = source.read_text()
    except FileNotFoundError:
        copy.unlink(missing_ok=True)
        return
    with suppress(FileNotFoundError):
        if copy.read_text() == line:
            return
    tmp = copy.with_name(f".{copy.name}.tmp")
    tmp.write_text(line)
    tmp.chmod(0o644)
    os.replace(tmp, copy)
