"""Drill 2: the REAL kubelet restarted while pods hold NPU contexts of the real device plugin
(tests/deviceplugin/realnode.py: the plugin as a host process, fake /dev nodes).

After each restart: the plugin re-registers within 2 s of the new kubelet.sock appearing, the
node's allocatable comes back, every pod that held a context still runs, and a pod created
afterwards gets a context ID that no live pod holds. The short version (2 restarts) runs in the
suite; `make drills` runs 10 and writes bench/results/drills.*.
"""

from __future__ import annotations

import os
import re
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from ember_runtime.deviceplugin.allocator import Checkpoint
from kubernetes import client

from tests.deviceplugin.realnode import (
    CONTEXTS,
    DEVICES,
    REGISTERED,
    RESOURCE,
    kubelet_npu_units,
    kubelet_pods,
    live_contexts,
    npu_capacity,
)
from tests.drills.common import record, scale, table
from tests.support.waiting import poll, wait_for

pytestmark = pytest.mark.node

RESTARTS = {"short": 2, "medium": 5, "full": 10}
PODS = 3  # held across every restart; one is replaced by a new allocation after each
# The goal, at the drill's full scale on a quiet machine; in the suite (other tests and builds
# sharing 2 cores) re-registration took 2.01 s once, so there the bound only catches a plugin
# that waits for its fallback rescan cycles instead of reacting to the new socket.
REGISTER_GOAL_S = 2.0
REGISTER_BOUND_IN_SUITE_S = 5.0
CAPACITY_TIMEOUT_S = 60.0
CONTEXT_RE = re.compile(r"^ACL_CONTEXT_ID=(\d+)$", re.M)


def _identity(path: Path) -> tuple[int, int] | None:
    """A socket file's identity: a recreated one can get the same inode number back (ext4 hands
    a freed inode out again at once), never the same ctime as well."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_ctime_ns


@dataclass
class RestartWatch:
    """Polls every 10 ms, from before the restart, for its two moments: the new kubelet's
    kubelet.sock (recreated) and the plugin's next "registered" log line."""

    kubelet_sock: Path
    plugin_log: Path
    sock_at: float | None = None
    registered_at: float | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> RestartWatch:
        old_sock, old_count = _identity(self.kubelet_sock), self._registrations()

        def poll() -> None:
            while not self._stop.is_set() and (self.sock_at is None or self.registered_at is None):
                now = time.monotonic()
                sock = _identity(self.kubelet_sock)
                if self.sock_at is None and sock is not None and sock != old_sock:
                    self.sock_at = now
                if self.registered_at is None and self._registrations() > old_count:
                    self.registered_at = now
                time.sleep(0.01)

        self._thread = threading.Thread(target=poll, name="restart-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(5)

    def _registrations(self) -> int:
        return self.plugin_log.read_text(errors="replace").count(REGISTERED)

    def wait(self, timeout: float) -> None:
        wait_for("a new kubelet.sock and the plugin's registration", self.done, timeout, 0.05)

    def done(self) -> bool:
        return self.sock_at is not None and self.registered_at is not None

    def register_latency(self) -> float:
        assert self.sock_at is not None and self.registered_at is not None
        return self.registered_at - self.sock_at


def npu_pod(name: str, node: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": {"kubernetes.io/hostname": node.name},
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {
                    "name": "main",
                    "image": node.base_image,
                    "imagePullPolicy": "Never",
                    "command": ["/bin/sh", "-c", "env; exec sleep 3600"],
                    "resources": {"limits": {RESOURCE: "1"}},
                }
            ],
        },
    }


def context_of(core: client.CoreV1Api, namespace: str, name: str) -> int | None:
    """The ACL_CONTEXT_ID the pod's container got (from its env dump), once it runs."""
    status = core.read_namespaced_pod(name, namespace).status
    phase = status.phase if status else None
    assert phase in {"Pending", "Running"}, f"{name}: {phase} ({status})"
    if phase != "Running":
        return None
    found = CONTEXT_RE.search(core.read_namespaced_pod_log(name, namespace))
    return int(found.group(1)) if found else None


def handed_twice(checkpoint: Path) -> list[int]:
    """Context IDs that more than one live allocation of the plugin's checkpoint holds."""
    counts = Counter(
        cid
        for alloc in Checkpoint(checkpoint).load().allocations
        for cid in alloc.contexts.values()
    )
    return sorted(cid for cid, n in counts.items() if n > 1)


@dataclass
class Pods:
    """The drill's pods: name -> the context ID its container was given."""

    core: client.CoreV1Api
    node: Any
    namespace: str
    held: dict[str, int] = field(default_factory=dict)
    made: int = 0

    def add(self) -> None:
        name = f"npu-{self.made}"
        self.made += 1
        self.core.create_namespaced_pod(self.namespace, npu_pod(name, self.node))  # type: ignore[arg-type]
        found: list[int] = []  # context ID 0 is valid, so not wait_for's truthy result

        def started() -> bool:
            cid = context_of(self.core, self.namespace, name)
            found.extend(() if cid is None else (cid,))
            return cid is not None

        try:
            wait_for(f"{name} running with its ACL_CONTEXT_ID", started, 120)
        except AssertionError as err:
            status = self.core.read_namespaced_pod(name, self.namespace).status
            raise AssertionError(f"{err}; its status: {status}") from None
        self.held[name] = found[-1]

    def replace_oldest(self) -> None:
        oldest = next(iter(self.held))
        self.core.delete_namespaced_pod(oldest, self.namespace, grace_period_seconds=0)
        del self.held[oldest]
        self.add()

    def still_running(self) -> list[str]:
        """Names of held pods that are no longer Running with their first container."""
        lost = []
        for name in self.held:
            pod = self.core.read_namespaced_pod(name, self.namespace)
            statuses = (pod.status.container_statuses if pod.status else None) or []
            restarted = any(s.restart_count for s in statuses)
            if not pod.status or pod.status.phase != "Running" or restarted:
                lost.append(name)
        return lost

    def duplicates(self) -> list[int]:
        counts = Counter(self.held.values())
        return sorted(cid for cid, n in counts.items() if n > 1)


def unbound(pods: Pods, checkpoint: Path, timeout: float = 30.0) -> list[str]:
    """Held pods whose context the plugin's checkpoint does not (yet, after `timeout`) bind to
    that pod; the plugin binds an ID once the kubelet's PodResources API reports its container."""

    def missing() -> list[str]:
        owners = live_contexts(checkpoint)
        return [
            name
            for name, cid in pods.held.items()
            if owners.get(cid) != f"{pods.namespace}/{name}/main"
        ]

    left: list[str] = poll(missing, timeout, 0.5, until=lambda names: not names)
    return left


def test_kubelet_restarts_with_npu_pods(
    node: Any, kube: Any, namespace: str, plugin: dict[str, Path]
) -> None:
    restarts = RESTARTS[scale()]
    core = client.CoreV1Api(kube.api)
    full = DEVICES * CONTEXTS
    wait_for(f"{RESOURCE} allocatable", lambda: npu_capacity(core, node.name) == full, 90)
    pods = Pods(core, node, namespace)
    for _ in range(PODS):
        pods.add()
    duplicates = pods.duplicates() + handed_twice(plugin["checkpoint"])
    not_bound = unbound(pods, plugin["checkpoint"])
    latencies, capacity_back, dips = [], [], 0

    def kubelet_units() -> int:
        return kubelet_npu_units(node.pod_resources_socket)

    def kubelet_listed() -> set[str]:
        return kubelet_pods(node.pod_resources_socket)

    lost: list[str] = []
    for _ in range(restarts):
        with RestartWatch(node.device_plugin_dir / "kubelet.sock", plugin["log"]) as watch:
            node.restart_kubelet()
            watch.wait(60)
        latencies.append(watch.register_latency())
        dips += npu_capacity(core, node.name) < full
        wait_for("allocatable back", lambda: npu_capacity(core, node.name) == full, 60, 0.1)
        # ...and in the kubelet itself: the node object can still show the allocatable of
        # before the restart, and a pod created before the kubelet has the units again is
        # refused at admission (UnexpectedAdmissionError), whatever the plugin does.
        wait_for("kubelet's units back", lambda: kubelet_units() == full, 60, 0.05)
        wait_for("kubelet lists its pods", lambda: set(pods.held) <= kubelet_listed(), 60, 0.05)
        assert watch.sock_at is not None
        capacity_back.append(time.monotonic() - watch.sock_at)
        lost += pods.still_running()
        pods.replace_oldest()  # a new allocation after the restart
        duplicates += pods.duplicates() + handed_twice(plugin["checkpoint"])
        not_bound += unbound(pods, plugin["checkpoint"])
    rows: list[tuple[str, Any]] = [
        ("kubelet restarts", restarts),
        ("pods holding a context throughout", PODS),
        ("allocations (pods created)", pods.made),
        ("re-registration after the new kubelet.sock, max (ms)", round(max(latencies) * 1e3)),
        ("… median (ms)", round(statistics.median(latencies) * 1e3)),
        ("kubelet's units back after the new kubelet.sock, max (s)", round(max(capacity_back), 2)),
        ("restarts with allocatable short at re-registration", dips),
        ("pods lost or restarted", len(lost)),
        ("live context IDs handed out twice", len(duplicates)),
        ("held contexts the plugin did not bind to their pod", len(not_bound)),
    ]
    print(f"\nkubelet restart with NPU pods ({scale()})\n{table(rows)}")
    if scale() == "full":
        result = {"register_max_s": max(latencies), "lost": lost, "duplicates": duplicates}
        result["unbound"] = not_bound
        record("kubelet restart with NPU pods", result, rows)
    bound = REGISTER_GOAL_S if scale() == "full" else REGISTER_BOUND_IN_SUITE_S
    assert max(latencies) <= bound, latencies
    assert not lost, lost
    assert not duplicates, duplicates
    assert not not_bound, not_bound
