"""Kopf's plumbing, set up the way Ember needs it: login, the (empty) diff base, the log filter,
Kopf's own settings, and the operator's background tasks (the hot-node queue, retries with
backoff, coalesced status refreshes). The handlers that call these are in `handlers`.

Importing this module installs the log filter and the orjson watch decoder (`kopf_json`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from collections.abc import Coroutine, Iterable
from typing import Any

import kopf

from ember_operator import kopf_json


class QuietSuccess(logging.Filter):
    """Drops Kopf's "Handler '…' succeeded." lines: event handlers run on every watch event
    (a line per pod status change across the fleet). Failures, retries and everything our own
    code logs (each child applied, each repair) still pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO:
            return True
        message = record.getMessage()
        return not (message.startswith("Handler '") and message.endswith("' succeeded."))


logging.getLogger("kopf.objects").addFilter(QuietSuccess())
kopf_json.install()


def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """Kopf's own login, not the client library's: that one reads $KUBECONFIG only at import."""
    info: kopf.ConnectionInfo | None = kopf.login_with_service_account(**kwargs)
    host = os.environ.get("KUBERNETES_SERVICE_HOST")
    port = os.environ.get("KUBERNETES_SERVICE_PORT")
    if info is not None and host and port:
        # Like client-go's in-cluster config: the env vars, not the kubernetes.default.svc name
        # Kopf assumes, so clusters without cluster DNS (common on edge boxes) work too.
        info = dataclasses.replace(info, server=f"https://{_host(host)}:{port}")
    return info or kopf.login_with_kubeconfig(**kwargs)


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host  # IPv6 literals need brackets in URLs


class NoDiffBase(kopf.DiffBaseStorage):
    """Kopf's diff base for change-detecting handlers (on.create/update/resume, timers,
    daemons), of which Ember registers none: every handler here is `on.event` or an index.
    Kopf still builds the "essence" of every event's body (a deep copy, managedFields and all)
    and diffs it; at fleet scale that copying was a tenth of the operator's CPU. Empty
    essences on both sides make the diff empty, and nothing is stored on the objects.
    `test_handlers.py` fails if Ember ever registers a change-detecting handler, and
    `configure` keeps Kopf's own storage in a process that has one."""

    def build(
        self, *, body: kopf.Body, extra_fields: Iterable[Any] | None = None
    ) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return kopf.BodyEssence()  # not None ("never handled"): the diff is then empty too

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        return None


def has_change_handlers(registry: kopf.OperatorRegistry) -> bool:
    """Whether anything in this process needs Kopf's diffs: not Ember's own handlers, but a
    process that loads other handlers beside them (the test suite runs a toy operator with an
    on.create in the same process) must keep Kopf's storage. Kopf has no public accessor."""
    return bool(
        list(registry._changing.get_all_handlers()) or list(registry._spawning.get_all_handlers())
    )


def configure(settings: kopf.OperatorSettings, watch_selectors: dict[Any, str]) -> None:
    # Kopf would post an Event for every handler success; only warnings are worth a write.
    settings.posting.level = logging.WARNING
    # Re-open watches before idle load balancers silently drop them (kopf docs, "Configuration").
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.execution.max_workers = 12
    if not has_change_handlers(kopf.get_default_registry()):
        settings.persistence.diffbase_storage = NoDiffBase()
    for resource, selector in watch_selectors.items():  # filtered by the API server
        settings.watching.field_selectors[resource] = selector


def start(memo: kopf.Memo, name: str, work: Coroutine[Any, Any, None]) -> None:
    """A background task of the operator's (a queue of delayed work), stopped by `stop`."""
    memo.setdefault("tasks", {})[name] = asyncio.create_task(work, name=name)


async def stop(memo: kopf.Memo) -> None:
    for task in memo.get("tasks", {}).values():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
