"""Notice kubelet restarts: `kubelet.sock` recreated, or our own socket deleted.

A restarting kubelet wipes the sockets in its device plugin dir and creates a new
`kubelet.sock`; a plugin that does not notice stays unregistered (kubernetes #118534). inotify
reports both at once; a short poll of the socket's inode backs it up for missed events and for a
directory that does not exist yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

from inotify_simple import INotify
from inotify_simple import flags as inflags

log = logging.getLogger(__name__)

_EVENTS = inflags.CREATE | inflags.DELETE | inflags.MOVED_TO | inflags.MOVED_FROM


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


class KubeletWatcher:
    """Calls `on_restart` when the kubelet socket gets a new inode or `plugin_alive()` is false."""

    def __init__(
        self,
        kubelet_socket: Path,
        plugin_alive: Callable[[], bool],
        on_restart: Callable[[], Awaitable[None]],
        poll_interval: float = 0.5,
    ) -> None:
        self._kubelet_socket = kubelet_socket
        self._plugin_alive = plugin_alive
        self._on_restart = on_restart
        self._poll = poll_interval
        self._wake = asyncio.Event()
        self._inotify: INotify | None = None

    async def run(self) -> None:
        seen = _inode(self._kubelet_socket)
        try:
            while True:
                self._ensure_watch()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self._poll)
                self._wake.clear()
                now = _inode(self._kubelet_socket)
                kubelet_new = now is not None and now != seen
                seen = now
                if kubelet_new or not self._plugin_alive():
                    log.info(
                        "kubelet restart noticed (%s); re-registering",
                        "new kubelet.sock" if kubelet_new else "our socket was removed",
                    )
                    await self._on_restart()
        finally:
            self._close()

    def _ensure_watch(self) -> None:
        if self._inotify is not None:
            return
        inotify = INotify(nonblocking=True)
        try:
            inotify.add_watch(os.fspath(self._kubelet_socket.parent), _EVENTS)
        except OSError:
            inotify.close()  # the directory may not exist yet; polling covers it
            return
        self._inotify = inotify

        def on_events() -> None:
            with contextlib.suppress(BlockingIOError):
                inotify.read()
            self._wake.set()

        asyncio.get_running_loop().add_reader(inotify.fileno(), on_events)

    def _close(self) -> None:
        if self._inotify is not None:
            asyncio.get_running_loop().remove_reader(self._inotify.fileno())
            self._inotify.close()
            self._inotify = None
