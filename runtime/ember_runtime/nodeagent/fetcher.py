"""What the node agent fetches: the http-source files of the InferenceDeployments whose pods
run on its own node, or that a rollout asks its node to stage.

The agent lists and watches pods with `fieldSelector=spec.nodeName=<node>` (the only pods it
asks for). A pod names its InferenceDeployment (label `ember.dev/instance`, annotation
`ember.dev/model-fetch-hash`); the agent reads that object *in the pod's own namespace* and
takes the URLs, digests, sizes and Secret from its spec, which the CRD validated. Nothing a pod
author writes on a pod is fetched: a hand-made pod can at most name an InferenceDeployment of its
own namespace, whose model the agent would fetch for that object's own pods anyway.

A rollout's stage request (`contract.rollout`: `stage.ember.dev/<16 hex>: "<namespace>/<name>"`
on the agent's own Node, seen by `stage.watch_own_node`) is a claim of the same kind: the agent
reads that object through the same `SpecResolver` and fetches its `spec.model`, so the version
is in the cache (and the Node's `cache.ember.dev/` labels) before the site's pods change. The
object is read again every `stage_reread_seconds` while the request stands (it has no version
the way a pod's annotation does); when the request goes, its files are no longer wanted and
stay cached until the evictor needs the room.

Each wanted digest is kept in the node cache (`cache.ContentCache`), one download at a time.
With site sharing on (`site.SiteSharing`), a file comes from a site peer, or from the origin
under the site's Lease; origin transfers are paced by the agent's token bucket (`ratelimit`).

LoRA adapters (`spec.adapters[].url`, http sources only) are fetched the same way, into the
same cache, once per site. Adding one changes no pod (`ModelFetch.digest` leaves them out), so
the object each pod here names is read again every `claim_reread_seconds` (a GET per object,
no watch: the agent's RBAC stays get-only); `adapter_views` says which verified blobs each
object's adapters view links (nodeagent/adapterviews.py).

Several pods may name the same digest with different URLs (two tenants, one public model).
Failures are kept per (digest, URL): a URL that failed does not stop another URL for the same
digest, and `failed/<digest>` (what prewarm reports) is written only while every URL wanted for
the digest has failed. A checksum or size mismatch is retried after `mismatch_retry_seconds`,
doubling up to `MAX_MISMATCH_RETRY_SECONDS` (the bytes at the URL may be fixed, but fetching them
again costs the link); an origin error (HTTP 404, unreachable) every `retry_seconds`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import re
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from ember_runtime.contract import reasons
from ember_runtime.contract.cache import FETCH_HASH_ANNOTATION, INSTANCE_LABEL
from ember_runtime.contract.config import FetchFile, ModelFetch, adapter_fetches, fetch_from_spec
from ember_runtime.contract.resource import object_path
from ember_runtime.contract.rollout import stable_model
from ember_runtime.kube import API_ERRORS, ApiError, KubeClient
from ember_runtime.nodeagent.cache import Busy, ContentCache, FetchError, Want, failure_line
from ember_runtime.nodeagent.credentials import auth_headers, decode_secret_data
from ember_runtime.nodeagent.labels import CacheLabels
from ember_runtime.nodeagent.metrics import ORIGIN, AgentMetrics
from ember_runtime.nodeagent.ratelimit import TokenBucket
from ember_runtime.nodeagent.site import SiteSharing
from ember_runtime.nodeagent.stage import StageKey, watch_own_node
from ember_runtime.nodeagent.windows import Windows, until

log = logging.getLogger("ember_runtime.nodeagent.fetcher")

MAX_MISMATCH_RETRY_SECONDS = 6 * 3600.0
_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")  # a DNS subdomain
STAGE_REREAD_SECONDS = 60.0
CLAIM_REREAD_SECONDS = 30.0  # a pod's object, for adapters added or removed (no pod change)
STAGED = "stage"  # a staged object's Claim.version: it is read again by time, not by version


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


@dataclass(frozen=True)
class Claim:
    """The InferenceDeployment a pod names: a place to look, never what to fetch."""

    namespace: str
    name: str
    version: str  # the pod's FETCH_HASH_ANNOTATION: a new value means "read the spec again"


def claim_of(pod: dict[str, Any]) -> Claim | None:
    meta = pod.get("metadata") or {}
    name = (meta.get("labels") or {}).get(INSTANCE_LABEL)
    version = (meta.get("annotations") or {}).get(FETCH_HASH_ANNOTATION)
    namespace = meta.get("namespace")
    if not name or not version or not namespace:
        return None
    if not (_NAME.fullmatch(str(name)) and _NAME.fullmatch(str(namespace))):
        return None  # not an object name: nothing to look up (and nothing to put in a path)
    return Claim(str(namespace), str(name), str(version))


class Unresolved(Exception):
    """A pod on the node whose InferenceDeployment the pod watch has not read (yet)."""


PodFetch = Callable[[dict[str, Any]], ModelFetch | None]  # Fetcher.fetch_of


class Resolver(Protocol):
    async def resolve(self, claim: Claim) -> ModelFetch | None: ...


def model_fetch(model: Any, where: str) -> ModelFetch | None:
    """What to fetch for one `spec.model`-shaped value (None: not an http source); a shape the
    CRD would not have accepted is logged and counts as nothing, never as a failed pass."""
    try:
        return fetch_from_spec(model)
    except (ValueError, TypeError, AttributeError) as err:  # ValidationError is a ValueError
        log.warning("%s: unreadable model: %s", where, err)
        return None


class SpecResolver:
    """Reads what to fetch from the named InferenceDeployment's spec, in the pod's namespace."""

    def __init__(self, reader: KubeClient) -> None:
        self.reader = reader

    async def read(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The object as stored; None when there is none. Raises on any other API error."""
        try:
            return await self.reader.get(object_path(namespace, name))
        except ApiError as err:
            if err.status == 404:  # a hand-made pod naming nothing, or the object is gone
                log.info("%s/%s: no such InferenceDeployment", namespace, name)
                return None
            raise

    async def resolve(self, claim: Claim) -> ModelFetch | None:
        obj = await self.read(claim.namespace, claim.name)
        if obj is None:
            return None
        where = f"{claim.namespace}/{claim.name}"
        fetch = self._model(obj, claim, where)
        if fetch is None:
            return None
        adapters = _adapters((obj.get("spec") or {}).get("adapters"), f"{where} spec.adapters")
        return fetch.model_copy(update={"adapters": adapters}) if adapters else fetch

    def _model(self, obj: dict[str, Any], claim: Claim, where: str) -> ModelFetch | None:
        current = model_fetch((obj.get("spec") or {}).get("model"), f"{where} spec.model")
        if current is None or current.digest() == claim.version:
            return current
        # A site-by-site rollout: a pod of the previous version (a site its wave has not
        # reached, or one rolled back) names the object whose spec is already the next one.
        # Its files are the previous version's, which the operator keeps in status.
        stable = model_fetch(stable_model(obj), f"{where} status.rollout.stableSpec.model")
        if stable is not None and stable.digest() == claim.version:
            return stable
        return current  # a pod of an older operator's rendering: the spec is all there is


def _adapters(adapters: Any, where: str) -> list[FetchFile]:
    """The adapters to fetch; a shape the CRD would refuse is logged and fetches none."""
    try:
        return adapter_fetches(adapters)
    except (ValueError, TypeError) as err:
        log.warning("%s: unreadable adapters: %s", where, err)
        return []


@dataclass(frozen=True)
class Wanted:
    file: FetchFile
    secret_ref: str | None

    @property
    def key(self) -> tuple[str, str]:
        return (self.file.sha256, self.file.url)


class Fetcher:
    def __init__(
        self,
        cache: ContentCache,
        reader: KubeClient,
        node: str,
        namespace: str,
        *,
        retry_seconds: float = 60.0,
        mismatch_retry_seconds: float = 600.0,
        site: SiteSharing | None = None,
        limiter: TokenBucket | None = None,
        windows: Windows | None = None,
        metrics: AgentMetrics | None = None,
        labels: CacheLabels | None = None,
        resolver: Resolver | None = None,
        stage_reread_seconds: float = STAGE_REREAD_SECONDS,
        claim_reread_seconds: float = CLAIM_REREAD_SECONDS,
    ) -> None:
        self.cache, self.reader, self.node, self.namespace = cache, reader, node, namespace
        self.metrics, self.labels = metrics, labels
        self.retry_seconds, self.mismatch_retry_seconds = retry_seconds, mismatch_retry_seconds
        self.site, self.limiter, self.windows = site, limiter, windows
        self.resolver: Resolver = resolver if resolver is not None else SpecResolver(reader)
        self._window_stops: set[threading.Event] = set()
        self.pods: dict[str, ModelFetch] = {}  # pod uid → its InferenceDeployment's fetch list
        self._claims: dict[str, Claim] = {}  # pod uid → what it names (resolved or pending)
        self._pending: set[str] = set()  # pod uids whose spec could not be read yet
        # Stage requests on the own Node (kept apart from pods: a pod relist must not drop them).
        self.staged: dict[StageKey, ModelFetch] = {}  # request → its object's spec.model
        self._stage_requests: frozenset[StageKey] = frozenset()
        self._stage_pending: set[StageKey] = set()  # to read (again)
        self.stage_reread_seconds = stage_reread_seconds
        self._staged_at = time.monotonic()  # when every standing request was last due
        self.claim_reread_seconds = claim_reread_seconds
        self._claims_read_at = time.monotonic()  # when the pods' objects were last read again
        self._running: dict[str, asyncio.Task[None]] = {}  # digest → its download
        # Per (digest, URL): the last failure, when to try that URL again, how many in a row.
        self._failed: dict[tuple[str, str], FetchError] = {}
        self._retry_at: dict[tuple[str, str], float] = {}
        self._strikes: dict[tuple[str, str], int] = {}
        self._thread_stop = threading.Event()
        # Redirects are followed (model hubs redirect to CDNs); httpx drops Authorization on
        # a redirect to another origin, so origin credentials never follow one.
        self._http = httpx.Client(timeout=httpx.Timeout(30.0), follow_redirects=True)

    def fetch_of(self, pod: dict[str, Any]) -> ModelFetch | None:
        """What this agent fetches for `pod`, as its watch read it from the pod's
        InferenceDeployment; None when the pod names none. Raises `Unresolved` when the watch
        has not read this pod's claim yet: the caller cannot tell (and must not guess)."""
        claim = claim_of(pod)
        if claim is None:
            return None
        uid = str((pod.get("metadata") or {}).get("uid"))
        if self._claims.get(uid) != claim or uid in self._pending:
            raise Unresolved(f"pod {uid}: {claim.namespace}/{claim.name} not read yet")
        return self.pods.get(uid)

    def wanted(self) -> dict[str, list[Wanted]]:
        """Digest → every distinct (URL, Secret) the node's pods and stage requests want it
        from, first seen first."""
        out: dict[str, dict[tuple[str, str], Wanted]] = {}
        for fetch in [*self.pods.values(), *self.staged.values()]:
            for f in fetch.all_files():
                w = Wanted(f, fetch.secret_ref)
                out.setdefault(f.sha256, {}).setdefault(w.key, w)
        return {sha: list(by_key.values()) for sha, by_key in out.items()}

    def adapter_views(self) -> dict[tuple[str, str], set[str]]:
        """(namespace, name) of every object a pod here names → the digests of its adapters
        (empty while unread, or with none): what `AdapterViews` links, per object."""
        out: dict[tuple[str, str], set[str]] = {}
        for uid, claim in self._claims.items():
            digests = out.setdefault((claim.namespace, claim.name), set())
            fetch = self.pods.get(uid)
            if fetch is not None:
                digests |= {a.sha256 for a in fetch.adapters}
        return out

    def reconcile(self) -> None:
        """Start a download for every wanted digest that is not held or running, from a URL
        whose last failure (if any) is due for a retry; keep `failed/<digest>` in step."""
        wanted = self.wanted()
        keys = {w.key for sources in wanted.values() for w in sources}
        for key in [k for k in self._failed if k not in keys]:  # nobody here wants it
            self._forget(key)
        for sha in self.cache.failed():
            if sha not in wanted:
                self.cache.clear_failure(sha)
        now = time.monotonic()
        for sha, sources in wanted.items():
            if sha in self._running or any(self.cache.has(sha, w.file.size_bytes) for w in sources):
                continue
            self._sync_record(sha, sources)
            # URLs that never failed first, then failed ones whose retry is due.
            due = sorted(
                (w for w in sources if self._retry_at.get(w.key, 0.0) <= now),
                key=lambda w: w.key in self._failed,
            )
            if due:
                self._running[sha] = asyncio.create_task(
                    self._fetch(due[0]), name=f"fetch-{sha[:12]}"
                )

    def _sync_record(self, sha: str, sources: list[Wanted]) -> None:
        """`failed/<sha>` holds a failure only while every wanted URL for it has failed: one
        tenant's wrong URL never fails another tenant's pod."""
        failures = [self._failed[w.key] for w in sources if w.key in self._failed]
        try:
            if len(failures) < len(sources):
                self.cache.clear_failure(sha)
            elif self.cache.failure(sha) != failure_line(failures[-1]):
                self.cache.record_failure(sha, failures[-1])
        except OSError as err:  # e.g. failed/ not ours (the chart's init container fixes it)
            log.error(
                "%s: cannot keep the failure record in %s: %s", sha[:12], self.cache.failures, err
            )

    def _forget(self, key: tuple[str, str]) -> None:
        self._failed.pop(key, None)
        self._retry_at.pop(key, None)
        self._strikes.pop(key, None)

    def _failed_for(self, w: Wanted, err: FetchError) -> None:
        mismatch = err.reason in (reasons.CHECKSUM_MISMATCH, reasons.SIZE_MISMATCH)
        strikes = self._strikes.get(w.key, 0) + 1
        self._strikes[w.key] = strikes
        wait = self.retry_seconds
        if mismatch:
            wait = min(self.mismatch_retry_seconds * 2 ** (strikes - 1), MAX_MISMATCH_RETRY_SECONDS)
        self._failed[w.key] = err
        self._retry_at[w.key] = time.monotonic() + wait

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
            for key in [k for k in self._failed if k[0] == sha]:
                self._forget(key)
            self.cache.clear_failure(sha)
            if self.labels is not None:
                self.labels.changed()
            log.info("cached %s from the %s in %.1fs", sha[:12], where, time.monotonic() - started)
        except FetchError as err:
            log.warning("%s from %s: %s: %s", sha[:12], w.file.url, err.reason, err)
            self._failed_for(w, err)
        except Busy:
            self._retry_at[w.key] = time.monotonic() + 5.0  # another agent process holds it
        except InterruptedError:
            return  # stopping; the partial stays for the next run
        finally:
            self._running.pop(sha, None)
        if not self._thread_stop.is_set():
            self.reconcile()  # another URL for the digest, or the failure record

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

    async def _apply(self, event: dict[str, Any]) -> None:
        pod = event.get("object") or {}
        uid = (pod.get("metadata") or {}).get("uid")
        if uid is None:
            return
        claim = claim_of(pod)
        if event.get("type") == "DELETED" or claim is None:
            self.pods.pop(uid, None)
            self._claims.pop(uid, None)
            self._pending.discard(uid)
            return
        if self._claims.get(uid) == claim and uid not in self._pending:
            return  # read already; a pod's status changes do not cost a GET
        self._claims[uid] = claim
        await self._resolve(uid)

    async def _resolve(self, uid: str) -> None:
        claim = self._claims[uid]
        same = next(
            (u for u, c in self._claims.items() if c == claim and u != uid and u in self.pods),
            None,
        )
        if same is not None:  # another pod of the same object and version: read already
            self.pods[uid] = self.pods[same]
            self._pending.discard(uid)
            return
        try:
            fetch = await self.resolver.resolve(claim)
        except API_ERRORS as err:
            log.warning("reading %s/%s: %s; again later", claim.namespace, claim.name, err)
            self._pending.add(uid)
            return
        self._pending.discard(uid)
        if fetch is None:
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
                self.pods, self._claims, self._pending = {}, {}, set()
                for pod in listed["items"]:
                    await self._apply({"type": "ADDED", "object": pod})
                self.reconcile()
                version: str | None = listed["metadata"]["resourceVersion"]
                while version is not None:
                    version = await self._watch_once(params, version)
            except API_ERRORS as err:
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
            await self._apply(event)
            self.reconcile()
        return version

    async def stage(self, requests: Collection[StageKey]) -> None:
        """The stage requests on this node's own Node, as its watch last saw them: read each new
        one's object and fetch its spec.model; a request gone is no longer wanted (its files
        stay cached, evictable)."""
        now = frozenset(requests)
        if now == self._stage_requests:
            return  # a Node event that is not about stage requests (conditions, labels)
        for namespace, name in sorted(self._stage_requests - now):
            log.info("stage request for %s/%s dropped", namespace, name)
            self.staged.pop((namespace, name), None)
            self._stage_pending.discard((namespace, name))
        added = now - self._stage_requests
        for namespace, name in sorted(added):
            log.info("stage request for %s/%s picked up", namespace, name)
        self._stage_requests = now
        self._stage_pending |= added
        if self.metrics is not None:
            self.metrics.stage_requests.set(len(now))
        await self._read_staged()
        self.reconcile()

    async def _read_staged(self) -> None:
        """Read the pending stage requests' objects; one that cannot be read stays pending."""
        for key in sorted(self._stage_pending):
            namespace, name = key
            try:
                fetch = await self.resolver.resolve(Claim(namespace, name, STAGED))
            except API_ERRORS as err:
                log.warning("reading staged %s/%s: %s; again later", namespace, name, err)
                continue
            if key not in self._stage_requests:
                continue  # dropped while it was being read
            self._stage_pending.discard(key)
            if fetch is None:
                self.staged.pop(key, None)
            else:
                self.staged[key] = fetch

    def _stage_due(self) -> None:
        """A staged object's spec may change while its request stands (no version tells)."""
        now = time.monotonic()
        if now - self._staged_at >= self.stage_reread_seconds:
            self._staged_at = now
            self._stage_pending |= self._stage_requests

    async def _reread_claims(self) -> None:
        """Every `claim_reread_seconds`: read each object the pods here name again (once per
        object), for what changes no pod: its adapters."""
        now = time.monotonic()
        if now - self._claims_read_at < self.claim_reread_seconds:
            return
        self._claims_read_at = now
        by_claim: dict[Claim, list[str]] = {}
        for uid, claim in self._claims.items():
            if uid not in self._pending:
                by_claim.setdefault(claim, []).append(uid)
        for claim, uids in by_claim.items():
            try:
                fetch = await self.resolver.resolve(claim)
            except API_ERRORS as err:
                log.warning("reading %s/%s again: %s", claim.namespace, claim.name, err)
                continue
            for uid in uids:
                if self._claims.get(uid) != claim or uid in self._pending:
                    continue  # changed while it was read: its own read stands
                if fetch is None:
                    self.pods.pop(uid, None)
                else:
                    self.pods[uid] = fetch

    async def tick(self) -> None:
        """Read the specs that could not be read before (or are due again), then start what
        is due."""
        for uid in list(self._pending):
            if uid in self._claims:
                await self._resolve(uid)
        await self._reread_claims()
        self._stage_due()
        await self._read_staged()
        self.reconcile()

    async def run(self) -> None:
        """Watch pods and the own Node's stage requests, and retry failed downloads, until
        cancelled."""
        # Created up front: a pod's read-only mount of the cache needs the directory to exist.
        self.cache.blobs.mkdir(parents=True, exist_ok=True)
        self.cache.blobs.chmod(0o755)
        self.cache.root.chmod(0o755)
        watchers = [
            asyncio.create_task(self.watch_pods()),
            asyncio.create_task(watch_own_node(self.reader, self.node, self.stage)),
        ]
        try:
            while True:
                await asyncio.sleep(min(self.retry_seconds, 10.0))
                await self.tick()
        finally:
            for watcher in watchers:
                watcher.cancel()
            self._thread_stop.set()  # downloads stop at their next chunk, partials kept
            for stop in list(self._window_stops):
                stop.set()
            await asyncio.gather(*watchers, *self._running.values(), return_exceptions=True)
            self._http.close()
