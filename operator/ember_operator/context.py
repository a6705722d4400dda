"""The operator's context: its clients, caches, indexes and settings, one object in Kopf's memo.

Built once at start-up (`build`), read by every handler; nothing here talks to the API server
itself. The plans cached here are `reconcile`'s; the indexes are Kopf's live views.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ember_runtime.contract.config import RuntimeConfig
from kubernetes import client
from kubernetes.client import ApiClient

from ember_operator import render, sizing
from ember_operator.api.models import InferenceDeploymentSpec
from ember_operator.apply import Applier, api_client
from ember_operator.requeue import Coalescer, Requeue
from ember_operator.settings import OperatorSettings
from ember_operator.status_writer import StatusWriter
from ember_operator.thermal.nodes import HotNodes
from ember_operator.thermal.steps import LadderSteps

# Kopf's indexes by handler id: the children's owners are found through these (`reconcile`).
INDEXES = (
    "infd_index",
    "configmap_index",
    "service_index",
    "deployment_index",
    "pdb_index",
    "pod_index",
    "node_index",
)
# Threads for reconciles (render, then applies that wait on the API server), apart from the
# default pool that status refreshes use: a burst of new objects queued 1,000 reconciles
# ahead of every status write (nothing showed Ready until the last child was applied), and
# the default's 6 threads on 2 CPUs left the API server idle between applies.
RECONCILE_THREADS = 12
# Pod and Deployment events of one object are gathered into one status write until it has
# been quiet this long (at most 3× this after the first, `requeue.Coalescer`): a lone thermal
# change reaches status well inside its 2 s, and a replica's start-up events (scheduled,
# running, ready, the Deployment's counts) share one write.
STATUS_WINDOW_SECONDS = 0.5


class Child(NamedTuple):
    name: str
    digest: str  # of the rendered manifest (`apply.stamp`)


class Plan(NamedTuple):
    """What a generation's spec means, kept per (uid, generation). Not the manifests themselves
    (tens of KiB per object): their digests, and `manifests_of` renders them when one must be
    compared or written."""

    spec: InferenceDeploymentSpec
    config: RuntimeConfig  # what the ConfigMap carries to the node
    sized: sizing.Sizing
    children: dict[str, Child]  # kind -> child
    problems: list[render.Problem]

    @property
    def adaptive(self) -> bool:
        return self.spec.thermal.adaptive


@dataclass
class Context:
    api: ApiClient
    applier: Applier
    settings: OperatorSettings
    writer: StatusWriter
    hot: HotNodes
    steps: LadderSteps
    plans: OrderedDict[tuple[str, int], Plan] = field(default_factory=OrderedDict)
    fresh: OrderedDict[tuple[str, int], list[dict[str, Any]]] = field(default_factory=OrderedDict)
    reconciles: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(RECONCILE_THREADS, "ember-reconcile")
    )
    lock: threading.Lock = field(default_factory=threading.Lock)
    identities: set[str] = field(default_factory=set)  # namespaces with the runtime's SA
    # Rollouts: each revision's (spec, config, sizing), by (uid, revision); and what each Node
    # with a site last showed (`controller.node_changed` steps rollouts on a change only).
    revisions: dict[tuple[str, str], Any] = field(default_factory=dict)
    nodes_seen: dict[str, Any] = field(default_factory=dict)
    requeue: Requeue = field(default_factory=Requeue)
    refreshes: Coalescer = field(default_factory=lambda: Coalescer(STATUS_WINDOW_SECONDS))
    # Kopf's indexes (live views, `INDEXES`), set at start-up: delayed work reads them later.
    indexes: Mapping[str, Any] = field(default_factory=dict)
    # Kopf serialises events per object, but an owner's own events and its children's events run
    # in different threads: one lock per owner keeps their reconciles from interleaving.
    owner_locks: dict[tuple[str, str], threading.Lock] = field(default_factory=dict)

    def owner_lock(self, key: tuple[str, str]) -> threading.Lock:
        with self.lock:
            return self.owner_locks.setdefault(key, threading.Lock())

    def forget_owner(self, key: tuple[str, str]) -> None:
        with self.lock:
            self.owner_locks.pop(key, None)
        self.requeue.clear(key)


def build(settings: OperatorSettings, indexes: Mapping[str, Any]) -> Context:
    """The context of a running operator: one API client shared by every writer."""
    api = api_client()
    return Context(
        api=api,
        applier=Applier(api, settings.api_timeout_seconds),
        settings=settings,
        writer=StatusWriter(api, settings.api_timeout_seconds),
        hot=HotNodes(client.CoreV1Api(api)),
        steps=LadderSteps(client.CoreV1Api(api)),
        indexes=indexes,
    )


def close(ctx: Context) -> None:
    ctx.reconciles.shutdown(wait=False, cancel_futures=True)
    ctx.api.close()  # type: ignore[no-untyped-call]  # the client's close has no hints
