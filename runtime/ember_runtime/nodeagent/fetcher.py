"""What the node agent fetches: the http-source files of the pods on its own node.

The agent lists and watches pods with `fieldSelector=spec.nodeName=<node>` (the only pods it
asks for), reads each pod's `ember.dev/model-fetch` annotation (written by the operator), and
keeps every listed digest in the node cache (`cache.ContentCache`), one download per digest.
With site sharing on (`site.SiteSharing`), a file comes from a site peer, or from the origin
under the site's Lease; origin transfers are paced by the agent's token bucket (`ratelimit`).

A failure is recorded for prewarm to report (`cache.record_failure`). A checksum or size
mismatch is not retried — the bytes at the URL are not the ones the spec names, and fetching
them again would only cost the link — until no pod on the node wants that digest any more. An
origin error (HTTP 404, unreachable) is retried every `retry_seconds`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import ssl
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic import ValidationError

from ember_runtime import reasons
from ember_runtime.config import MODEL_FETCH_ANNOTATION, FetchFile, ModelFetch
from ember_runtime.nodeagent.cache import Busy, ContentCache, FetchError, Want
from ember_runtime.nodeagent.credentials import auth_headers, decode_secret_data
from ember_runtime.nodeagent.labels import CacheLabels
from ember_runtime.nodeagent.metrics import ORIGIN, AgentMetrics
from ember_runtime.nodeagent.ratelimit import TokenBucket
from ember_runtime.nodeagent.site import SiteSharing
from ember_runtime.nodeagent.windows import Windows, until
from ember_runtime.thermal.kube import ApiError, Endpoint

log = logging.getLogger("ember_runtime.nodeagent.fetcher")

WATCH_SECONDS = 300  # the API server ends a watch after this; the agent starts the next one


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class KubeReader:
    """GETs and watches with the agent's own token (re-read each time: the kubelet rotates it)."""

    def __init__(self, endpoint: Endpoint, timeout: float = 10.0) -> None:
        self._endpoint = endpoint
        verify: ssl.SSLContext | bool = True
        if endpoint.ca_file is not None:
            verify = ssl.create_default_context(cafile=str(endpoint.ca_file))
        timeout_cfg = httpx.Timeout(timeout, read=WATCH_SECONDS + 30)
        self._http = httpx.AsyncClient(base_url=endpoint.server, verify=verify, timeout=timeout_cfg)

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._endpoint.token_file.read_text().strip()}"}

    async def get(self, path: str, params: dict[str, str] | None = None) -> dict[str, Any]:
        resp = await self._http.get(path, params=params, headers=self._auth())
        if resp.status_code >= 300:
            raise ApiError(resp.status_code, resp.text)
        data: dict[str, Any] = resp.json()
        return data

    async def send(
        self, method: str, path: str, body: dict[str, Any], content_type: str = "application/json"
    ) -> dict[str, Any]:
        """POST/PUT/PATCH one object; the API server's answer (the object as stored)."""
        headers = {**self._auth(), "Content-Type": content_type}
        resp = await self._http.request(method, path, content=json.dumps(body), headers=headers)
        if resp.status_code >= 300:
            raise ApiError(resp.status_code, resp.text)
        data: dict[str, Any] = resp.json()
        return data

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


def model_fetch(pod: dict[str, Any]) -> ModelFetch | None:
    """The pod's fetch list, or None (no http source, or an annotation we cannot read)."""
    raw = ((pod.get("metadata") or {}).get("annotations") or {}).get(MODEL_FETCH_ANNOTATION)
    if not raw:
        return None
    try:
        return ModelFetch.model_validate_json(raw)
    except ValidationError:
        log.warning("pod %s: unreadable %s", pod["metadata"].get("name"), MODEL_FETCH_ANNOTATION)
        return None


@dataclass(frozen=True)
class Wanted:
    file: FetchFile
    secret_ref: str | None


class Fetcher:
    def __init__(
        self,
        cache: ContentCache,
        reader: KubeReader,
        node: str,
        namespace: str,
        *,
        retry_seconds: float = 60.0,
        site: SiteSharing | None = None,
        limiter: TokenBucket | None = None,
        windows: Windows | None = None,
        metrics: AgentMetrics | None = None,
        labels: CacheLabels | None = None,
    ) -> None:
        self.cache, self.reader, self.node, self.namespace = cache, reader, node, namespace
        self.metrics, self.labels = metrics, labels
        self.retry_seconds = retry_seconds
        self.site, self.limiter, self.windows = site, limiter, windows
        self._window_stops: set[threading.Event] = set()
        self.pods: dict[str, ModelFetch] = {}  # pod uid → its fetch list
        self._running: dict[str, asyncio.Task[None]] = {}
        self._retry_at: dict[str, float] = {}
        self._thread_stop = threading.Event()
        self._http = httpx.Client(timeout=httpx.Timeout(30.0), follow_redirects=True)

    def wanted(self) -> dict[str, Wanted]:
        out: dict[str, Wanted] = {}
        for fetch in self.pods.values():
            for f in fetch.files:
                out.setdefault(f.sha256, Wanted(f, fetch.secret_ref))
        return out

    def reconcile(self) -> None:
        """Start a download for every wanted digest that is not held, running or failed."""
        wanted = self.wanted()
        for sha in list(self._retry_at):
            if sha not in wanted:  # nobody here wants it: forget the failure
                del self._retry_at[sha]
                self.cache.clear_failure(sha)
        now = time.monotonic()
        for sha, w in wanted.items():
            if sha in self._running or self.cache.has(sha, w.file.size_bytes):
                continue
            if sha in self._retry_at and now < self._retry_at[sha]:
                continue
            self._retry_at.pop(sha, None)
            self.cache.clear_failure(sha)
            self._running[sha] = asyncio.create_task(self._fetch(w), name=f"fetch-{sha[:12]}")

    async def _fetch(self, w: Wanted) -> None:
        sha = w.file.sha256
        try:
            headers = await self._headers(w)
            want = Want(w.file.url, sha, w.file.size_bytes, headers=headers)
            log.info("fetching %s (%d bytes), origin %s", sha[:12], w.file.size_bytes, want.where())
            started = time.monotonic()
            where = "origin"
            if self.site is None:
                await self._from_origin(want)
            else:
                where = await self.site.obtain(want, lambda: self._from_origin(want))
                self.site.published()
            if self.labels is not None:
                self.labels.changed()
            log.info("cached %s from the %s in %.1fs", sha[:12], where, time.monotonic() - started)
        except FetchError as err:
            log.warning("%s: %s: %s", sha[:12], err.reason, err)
            self.cache.record_failure(sha, err)
            mismatch = err.reason in (reasons.CHECKSUM_MISMATCH, reasons.SIZE_MISMATCH)
            self._retry_at[sha] = (
                float("inf") if mismatch else time.monotonic() + self.retry_seconds
            )
        except Busy:
            self._retry_at[sha] = time.monotonic() + 5.0  # another agent process holds it
        except InterruptedError:
            pass  # stopping; the partial stays for the next run
        finally:
            self._running.pop(sha, None)

    async def _from_origin(self, want: Want) -> None:
        """Download from the origin, inside the download windows if there are any: wait for
        one to open, stop when it closes (the partial is kept) and resume in the next."""
        if self.windows is None:
            await self._fetch_origin(want, self._thread_stop)
            return
        while True:
            await self._until_window(want.sha256)
            closes = self.windows.closes_in(_utcnow())
            stop = threading.Event()
            self._window_stops.add(stop)
            timer = threading.Timer(closes, stop.set) if closes is not None else None
            if timer is not None:
                timer.daemon = True
                timer.start()
            try:
                await self._fetch_origin(want, stop)
                return
            except InterruptedError:
                if self._thread_stop.is_set():
                    raise
                log.info("%s: the download window closed; the partial waits", want.sha256[:12])
            finally:
                self._window_stops.discard(stop)
                if timer is not None:
                    timer.cancel()

    async def _fetch_origin(self, want: Want, stop: threading.Event) -> None:
        meter = self.metrics.meter(ORIGIN).inc if self.metrics is not None else None
        await asyncio.to_thread(
            self.cache.fetch, self._http, want, stop, limiter=self.limiter, meter=meter
        )
        if self.metrics is not None:
            self.metrics.fetched_files.labels(ORIGIN).inc()

    async def _until_window(self, sha: str) -> None:
        assert self.windows is not None
        now = _utcnow()
        wait = self.windows.opens_in(now)
        if wait > 0:
            why = f"outside the download window until {until(now, wait)}"
            log.info("%s: %s", sha[:12], why)
            self.cache.note_waiting(sha, why)
            deadline = time.monotonic() + wait
            while (left := deadline - time.monotonic()) > 0:
                if self._thread_stop.is_set():
                    raise InterruptedError(sha)
                await asyncio.sleep(min(left, 1.0))
        self.cache.clear_waiting(sha)

    async def _headers(self, w: Wanted) -> dict[str, str]:
        if w.secret_ref is None:
            return {}
        path = f"/api/v1/namespaces/{self.namespace}/secrets/{w.secret_ref}"
        try:
            secret = await self.reader.get(path)
        except ApiError as err:
            raise FetchError(f"Secret {self.namespace}/{w.secret_ref}: {err}") from err
        data = decode_secret_data(secret.get("data") or {})
        return auth_headers(w.secret_ref, data, w.file.url)

    def _apply(self, event: dict[str, Any]) -> None:
        pod = event.get("object") or {}
        uid = (pod.get("metadata") or {}).get("uid")
        if uid is None:
            return
        fetch = model_fetch(pod)
        if event.get("type") == "DELETED" or fetch is None:
            self.pods.pop(uid, None)
        else:
            self.pods[uid] = fetch

    async def watch_pods(self) -> None:
        """List this node's pods, then watch from the list's version; a watch the API server
        ends after WATCH_SECONDS resumes from the last event's version, and only an expired
        version (410 Gone, an ERROR event) or a failure costs a new list."""
        params = {"fieldSelector": f"spec.nodeName={self.node}"}
        while True:
            try:
                listed = await self.reader.get("/api/v1/pods", params)
                self.pods = {
                    p["metadata"]["uid"]: f for p in listed["items"] if (f := model_fetch(p))
                }
                self.reconcile()
                version: str | None = listed["metadata"]["resourceVersion"]
                while version is not None:
                    version = await self._watch_once(params, version)
            except (ApiError, httpx.HTTPError, ValueError, KeyError) as err:
                log.warning("watching pods on %s: %s; listing again in 5s", self.node, err)
                await asyncio.sleep(5)

    async def _watch_once(self, params: dict[str, str], version: str) -> str | None:
        """Apply one watch's events; the version to resume from, or None to list again."""
        async for event in self.reader.watch(
            "/api/v1/pods", {**params, "resourceVersion": version}
        ):
            if event.get("type") == "ERROR":  # e.g. 410 Gone: the version is too old
                return None
            version = ((event.get("object") or {}).get("metadata") or {}).get(
                "resourceVersion", version
            )
            self._apply(event)
            self.reconcile()
        return version

    async def run(self) -> None:
        """Watch pods and retry failed downloads until cancelled."""
        # Created up front: a pod's read-only mount of the cache needs the directory to exist.
        self.cache.blobs.mkdir(parents=True, exist_ok=True)
        self.cache.blobs.chmod(0o755)
        self.cache.root.chmod(0o755)
        watcher = asyncio.create_task(self.watch_pods())
        try:
            while True:
                await asyncio.sleep(min(self.retry_seconds, 10.0))
                self.reconcile()
        finally:
            watcher.cancel()
            self._thread_stop.set()  # downloads stop at their next chunk, partials kept
            for stop in list(self._window_stops):
                stop.set()
            await asyncio.gather(watcher, *self._running.values(), return_exceptions=True)
            self._http.close()
