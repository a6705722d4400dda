"""Per-object views of the node cache's LoRA adapters: what a replica sees of them.

An http source's adapters (`spec.adapters[].url`) are fetched into the node cache like the
model's files (`fetcher`). A replica must see a new adapter without a new volume (a new volume
is a new pod template: a restart), so its pod mounts, read-only, one directory per
InferenceDeployment, `<root>/adapters/<namespace>/<name>/` (contract.cache.adapters_view,
render.adapters_volume), which this module keeps for every object a pod on this node names:

    <sha256>      hard link to the verified blob of one of that object's adapters

Only that object's adapters, never the cache: other tenants' files stay invisible (a replica
runs its author's image). A link appears once the blob is verified (the cache names nothing
else), so the runtime, which loads `/adapters/<sha256>` and checks its sha256 again, sees
either nothing (a refused-for-now adapter, tried again on its reload tick) or the right bytes.
As with the digest views (views.py), a view no pod here names any more is emptied, never
deleted: a pod's mount is bound to the directory itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Mapping
from contextlib import suppress
from pathlib import Path

from ember_runtime.contract.cache import ADAPTERS_DIR, adapters_view, is_digest
from ember_runtime.nodeagent.cache import ContentCache
from ember_runtime.nodeagent.views import link_blob

log = logging.getLogger("ember_runtime.nodeagent.adapterviews")

Wanted = Mapping[tuple[str, str], Collection[str]]  # (namespace, name) → adapter digests


class AdapterViews:
    def __init__(
        self,
        cache: ContentCache,
        wanted: Callable[[], Wanted],
        interval_seconds: float = 1.0,
    ) -> None:
        self.cache = cache
        self.root = cache.root / ADAPTERS_DIR
        self._wanted = wanted
        self.interval_seconds = interval_seconds

    def view(self, namespace: str, name: str) -> Path:
        return adapters_view(self.cache.root, namespace, name)

    def sync(self, wanted: Wanted | None = None) -> None:
        """Each wanted object's view links exactly its adapters' verified blobs; the views
        of objects no pod here names are emptied (kept)."""
        wanted = dict(self._wanted() if wanted is None else wanted)
        _directory(self.root)
        for (namespace, name), digests in sorted(wanted.items()):
            self._sync_one(namespace, name, {d for d in digests if is_digest(d)}, make=True)
        for namespace, name in self.existing() - wanted.keys():
            self._sync_one(namespace, name, set(), make=False)

    def existing(self) -> set[tuple[str, str]]:
        """The views there are, empty or not."""
        try:
            return {
                (ns.name, obj.name)
                for ns in self.root.iterdir()
                if ns.is_dir()
                for obj in ns.iterdir()
                if obj.is_dir()
            }
        except OSError:
            return set()

    def _sync_one(self, namespace: str, name: str, digests: set[str], *, make: bool) -> None:
        """`make`: a pod here names the object. Its view is made even while it has no adapter
        (or they are not read yet): a pod whose template mounts it must not wait for that."""
        view = self.view(namespace, name)
        if make:
            _directory(view.parent)
            _directory(view)
        for sha in sorted(digests):
            link_blob(self.cache.path(sha), view / sha)
        with suppress(FileNotFoundError):
            for entry in view.iterdir():
                if entry.name not in digests:  # an adapter removed, or a leftover temp link
                    with suppress(FileNotFoundError, IsADirectoryError):
                        entry.unlink()

    async def run(self) -> None:
        while True:
            try:
                # Read on the event loop, which is where the fetcher changes its pods.
                await asyncio.to_thread(self.sync, dict(self._wanted()))
            except OSError:
                log.exception("syncing the adapters views in %s", self.root)
            await asyncio.sleep(self.interval_seconds)


def _directory(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o755)
