"""The node's content-addressed model cache: `<root>/sha256/<digest>`, filled over HTTP(S).

A file is named by the sha256 the spec promises, and only bytes that hash to it ever carry that
name: a download goes to `<digest>.partial`, is hashed while it is written, and is renamed into
place (after fsync) only once its size and digest match. So a reader — the prewarm init
container, which mounts the cache read-only — can trust any final name it finds, and a
crash at any moment leaves at worst a `.partial` file, which the next attempt resumes with an
HTTP `Range` request after re-hashing the bytes already on disk (hashing cannot be resumed from
a saved state with hashlib, and bytes on disk are not trusted across a crash anyway).

A download that fails for good writes one line in the shared termination-message format to
`<root>/failed/<digest>` (outside `sha256/`, which holds only blobs and partials); prewarm
reads it and fails with that reason, e.g. `ChecksumMismatch`. This module is synchronous (one
blocking HTTP stream, file writes and hashing); the agent runs it in a worker thread.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from ember_runtime.contract import reasons
from ember_runtime.contract.cache import (
    BLOBS_DIR,
    FAILED_DIR,
    USED_DIR,
    VIEWS_DIR,
    WAITING_DIR,
    is_digest,
    partial_name,
)
from ember_runtime.durable import fsync_dir, write_all
from ember_runtime.nodeagent.ratelimit import TokenBucket

log = logging.getLogger("ember_runtime.nodeagent.cache")

DEFAULT_ROOT = Path("/var/lib/ember/cache")
CHUNK_BYTES = 1 << 20
# Network errors after which the same request is resumed from the bytes already on disk.
RESUMABLE = (httpx.TransportError, httpx.RemoteProtocolError)

Progress = Callable[[int], None]  # called with the bytes now on disk for the file
Meter = Callable[[int], object]  # called with each chunk's size (a metrics counter's inc)
# Headers computed for each request (method, URL path, the request's other headers — its
# Range): a peer's signature carries the time, a nonce and the Range, so a resumed request
# signs afresh rather than reusing the first request's headers.
Signer = Callable[[str, str, dict[str, str]], dict[str, str]]
# Checks an answer's headers against the request's (a peer's signed response): why it is not
# acceptable, or None.
Checker = Callable[[httpx.Response, dict[str, str]], str | None]


class FetchError(Exception):
    """A download that failed with a reason from the shared vocabulary."""

    def __init__(
        self, detail: str, reason: str = reasons.MODEL_DOWNLOAD_FAILED, status: int | None = None
    ) -> None:
        super().__init__(detail)
        self.reason = reason
        self.status = status  # the HTTP status, when the server answered with an error


def failure_line(err: FetchError) -> str:
    """The line `record_failure` writes (and `failure` reads back) for `err`."""
    return reasons.termination_message(err.reason, str(err))


class Busy(Exception):
    """Another process is downloading the same digest right now."""


@dataclass(frozen=True)
class Want:
    """One file to hold: where it comes from and what it must be."""

    url: str
    sha256: str
    size_bytes: int
    headers: dict[str, str] = field(default_factory=dict, hash=False, compare=False)
    signer: Signer | None = field(default=None, hash=False, compare=False)
    checker: Checker | None = field(default=None, hash=False, compare=False)

    def request_headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        headers = {**self.headers, **(extra or {})}
        if self.signer is not None:
            headers.update(self.signer("GET", urlsplit(self.url).path, headers))
        return headers

    def where(self) -> str:
        """The URL without its query (which may hold a signature) for logs and messages."""
        parts = urlsplit(self.url)
        return f"{parts.scheme}://{parts.netloc}{parts.path}"


class ContentCache:
    def __init__(self, root: Path = DEFAULT_ROOT) -> None:
        self.root = root
        self.blobs = root / BLOBS_DIR
        self.failures = root / FAILED_DIR
        self.waiting = root / WAITING_DIR  # why a download waits (a window), for prewarm

    def directories(self) -> tuple[Path, ...]:
        """What the agent writes into (the chart's init container gives them to its uid): its
        blobs, failure and waiting lines, the replicas' views (nodeagent/views.py) and the
        eviction stamps (nodeagent/evict.py)."""
        return (
            self.blobs,
            self.failures,
            self.waiting,
            self.root / VIEWS_DIR,
            self.root / USED_DIR,
        )

    def path(self, sha256: str) -> Path:
        return self.blobs / sha256

    def partial(self, sha256: str) -> Path:
        return self.blobs / partial_name(sha256)

    def has(self, sha256: str, size_bytes: int) -> bool:
        try:
            return self.path(sha256).stat().st_size == size_bytes
        except OSError:
            return False

    def held(self) -> list[str]:
        """The digests of the complete files (partials and stray names excluded)."""
        try:
            names = [p.name for p in self.blobs.iterdir()]
        except OSError:
            return []
        return sorted(n for n in names if is_digest(n))

    def failure(self, sha256: str) -> str | None:
        """The recorded failure line for `sha256`, if its last download failed for good."""
        try:
            return (self.failures / sha256).read_text().strip() or None
        except OSError:
            return None

    def failed(self) -> list[str]:
        """The digests with a failure record."""
        try:
            names = [p.name for p in self.failures.iterdir()]
        except OSError:
            return []
        return sorted(n for n in names if is_digest(n))

    def record_failure(self, sha256: str, err: FetchError) -> None:
        _write_line(self.failures, sha256, failure_line(err))

    def clear_failure(self, sha256: str) -> None:
        (self.failures / sha256).unlink(missing_ok=True)

    def note_waiting(self, sha256: str, why: str) -> None:
        _write_line(self.waiting, sha256, why)

    def clear_waiting(self, sha256: str) -> None:
        (self.waiting / sha256).unlink(missing_ok=True)

    def fetch(
        self,
        client: httpx.Client,
        want: Want,
        stop: threading.Event | None = None,
        *,
        progress: Progress | None = None,
        attempts: int = 5,
        limiter: TokenBucket | None = None,
        meter: Meter | None = None,
        keep_partial: bool = True,
    ) -> Path:
        """Make `path(want.sha256)` hold the verified file; returns it.

        Resumes a `.partial` left by an earlier attempt; retries a broken stream up to
        `attempts` times, each from where the last stopped. A mismatch after resuming onto
        bytes that were already there is tried once more from the first byte before it counts
        (those bytes may have come from anywhere: a crash, a disk, an older agent), so a
        mismatch is reported only for a file downloaded whole from `want.url`. Raises FetchError
        (a checksum or size mismatch also deletes the partial, so the cache holds nothing for
        that digest), Busy, or InterruptedError when `stop` is set. `keep_partial=False` (a
        site peer: its bytes are unverified until the whole file hashes right) deletes the
        partial on any failure, so nothing a peer sent outlives its transfer. `limiter` paces
        the transfer (origin traffic; peers on the LAN go at line rate). `meter` counts the
        bytes received.
        """
        final = self.path(want.sha256)
        if self.has(want.sha256, want.size_bytes):
            return final
        self.blobs.mkdir(parents=True, exist_ok=True)
        _chmod(self.blobs, 0o755)
        pacing = _Pacing(stop, progress, limiter, meter)
        with _locked_partial(self.partial(want.sha256)) as fd:
            try:
                resumed = os.fstat(fd).st_size > 0
                digest = _download_retrying(client, want, fd, pacing, attempts=attempts)
                if digest != want.sha256 and resumed:
                    log.warning(
                        "%s: a resumed file did not hash right; from the start", want.where()
                    )
                    os.ftruncate(fd, 0)
                    digest = _download_retrying(client, want, fd, pacing, attempts=attempts)
                if digest != want.sha256:
                    raise FetchError(
                        f"{want.where()} expected {want.sha256[:12]}… got {digest[:12]}…",
                        reasons.CHECKSUM_MISMATCH,
                    )
            except BaseException as err:  # cleanup, then re-raised
                # Unverifiable bytes are dropped at once; an empty partial is only our lock.
                mismatch = (
                    isinstance(err, FetchError) and err.reason != reasons.MODEL_DOWNLOAD_FAILED
                )
                if not keep_partial or mismatch or os.fstat(fd).st_size == 0:
                    self.partial(want.sha256).unlink(missing_ok=True)
                raise
            os.fsync(fd)
            os.fchmod(fd, 0o644)
            os.replace(self.partial(want.sha256), final)
            fsync_dir(self.blobs)
        return final


@dataclass(frozen=True)
class _Pacing:
    """What the download loop consults after each chunk."""

    stop: threading.Event | None
    progress: Progress | None
    limiter: TokenBucket | None
    meter: Meter | None = None


def _download_retrying(
    client: httpx.Client, want: Want, fd: int, pacing: _Pacing, *, attempts: int
) -> str:
    stop = pacing.stop
    for attempt in range(1, attempts + 1):
        try:
            return _download(client, want, fd, pacing)
        except RESUMABLE as exc:
            if attempt == attempts:
                raise FetchError(f"{want.where()}: {exc!r}") from exc
            log.warning("%s: %r; resuming (attempt %d)", want.where(), exc, attempt + 1)
            if stop is not None and stop.wait(min(0.5 * attempt, 5.0)):
                raise InterruptedError(want.where()) from exc
    raise AssertionError("attempts must be at least 1")


def _write_line(folder: Path, name: str, line: str) -> None:
    """`folder/name` holds `line`, replaced atomically, readable by prewarm."""
    folder.mkdir(parents=True, exist_ok=True)
    _chmod(folder, 0o755)
    tmp = folder / f".{name}.tmp"
    tmp.write_text(line + "\n")
    _chmod(tmp, 0o644)
    os.replace(tmp, folder / name)


def _chmod(path: Path, mode: int) -> None:
    """Readable by prewarm (another uid); best effort where the agent does not own it."""
    with suppress(PermissionError):
        path.chmod(mode)


@contextmanager
def _locked_partial(path: Path) -> Iterator[int]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise Busy(str(path)) from exc
        yield fd
    finally:
        os.close(fd)  # also releases the lock


def _rehash(fd: int, size_bytes: int) -> tuple[hashlib._Hash, int]:
    """Hash of the partial's bytes; a partial longer than the file is started over."""
    have = os.fstat(fd).st_size
    if have > size_bytes:
        os.ftruncate(fd, 0)
        have = 0
    hasher = hashlib.sha256()
    os.lseek(fd, 0, os.SEEK_SET)
    left = have
    while left:
        chunk = os.read(fd, min(CHUNK_BYTES, left))
        if not chunk:
            break
        hasher.update(chunk)
        left -= len(chunk)
    return hasher, have - left


def _download(client: httpx.Client, want: Want, fd: int, pacing: _Pacing) -> str:
    """Append the missing bytes to the partial; returns the sha256 of the whole file."""
    stop, progress, limiter = pacing.stop, pacing.progress, pacing.limiter
    hasher, have = _rehash(fd, want.size_bytes)
    if have < want.size_bytes:
        headers = want.request_headers({"Range": f"bytes={have}-"} if have else None)
        with client.stream("GET", want.url, headers=headers) as resp:
            problem = want.checker(resp, headers) if want.checker is not None else None
            if problem is not None:
                raise FetchError(f"{want.where()}: {problem}", status=resp.status_code)
            have, hasher = _start(resp, want, fd, have, hasher)
            for chunk in resp.iter_bytes(CHUNK_BYTES):
                if stop is not None and stop.is_set():
                    raise InterruptedError(want.where())
                if have + len(chunk) > want.size_bytes:
                    _size_mismatch(fd, want, have + len(chunk))
                write_all(fd, chunk)
                hasher.update(chunk)
                have += len(chunk)
                if progress is not None:
                    progress(have)
                if pacing.meter is not None:
                    pacing.meter(len(chunk))
                if limiter is not None:
                    limiter.take(len(chunk), stop)
    if have != want.size_bytes:
        # The origin closed cleanly but early (no Content-Length to catch it): resume.
        raise httpx.RemoteProtocolError(f"stream ended at {have} of {want.size_bytes} bytes")
    return hasher.hexdigest()


def _start(
    resp: httpx.Response, want: Want, fd: int, have: int, hasher: hashlib._Hash
) -> tuple[int, hashlib._Hash]:
    """Check the answer and position the partial for appending; (offset, hasher) to go on."""
    if resp.status_code == 206 and have:
        start = _content_range_start(resp.headers.get("content-range", ""))
        if start != have:
            raise FetchError(f"{want.where()}: asked for bytes {have}-, got Content-Range {start}")
    elif resp.status_code == 200:
        # The origin ignored Range (or there was none): take the whole body from the start.
        os.ftruncate(fd, 0)
        have, hasher = 0, hashlib.sha256()
    else:
        raise FetchError(
            f"{want.where()}: HTTP {resp.status_code} {resp.reason_phrase}",
            status=resp.status_code,
        )
    os.lseek(fd, have, os.SEEK_SET)
    return have, hasher


def _content_range_start(value: str) -> int | None:
    """`bytes 100-199/200` → 100."""
    unit, _, rest = value.partition(" ")
    first = rest.partition("-")[0]
    return int(first) if unit == "bytes" and first.isdigit() else None


def _size_mismatch(fd: int, want: Want, got: int) -> None:
    os.ftruncate(fd, 0)
    raise FetchError(
        f"{want.where()} expected {want.size_bytes} bytes got at least {got}",
        reasons.SIZE_MISMATCH,
    )
