"""Drill 1: the operator SIGKILLed and restarted while a seeded random driver creates, edits,
scales and deletes InferenceDeployments on the kwok fleet; afterwards every object must
converge with exactly its children and nothing orphaned."""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ember_operator import render, sizing
from ember_operator.api.models import parse_spec
from ember_operator.apply import digest_of, stamp
from ember_operator.settings import load_settings
from ember_runtime.contract.cache import INSTANCE_LABEL
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from tests.drills.common import Operator
from tests.operator import rest
from tests.operator.specs import fleet_manifest, rendered

CHILD_KINDS = {
    "Deployment": "deployments",
    "Service": "services",
    "ConfigMap": "configmaps",
    "PodDisruptionBudget": "pdbs",
}
SELECTOR = "app.kubernetes.io/managed-by=ember-operator"
CONTEXT_LENGTHS = (1024, 2048, 4096, 8192)


@dataclass(frozen=True)
class Size:
    objects: int
    kills: int
    operations: int
    churn_seconds: float  # the operations and kills are spread over this
    nodes: int
    converge_timeout: float


SIZES = {
    # The convergence bound covers Kubernetes' own controllers too: under load the ReplicaSet
    # controller's cache can lag its own writes ("read version … is not as new as written
    # version"), and each retry of that sync backs off exponentially — seen holding one
    # rollout's last replica for ~70 s on a busy 2-CPU machine.
    "short": Size(
        objects=20, kills=3, operations=60, churn_seconds=20, nodes=10, converge_timeout=360
    ),
    "medium": Size(
        objects=60, kills=8, operations=250, churn_seconds=60, nodes=20, converge_timeout=300
    ),
    "full": Size(
        objects=200, kills=20, operations=1000, churn_seconds=240, nodes=50, converge_timeout=900
    ),
}


@dataclass
class Driver:
    """The seeded random client: which objects exist and how many replicas each should have."""

    api: ApiClient
    ns: str
    sites: list[str]
    rng: random.Random
    names: list[str]
    replicas: dict[str, int] = field(default_factory=dict)
    done: Counter[str] = field(default_factory=Counter)

    def create(self, name: str) -> None:
        replicas = self.rng.choice((1, 3))
        rest.create(self.api, "infd", self.ns, fleet_manifest(name, self.sites, replicas))
        self.replicas[name] = replicas
        self.done["create"] += 1

    def step(self) -> None:
        name = self.rng.choice(self.names)
        if name not in self.replicas:
            return self.create(name)
        op = self.rng.choice(("edit", "edit", "scale", "scale", "delete"))
        if op == "delete":
            rest.delete(self.api, "infd", self.ns, name)
            del self.replicas[name]
        elif op == "scale":
            self.replicas[name] = 4 - self.replicas[name]  # 1 <-> 3: a PDB comes or goes
            patch: dict[str, Any] = {"spec": {"replicas": self.replicas[name]}}
            rest.merge_patch(self.api, "infd", self.ns, name, patch)
        else:
            length = self.rng.choice(CONTEXT_LENGTHS)
            patch = {"spec": {"engine": {"contextLength": length}}}
            rest.merge_patch(self.api, "infd", self.ns, name, patch)
        self.done[op] += 1
        return None


def churn(driver: Driver, operator: Operator, size: Size) -> float:
    """Run the operations with kills at random moments among them; returns when the operator
    was last (re)started."""
    rng = driver.rng
    kills = set(rng.sample(range(size.operations), size.kills))
    gap = size.churn_seconds / size.operations
    restart_at: float | None = None
    last_start = time.monotonic()
    for i in range(size.operations):
        if i in kills:
            if not operator.alive():  # still down from the last kill: this one hits start-up
                operator.start()
            operator.kill()
            restart_at = time.monotonic() + rng.uniform(0, 2)  # down for up to 2 s
        if restart_at is not None and time.monotonic() >= restart_at:
            operator.start()
            restart_at, last_start = None, time.monotonic()
        driver.step()
        time.sleep(rng.uniform(0, 2 * gap))
    if restart_at is not None:
        time.sleep(max(0.0, restart_at - time.monotonic()))
        operator.start()
        last_start = time.monotonic()
    return last_start


@dataclass
class Findings:
    unconverged: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    stuck: list[str] = field(default_factory=list)

    def clean(self) -> bool:
        return not (
            self.unconverged or self.orphans or self.duplicates or self.missing or self.stuck
        )

    def counts(self) -> dict[str, int]:
        return {k: len(v) for k, v in vars(self).items()}


def _listing(api: ApiClient, ns: str) -> dict[str, list[dict[str, Any]]]:
    kinds = [*CHILD_KINDS.values(), "replicasets", "pods"]
    # The runtime's ServiceAccount and RoleBinding are the namespace's, not one object's.
    out = {
        kind: [
            o
            for o in rest.items(api, kind, ns, label_selector=SELECTOR)
            if INSTANCE_LABEL in (o["metadata"].get("labels") or {})
        ]
        for kind in kinds
    }
    out["infd"] = rest.items(api, "infd", ns)
    return out


def _owner_uid(obj: dict[str, Any]) -> str | None:
    refs = obj["metadata"].get("ownerReferences") or []
    return next((r["uid"] for r in refs if r.get("controller")), None)


def inspect(api: ApiClient, ns: str, expected: dict[str, int]) -> Findings:
    """One look at everything in `ns`, against what the driver left (`expected` replicas)."""
    found = Findings()
    listed = _listing(api, ns)
    live = {o["metadata"]["name"]: o for o in listed["infd"]}
    if set(live) != set(expected):
        found.unconverged.append(f"objects {sorted(set(live) ^ set(expected))} differ")
    uids = {
        o["metadata"]["uid"]
        for kind in ("infd", "deployments", "replicasets")
        for o in listed[kind]
    }
    for kind in (*CHILD_KINDS.values(), "replicasets", "pods"):
        for obj in listed[kind]:
            if _owner_uid(obj) not in uids:
                found.orphans.append(f"{kind}/{obj['metadata']['name']}")
    for obj in live.values():
        _check_object(obj, listed, found)
    return found


def _owned(listed: dict[str, list[dict[str, Any]]], kind: str, uid: str) -> list[dict[str, Any]]:
    return [o for o in listed[kind] if _owner_uid(o) == uid]


def _check_object(
    obj: dict[str, Any], listed: dict[str, list[dict[str, Any]]], found: Findings
) -> None:
    name, uid = obj["metadata"]["name"], obj["metadata"]["uid"]
    replicas = obj["spec"]["replicas"]
    st = obj.get("status") or {}
    ready = {c["type"]: c["status"] for c in st.get("conditions") or []}.get("Ready")
    if (
        st.get("observedGeneration") != obj["metadata"]["generation"]
        or st.get("readyReplicas") != replicas
        or ready != "True"
    ):
        found.unconverged.append(
            f"{name}: gen {obj['metadata']['generation']} observed {st.get('observedGeneration')}"
            f" ready {st.get('readyReplicas')}/{replicas} Ready={ready}"
        )
    for kind, plural in CHILD_KINDS.items():
        want = int(replicas > 1) if kind == "PodDisruptionBudget" else 1
        have = len(_owned(listed, plural, uid))
        if have > want:
            found.duplicates.append(f"{name}: {have} {kind}")
        elif have < want:
            found.missing.append(f"{name}: {have} {kind}")
    _check_digests(obj, listed, found)
    deployments = _owned(listed, "deployments", uid)
    if len(deployments) == 1:
        _check_rollout(name, st, deployments[0], listed, found)


def wanted_digests(obj: dict[str, Any]) -> dict[str, str]:
    """kind -> digest of the child the operator must have written for the object's current
    spec, computed as the operator does (`reconcile.planned`): a child with another digest is
    stale (say, an edit made while the operator was down that it never applied)."""
    meta, settings = obj["metadata"], load_settings()
    spec = parse_spec(obj["spec"])
    owner = render.Owner(meta["name"], meta["namespace"], meta["uid"])
    shape = sizing.find_gguf_shape(spec, settings)
    return {m["kind"]: stamp(m) for m in rendered(owner, spec, settings, shape)}


def _check_digests(
    obj: dict[str, Any], listed: dict[str, list[dict[str, Any]]], found: Findings
) -> None:
    name, uid = obj["metadata"]["name"], obj["metadata"]["uid"]
    for kind, digest in wanted_digests(obj).items():
        for child in _owned(listed, CHILD_KINDS[kind], uid):
            if digest_of(child) != digest:
                found.stuck.append(f"{name}: {kind} not at the current spec's digest")


def _check_rollout(
    name: str,
    st: dict[str, Any],
    deployment: dict[str, Any],
    listed: dict[str, list[dict[str, Any]]],
    found: Findings,
) -> None:
    # Only the current ReplicaSet is live: old ones stay (revision history) scaled to 0.
    current = [
        r
        for r in _owned(listed, "replicasets", deployment["metadata"]["uid"])
        if (r["spec"].get("replicas") or 0) > 0
    ]
    if len(current) > 1:
        found.duplicates.append(f"{name}: {len(current)} ReplicaSets with replicas")
    dst = deployment.get("status") or {}
    for ours, theirs in (("replicas", "replicas"), ("readyReplicas", "readyReplicas")):
        if (st.get(ours) or 0) != (dst.get(theirs) or 0):
            found.stuck.append(
                f"{name}: status.{ours} {st.get(ours)} != Deployment's {dst.get(theirs)}"
            )


def converge(
    api: ApiClient,
    ns: str,
    expected: dict[str, int],
    timeout: float,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[float | None, Findings]:
    """Poll until a look finds nothing wrong; (seconds taken or None, the last findings)."""
    start = time.monotonic()
    while True:
        try:
            found = inspect(api, ns, expected)
        except ApiException as exc:  # a listing raced a deletion; look again
            found = Findings(unconverged=[f"listing failed: {exc.reason}"])
        if found.clean():
            return time.monotonic() - start, found
        if int(time.monotonic() - start) % 15 < 2:  # what it is waiting for, now and then
            print(f"  {time.monotonic() - start:5.0f}s {found.counts()} {_sample(found)}")
        if time.monotonic() - start > timeout:
            return None, found
        sleep(2)


def _sample(found: Findings) -> list[str]:
    return [entry for entries in vars(found).values() for entry in entries[:2]][:6]
