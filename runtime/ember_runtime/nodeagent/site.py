"""One origin (WAN) fetch per site: the agents of a site share what they hold over the LAN.

Nodes of a site carry the label `ember.dev/site`. For a file its node needs, an agent

1. fetches it from a site peer that holds it (the peer's Node says so, below), else
2. takes the site's Lease for that file, `ember-fetch-<site>-<digest[:16]>` in the agent's
   namespace (holderIdentity = its node name, renewed every third of `lease_seconds` while
   it downloads), and downloads from the origin; or, when another node holds the Lease,
   waits until a peer holds the file and fetches it from that peer. A Lease that nobody
   renewed for `lease_seconds` (as timed by this agent's own clock, the way client-go's
   leader election does, so the nodes' clocks need not agree) is taken over.

Discovery goes through each agent's own Node object: annotations `ember.dev/peer`
(`<InternalIP>:<peer_port>`), `ember.dev/peer-key` (its public key, peerauth) and
`ember.dev/cache` (the short digests, 16 hex characters, of the complete files it holds,
comma-separated — a sha256 does not fit a label value, and 64 bits are plenty to tell a site's
models apart; the receiver verifies the full digest anyway). The Nodes listed by the site
label are the only peers whose keys this agent accepts, asking or answering.
The agent watches the Nodes of its site and writes its own annotations on change only.

With maxBandwidth set (`origin_slot`), the holder of a file's Lease also waits for the site's
origin slot, the Lease `ember-fetch-<site>-0000000000000000` (held, renewed and taken over the
same way, and released when its download ends): a site downloads one file from the origin at a
time, so maxBandwidth is the site's WAN rate, not each node's.

A holder whose origin download fails a checksum or size check says so on the Lease
(`ember.dev/failed`, with the URL), so the rest of the site records the same failure for that URL
instead of waiting; another URL for the digest takes the Lease over and tries again, and so does
the same URL once the failure is `failure_seconds` old. Only a file downloaded whole from the
origin can fail so (`ContentCache.fetch`): bytes from a peer are discarded when their transfer
fails, so a peer's bad bytes never become the spec's failure.

Partition tolerance: with the API server unreachable (or refusing), an agent finishes the
transfers it has started, tries the site peers it last knew (asking them directly, since their
annotations cannot be read), and goes to the origin only after `origin_wait_seconds`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import logging
import random
import re
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from ember_runtime.contract import reasons
from ember_runtime.contract.resource import SITE_LABEL
from ember_runtime.kube import API_ERRORS, ApiError
from ember_runtime.nodeagent import peerauth
from ember_runtime.nodeagent.cache import Checker, ContentCache, FetchError, Signer, Want
from ember_runtime.nodeagent.metrics import PEER, AgentMetrics

log = logging.getLogger("ember_runtime.nodeagent.site")

PEER_ANNOTATION = "ember.dev/peer"
CACHE_ANNOTATION = "ember.dev/cache"
FAILED_ANNOTATION = "ember.dev/failed"
FAILED_URL_ANNOTATION = "ember.dev/failed-url"
RELEASED_ANNOTATION = "ember.dev/released"  # the holder is done: free to take at once
# The site's origin slot (maxBandwidth per site): a fetch Lease named for the all-zero digest,
# which no file has, so it fits the Lease policy's ember-fetch-<site>-<16 hex> like the rest.
ORIGIN_SLOT = "0" * 64
SHA_ANNOTATION = "ember.dev/sha256"
SHORT = 16
MERGE_PATCH = "application/merge-patch+json"
BAD_PEER_SECONDS = 30.0

Origin = Callable[[], Awaitable[object]]


class Api(Protocol):
    """The calls the site code makes (kube.KubeClient: the agent's own token)."""

    async def get(self, path: str, params: dict[str, str] | None = None) -> dict[str, Any]: ...

    async def send(
        self, method: str, path: str, body: dict[str, Any], content_type: str = ...
    ) -> dict[str, Any]: ...

    def watch(self, path: str, params: dict[str, str]) -> AsyncIterator[dict[str, Any]]: ...


def short(sha256: str) -> str:
    return sha256[:SHORT]


def lease_name(site: str, sha256: str) -> str:
    """A DNS-subdomain name: the site in lower case, other characters as '-'."""
    clean = re.sub(r"[^a-z0-9-]+", "-", site.lower()).strip("-")[:200] or "site"
    return f"ember-fetch-{clean}-{short(sha256)}"


def micro_time(now: float | None = None) -> str:
    """A Kubernetes MicroTime."""
    stamp = dt.datetime.fromtimestamp(time.time() if now is None else now, dt.UTC)
    return stamp.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class SiteConfig:
    node: str
    namespace: str
    peer_port: int
    peer_address: str | None = None  # host:port to advertise (default InternalIP:peer_port)
    lease_seconds: int = 30
    origin_wait_seconds: float = 600.0
    site_label: str = SITE_LABEL
    failure_seconds: float = 300.0  # a failure on a Lease stands this long, then is retried
    # One origin download per site at a time (any file), under the site's origin slot: set
    # with maxBandwidth, which then limits the site's WAN use, not each node's.
    origin_slot: bool = False


class SiteChanged(Exception):
    """Our own Node's site label changed under the watch."""


@dataclass
class Peer:
    address: str
    holds: frozenset[str] = frozenset()
    key: str | None = None  # its public key (peerauth); None: not trusted, not asked


@dataclass
class LeaseState:
    mine: bool
    holder: str | None = None
    failed: str | None = None  # the holder's termination line, for this URL


class Leases:
    """Get, create and update the site's fetch Leases; nothing else (RBAC grants just that)."""

    def __init__(
        self, api: Api, cfg: SiteConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.api, self.cfg, self._clock = api, cfg, clock
        # name → (resourceVersion, when this agent first saw it): expiry by our own clock.
        self._observed: dict[str, tuple[str, float]] = {}

    def _path(self, name: str = "") -> str:
        base = f"/apis/coordination.k8s.io/v1/namespaces/{self.cfg.namespace}/leases"
        return f"{base}/{name}" if name else base

    def _claim(self, lease: dict[str, Any], transitions: int) -> dict[str, Any]:
        now = micro_time()
        lease["spec"] = {
            "holderIdentity": self.cfg.node,
            "leaseDurationSeconds": self.cfg.lease_seconds,
            "acquireTime": now,
            "renewTime": now,
            "leaseTransitions": transitions,
        }
        annotations = lease["metadata"].setdefault("annotations", {})
        annotations.pop(FAILED_ANNOTATION, None)
        annotations.pop(FAILED_URL_ANNOTATION, None)
        annotations.pop(RELEASED_ANNOTATION, None)
        return lease

    async def acquire(self, name: str, site: str, want: Want) -> LeaseState:
        try:
            lease = await self.api.get(self._path(name))
        except ApiError as err:
            if err.status != 404:
                raise
            return await self._create(name, site, want)
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or None
        annotations = lease["metadata"].get("annotations") or {}
        failed = annotations.get(FAILED_ANNOTATION)
        released = annotations.get(RELEASED_ANNOTATION) == "true"
        if (
            failed
            and annotations.get(FAILED_URL_ANNOTATION) == want.url
            and holder != self.cfg.node
            and not self._expired(name, lease, self.cfg.failure_seconds)
        ):
            # A failure expires (by this agent's clock, like a Lease): the URL may be fixed.
            return LeaseState(mine=False, holder=holder, failed=failed)
        if holder == self.cfg.node and not failed and not released:
            return LeaseState(mine=True, holder=holder)  # ours from before a restart
        if holder and not failed and not released and not self._expired(name, lease):
            return LeaseState(mine=False, holder=holder)
        log.info("taking over Lease %s from %s", name, holder or "nobody")
        body = self._claim(lease, int(spec.get("leaseTransitions") or 0) + 1)
        try:
            await self.api.send("PUT", self._path(name), body)
        except ApiError as err:
            if err.status == 409:  # another node took it first
                return LeaseState(mine=False, holder=None)
            raise
        return LeaseState(mine=True, holder=self.cfg.node)

    async def _create(self, name: str, site: str, want: Want) -> LeaseState:
        meta = {
            "name": name,
            "namespace": self.cfg.namespace,
            "labels": {SITE_LABEL: site[:63]} if _label_value(site) else {},
            "annotations": {SHA_ANNOTATION: want.sha256},
        }
        body = self._claim(
            {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta}, 0
        )
        try:
            await self.api.send("POST", self._path(), body)
        except ApiError as err:
            if err.status == 409:  # created by another node a moment ago
                return LeaseState(mine=False, holder=None)
            raise
        return LeaseState(mine=True, holder=self.cfg.node)

    def _expired(self, name: str, lease: dict[str, Any], duration: float | None = None) -> bool:
        """Unchanged for `duration` (default: the Lease's own) since this agent first saw it."""
        version = str(lease["metadata"].get("resourceVersion"))
        if duration is None:
            duration = float((lease.get("spec") or {}).get("leaseDurationSeconds") or 0)
        now = self._clock()
        seen = self._observed.get(name)
        if seen is None or seen[0] != version:
            self._observed[name] = (version, now)
            return False
        return now - seen[1] > duration

    async def renew(self, name: str) -> bool:
        """Renew our Lease; False when another node holds it now."""
        lease = await self.api.get(self._path(name))
        if (lease.get("spec") or {}).get("holderIdentity") != self.cfg.node:
            return False
        lease["spec"]["renewTime"] = micro_time()
        await self.api.send("PUT", self._path(name), lease)
        return True

    async def release(self, name: str) -> None:
        """Say we are done with our Lease, so the next node need not wait for it to expire."""
        lease = await self.api.get(self._path(name))
        if (lease.get("spec") or {}).get("holderIdentity") != self.cfg.node:
            return
        lease["metadata"].setdefault("annotations", {})[RELEASED_ANNOTATION] = "true"
        await self.api.send("PUT", self._path(name), lease)

    async def mark_failed(self, name: str, url: str, line: str) -> None:
        lease = await self.api.get(self._path(name))
        if (lease.get("spec") or {}).get("holderIdentity") != self.cfg.node:
            return
        annotations = lease["metadata"].setdefault("annotations", {})
        annotations[FAILED_ANNOTATION] = line
        annotations[FAILED_URL_ANNOTATION] = url
        await self.api.send("PUT", self._path(name), lease)


def _label_value(value: str) -> bool:
    return (
        bool(re.fullmatch(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]", value)) and len(value) <= 63
    )


def internal_ip(node: dict[str, Any]) -> str | None:
    for address in (node.get("status") or {}).get("addresses") or []:
        if address.get("type") == "InternalIP":
            return str(address.get("address"))
    return None


def peer_of(node: dict[str, Any]) -> Peer | None:
    annotations = (node.get("metadata") or {}).get("annotations") or {}
    address = annotations.get(PEER_ANNOTATION)
    if not address:
        return None
    held = frozenset(s for s in annotations.get(CACHE_ANNOTATION, "").split(",") if s)
    return Peer(address, held, annotations.get(peerauth.KEY_ANNOTATION) or None)


@dataclass
class _View:
    """What this agent knows of its site; kept from the last answer when the API goes away."""

    site: str | None = None
    address: str | None = None
    resolved: bool = False
    peers: dict[str, Peer] = field(default_factory=dict)  # node name → peer


class SiteSharing:
    """Gets files from the site (peers, or the origin under the site's Lease) for the Fetcher."""

    def __init__(
        self,
        cache: ContentCache,
        api: Api,
        cfg: SiteConfig,
        *,
        me: peerauth.Identity,
        http: httpx.Client,
        stop: threading.Event,
        metrics: AgentMetrics | None = None,
    ) -> None:
        self.cache, self.api, self.cfg, self.me, self.http = cache, api, cfg, me, http
        self.stop = stop
        self.metrics = metrics
        self.leases = Leases(api, cfg)
        self.view = _View()
        self._changed = asyncio.Event()
        self._dirty = asyncio.Event()
        self._bad_until: dict[str, float] = {}
        self.origin_fetches = 0
        self.peer_fetches = 0

    # --- what the site holds -------------------------------------------------------------

    def _notify(self) -> None:
        old, self._changed = self._changed, asyncio.Event()
        old.set()

    async def _resolve(self) -> None:
        """Our site and the address we serve on, from our own Node."""
        node = await self.api.get(f"/api/v1/nodes/{self.cfg.node}")
        labels = (node.get("metadata") or {}).get("labels") or {}
        self.view.site = labels.get(self.cfg.site_label) or None
        ip = internal_ip(node)
        self.view.address = self.cfg.peer_address or (
            f"{ip}:{self.cfg.peer_port}" if ip is not None else None
        )
        self.view.resolved = True
        self._notify()
        self._dirty.set()
        log.info(
            "site %s; serving peers on %s", self.view.site or "(none)", self.view.address or "-"
        )

    def _apply_node(self, kind: str, node: dict[str, Any]) -> None:
        name = (node.get("metadata") or {}).get("name")
        if not name:
            return
        if name == self.cfg.node:
            labels = (node.get("metadata") or {}).get("labels") or {}
            if kind == "DELETED" or labels.get(self.cfg.site_label) != self.view.site:
                # Our node left the site (relabelled): read our node again, watch the new one.
                self.view.resolved = False
                raise SiteChanged(self.cfg.node)
            return
        peer = peer_of(node)
        if kind == "DELETED" or peer is None:
            self.view.peers.pop(name, None)
        else:
            self.view.peers[name] = peer
        self._notify()

    async def watch_site(self) -> None:
        """Resolve our node, then list and watch the site's Nodes (their peer annotations)."""
        while True:
            try:
                if not self.view.resolved:
                    await self._resolve()
                if self.view.site is None:
                    return  # no site: nothing to share, every file comes from the origin
                await self._list_and_watch(f"{self.cfg.site_label}={self.view.site}")
            except SiteChanged:
                log.info("%s changed site; reading it again", self.cfg.node)
            except API_ERRORS as err:
                log.warning("watching site nodes: %s; again in 5s", err)
                await asyncio.sleep(5)

    async def _list_and_watch(self, selector: str) -> None:
        params = {"labelSelector": selector}
        listed = await self.api.get("/api/v1/nodes", params)
        self.view.peers = {}
        for node in listed["items"]:
            self._apply_node("ADDED", node)
        version: str | None = listed["metadata"]["resourceVersion"]
        while version is not None:
            query = {**params, "resourceVersion": version, "allowWatchBookmarks": "true"}
            async for event in self.api.watch("/api/v1/nodes", query):
                if event.get("type") == "ERROR":
                    version = None
                    break
                obj = event.get("object") or {}
                version = (obj.get("metadata") or {}).get("resourceVersion", version)
                if event.get("type") != "BOOKMARK":
                    self._apply_node(str(event.get("type")), obj)

    def published(self) -> None:
        """The cache changed: write our Node's annotations (soon, once)."""
        self._dirty.set()

    def _desired(self) -> dict[str, str] | None:
        if not self.view.resolved or self.view.address is None or self.view.site is None:
            return None
        held = ",".join(short(sha) for sha in self.cache.held())
        return {
            PEER_ANNOTATION: self.view.address,
            peerauth.KEY_ANNOTATION: self.me.public,
            CACHE_ANNOTATION: held,
        }

    async def publish_forever(self, resync_seconds: float = 60.0) -> None:
        """Write our Node's annotations on change (newest wins), retrying while the API is
        away; a periodic look also catches files that reached the cache some other way."""
        written: dict[str, str] | None = None
        path = f"/api/v1/nodes/{self.cfg.node}"
        while True:
            self._dirty.clear()  # before reading the cache: a later change sets it again
            desired = self._desired()
            if desired is not None and desired != written:
                try:
                    await self.api.send(
                        "PATCH", path, {"metadata": {"annotations": desired}}, MERGE_PATCH
                    )
                    written = desired
                except API_ERRORS as err:
                    log.warning("publishing what %s holds: %s; again in 5s", self.cfg.node, err)
                    await asyncio.sleep(5)
                    continue
            with suppress(TimeoutError):
                await asyncio.wait_for(self._dirty.wait(), resync_seconds)

    async def run(self) -> None:
        """Watch the site and publish what we hold until cancelled."""
        tasks = [
            asyncio.create_task(self.watch_site()),
            asyncio.create_task(self.publish_forever()),
        ]
        try:
            await asyncio.gather(*tasks)
        finally:
            self.stop.set()  # peer transfers stop at their next chunk
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # --- getting one file ----------------------------------------------------------------

    def peer_key(self, node: str) -> str | None:
        """The key of `node` if it is a peer of our site (as last seen: also while the API
        server is away); the peer port serves only these."""
        peer = self.view.peers.get(node)
        return peer.key if peer is not None else None

    def _candidates(self, sha256: str, any_peer: bool) -> list[tuple[str, str]]:
        now = time.monotonic()
        found = [
            (node, p.address)
            for node, p in self.view.peers.items()
            if p.key is not None
            and (any_peer or short(sha256) in p.holds)
            and self._bad_until.get(p.address, 0) <= now
        ]
        random.shuffle(found)  # spread a wave of waiters over the peers that hold it
        return found

    async def _from_peers(self, want: Want, any_peer: bool = False) -> bool:
        for node, address in self._candidates(want.sha256, any_peer):
            url = f"http://{address}/sha256/{want.sha256}"
            signer, checker = self._authenticator(node)
            from_peer = Want(url, want.sha256, want.size_bytes, signer=signer, checker=checker)
            meter = self.metrics.meter(PEER).inc if self.metrics is not None else None
            try:
                # keep_partial=False: a peer's bytes are not kept past a failed transfer, so
                # the origin never resumes onto them (they would fail as the spec's fault).
                await asyncio.to_thread(
                    functools.partial(
                        self.cache.fetch,
                        self.http,
                        from_peer,
                        self.stop,
                        attempts=2,
                        meter=meter,
                        keep_partial=False,
                    )
                )
            except (FetchError, httpx.HTTPError) as err:
                # A peer that answered wrongly is the peer's fault, never the spec's: no
                # failure is recorded, the next peer (or the origin) is tried. A 404 only
                # says it does not hold the file yet (asked directly while partitioned), a
                # 403 that it has not seen our key yet (we restarted a moment ago): ask
                # again next round rather than shunning it.
                if isinstance(err, FetchError) and err.status in (403, 404):
                    log.debug("peer %s does not hold %s yet", address, short(want.sha256))
                    continue
                level = logging.DEBUG if any_peer else logging.WARNING
                log.log(level, "peer %s for %s: %s", address, short(want.sha256), err)
                self._bad_until[address] = time.monotonic() + BAD_PEER_SECONDS
                continue
            self.peer_fetches += 1
            if self.metrics is not None:
                self.metrics.fetched_files.labels(PEER).inc()
            log.info("got %s from peer %s", short(want.sha256), address)
            return True
        return False

    def _authenticator(self, node: str) -> tuple[Signer, Checker]:
        """Sign requests to `node` and accept only its signed answers to them."""

        def sign(method: str, path: str, headers: dict[str, str]) -> dict[str, str]:
            range_ = headers.get("Range", "")
            return peerauth.sign_request(self.me, method, path, node, range_=range_)

        def check(resp: httpx.Response, request: dict[str, str]) -> str | None:
            path = resp.request.url.path
            key = self.peer_key(node)
            return peerauth.verify_response(
                key, node, resp.status_code, path, request=request, headers=resp.headers
            )

        return sign, check

    async def _wait_change(self, timeout: float) -> None:
        with suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)

    async def obtain(self, want: Want, origin: Origin) -> str:
        """Make the cache hold `want`; returns where it came from ("peer" or "origin").

        Raises FetchError (the origin's, or the one the site's holder recorded), Busy or
        InterruptedError like ContentCache.fetch."""
        poll = max(1.0, self.cfg.lease_seconds / 3)
        down_since: float | None = None
        while True:
            if self.stop.is_set():
                raise InterruptedError(want.where())
            if await self._from_peers(want):
                return "peer"
            if self.view.resolved and self.view.site is None:
                await origin()  # a node of no site: nobody to share with
                self.origin_fetches += 1
                return "origin"
            try:
                if not self.view.resolved:
                    raise ApiError(503, "own Node not read yet")
                name = lease_name(self.view.site or "", want.sha256)
                state = await self.leases.acquire(name, self.view.site or "", want)
                down_since = None
            except API_ERRORS as err:
                now = time.monotonic()
                down_since = down_since if down_since is not None else now
                if await self._from_peers(want, any_peer=True):
                    return "peer"
                if now - down_since >= self.cfg.origin_wait_seconds:
                    log.warning(
                        "%s: no coordination for %.0fs (%s); fetching from the origin",
                        short(want.sha256),
                        now - down_since,
                        err,
                    )
                    await origin()
                    self.origin_fetches += 1
                    return "origin"
                await self._wait_change(min(poll, self.cfg.origin_wait_seconds))
                continue
            if state.failed:
                raise _failure(state.failed, state.holder)
            if state.mine:
                await self._hold(name, want, origin)
                return "origin"
            log.debug("%s: %s fetches it; waiting", short(want.sha256), state.holder)
            await self._wait_change(poll)

    async def _hold(self, name: str, want: Want, origin: Origin) -> None:
        log.info("holding Lease %s: fetching %s from the origin", name, short(want.sha256))
        renewer = asyncio.create_task(self._renew_forever(name))
        try:
            if self.cfg.origin_slot:
                await self._in_origin_slot(origin)
            else:
                await origin()
            self.origin_fetches += 1
        except FetchError as err:
            if err.reason in (reasons.CHECKSUM_MISMATCH, reasons.SIZE_MISMATCH):
                line = reasons.termination_message(err.reason, str(err))
                try:
                    await self.leases.mark_failed(name, want.url, line)
                except API_ERRORS as api_err:
                    log.warning("could not record the failure on Lease %s: %s", name, api_err)
            raise
        finally:
            renewer.cancel()
            await asyncio.gather(renewer, return_exceptions=True)

    async def _in_origin_slot(self, origin: Origin) -> None:
        """Run `origin` while holding the site's origin slot, so the site downloads one file
        from the origin at a time and maxBandwidth is the site's WAN use. Without the API
        server for origin_wait_seconds it goes ahead without the slot, as obtain() does."""
        slot = lease_name(self.view.site or "", ORIGIN_SLOT)
        held = await self._wait_origin_slot(slot)
        renewer = asyncio.create_task(self._renew_forever(slot)) if held else None
        try:
            await origin()
        finally:
            if renewer is not None:
                renewer.cancel()
                await asyncio.gather(renewer, return_exceptions=True)
                try:
                    await self.leases.release(slot)
                except API_ERRORS as err:
                    log.warning("releasing the origin slot %s: %s", slot, err)

    async def _wait_origin_slot(self, slot: str) -> bool:
        """True once we hold the slot; False when coordination is away too long."""
        poll = max(1.0, self.cfg.lease_seconds / 3)
        down_since: float | None = None
        nobody = Want("", ORIGIN_SLOT, 0)
        while True:
            if self.stop.is_set():
                raise InterruptedError(slot)
            try:
                state = await self.leases.acquire(slot, self.view.site or "", nobody)
                down_since = None
            except API_ERRORS as err:
                now = time.monotonic()
                down_since = down_since if down_since is not None else now
                if now - down_since >= self.cfg.origin_wait_seconds:
                    log.warning("origin slot %s: no coordination (%s); going ahead", slot, err)
                    return False
                state = LeaseState(mine=False)
            if state.mine:
                return True
            log.debug("origin slot %s held by %s; waiting", slot, state.holder)
            await asyncio.sleep(poll)

    async def _renew_forever(self, name: str) -> None:
        every = max(1.0, self.cfg.lease_seconds / 3)
        while True:
            await asyncio.sleep(every)
            try:
                if not await self.leases.renew(name):
                    log.warning("Lease %s taken by another node; finishing this download", name)
                    return
            except API_ERRORS as err:
                # Partitioned: the download goes on; the site may start a second one after
                # lease_seconds, the price of not stopping a transfer that is under way.
                log.warning("renewing Lease %s: %s", name, err)


def _failure(line: str, holder: str | None) -> FetchError:
    parsed = reasons.parse_termination_message(line)
    reason, detail = parsed if parsed is not None else (reasons.MODEL_DOWNLOAD_FAILED, line)
    return FetchError(f"{detail} (fetched by {holder or 'a site peer'})", reason)
