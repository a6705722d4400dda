"""An http source's LoRA adapters on the node (issue 47): the node agent reads them from the
InferenceDeployment's spec (the real resolver, over a stand-in API reader), fetches each url
once into the content cache, verified like the model's files, and keeps a per-object adapters
view `<cache>/adapters/<namespace>/<name>/<sha256>` holding hard links to that object's own
verified blobs only. An adapter added to the spec (no pod change) shows up in the same
directory after the agent reads the object again; one removed goes; the directory stays.
Real Fetcher, real cache, real origin; no cluster."""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path
from typing import Any, cast

from ember_runtime.contract.cache import FETCH_HASH_ANNOTATION, INSTANCE_LABEL, adapters_view
from ember_runtime.contract.config import fetch_from_spec
from ember_runtime.contract.resource import object_path
from ember_runtime.kube import ApiError, KubeClient
from ember_runtime.nodeagent.adapterviews import AdapterViews
from ember_runtime.nodeagent.cache import ContentCache
from ember_runtime.nodeagent.fetcher import Fetcher, SpecResolver

from tests.nodeagent.origin import serve

NS = "t"
FILES = {name: os.urandom(50_000 + i) for i, name in enumerate(("m.gguf", "a", "b", "c"))}
SHA = {name: hashlib.sha256(data).hexdigest() for name, data in FILES.items()}


class Objects:
    """The API server's InferenceDeployments, as the resolver GETs them."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.gets = 0

    async def get(self, path: str, params: Any = None) -> dict[str, Any]:
        self.gets += 1
        for name, obj in self.objects.items():
            if path == object_path(NS, name):
                return obj
        raise ApiError(404, "not found")


def _model(base: str) -> dict[str, Any]:
    return {
        "name": "gemma",
        "source": {"http": {"urls": {"m.gguf": f"{base}/m.gguf"}}},
        "files": [{"path": "m.gguf", "sha256": SHA["m.gguf"], "sizeBytes": len(FILES["m.gguf"])}],
    }


def _adapter(base: str, name: str) -> dict[str, Any]:
    return {
        "name": f"style-{name}",
        "path": f"{name}.gguf",
        "url": f"{base}/{name}",
        "sha256": SHA[name],
        "sizeBytes": len(FILES[name]),
    }


def _pod(uid: str, name: str, model: dict[str, Any]) -> dict[str, Any]:
    fetch = fetch_from_spec(model)
    assert fetch is not None
    meta = {"uid": uid, "namespace": NS, "labels": {INSTANCE_LABEL: name}}
    return {"metadata": {**meta, "annotations": {FETCH_HASH_ANNOTATION: fetch.digest()}}}


async def _settle(fetcher: Fetcher) -> None:
    fetcher.reconcile()
    while fetcher._running:
        await asyncio.gather(*list(fetcher._running.values()))


def _listing(root: Path, name: str) -> set[str]:
    return {p.name for p in adapters_view(root, NS, name).iterdir()}


def test_adapters_are_fetched_once_into_each_objects_own_view(tmp_path: Path) -> None:
    cache = ContentCache(tmp_path)
    api = Objects()
    with serve(dict(FILES)) as (base, origin):
        model = _model(base)
        api.objects["demo"] = {"spec": {"model": model, "adapters": [_adapter(base, "a")]}}
        api.objects["other"] = {"spec": {"model": model, "adapters": [_adapter(base, "b")]}}

        async def run() -> None:
            reader = cast(KubeClient, api)
            resolver = SpecResolver(reader)
            fetcher = Fetcher(cache, reader, "n", "ns", resolver=resolver, claim_reread_seconds=0)
            views = AdapterViews(cache, fetcher.adapter_views)
            for uid, name in (("p1", "demo"), ("p2", "demo"), ("p3", "other")):
                await fetcher._apply({"type": "ADDED", "object": _pod(uid, name, model)})
            await _settle(fetcher)
            views.sync()
            demo = adapters_view(tmp_path, NS, "demo")
            assert _listing(tmp_path, "demo") == {SHA["a"]}
            assert _listing(tmp_path, "other") == {SHA["b"]}  # never the other tenant's
            link = demo / SHA["a"]
            assert link.read_bytes() == FILES["a"]
            assert os.path.samefile(link, cache.path(SHA["a"]))  # a hard link, not a copy
            assert oct(demo.stat().st_mode & 0o777) == "0o755"
            inode = demo.stat().st_ino

            # An adapter added to the spec, no pod change: read again, fetched, linked.
            spec = api.objects["demo"]["spec"]
            spec["adapters"] = [*spec["adapters"], _adapter(base, "c")]
            await fetcher.tick()
            await _settle(fetcher)
            views.sync()
            assert _listing(tmp_path, "demo") == {SHA["a"], SHA["c"]}
            assert (demo / SHA["c"]).read_bytes() == FILES["c"]

            # One removed: its link goes (the blob stays cached); the directory is the same.
            spec["adapters"] = [_adapter(base, "c")]
            await fetcher.tick()
            views.sync()
            assert _listing(tmp_path, "demo") == {SHA["c"]}
            assert cache.path(SHA["a"]).is_file()
            assert demo.stat().st_ino == inode

            # Its pods gone: the view is emptied, never deleted (a mount may still be bound).
            for uid in ("p1", "p2"):
                await fetcher._apply({"type": "DELETED", "object": _pod(uid, "demo", model)})
            views.sync()
            assert demo.is_dir() and _listing(tmp_path, "demo") == set()
            assert demo.stat().st_ino == inode
            assert _listing(tmp_path, "other") == {SHA["b"]}

        asyncio.run(run())
    # Every file once from the origin: the two pods of one object share one fetch.
    assert sorted(origin.paths) == sorted(f"/{n}" for n in FILES)


def test_an_adapter_whose_bytes_differ_is_never_linked(tmp_path: Path) -> None:
    cache = ContentCache(tmp_path)
    api = Objects()
    with serve({**FILES, "a": os.urandom(len(FILES["a"]))}) as (base, _origin):
        model = _model(base)
        api.objects["demo"] = {"spec": {"model": model, "adapters": [_adapter(base, "a")]}}

        async def run() -> None:
            reader = cast(KubeClient, api)
            fetcher = Fetcher(cache, reader, "n", "ns", resolver=SpecResolver(reader))
            await fetcher._apply({"type": "ADDED", "object": _pod("p1", "demo", model)})
            await _settle(fetcher)
            AdapterViews(cache, fetcher.adapter_views).sync()

        asyncio.run(run())
    assert adapters_view(tmp_path, NS, "demo").is_dir()  # the pod's mount can be made
    assert _listing(tmp_path, "demo") == set()  # the runtime sees no file: refused for now
    assert cache.failure(SHA["a"]) is not None
