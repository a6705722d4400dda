"""The thermal ladder on a device that heats with its own work, seen through the real control
plane: a replica's batch steps down as its plant heats, then it sheds (Critical), then it steps
back up as its enclosure cools, and every step reaches the pod's condition and the
InferenceDeployment's status.

As in test_thermal_offline_cluster: a kwok node runs the pod, and a real runtime process (real
engine, real model) stands in for its runtime container, with a token bound to that pod. The
sensor tree it reads is written by a thermal plant (tests/thermal/plant.py) driven by the CPU
time that process consumes under a closed loop of clients.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from ember_runtime.contract.config import RuntimeConfig
from ember_runtime.contract.thermal import THERMAL_CONDITION, decode_report

from tests.operator import rest
from tests.operator.specs import fleet_manifest
from tests.support.waiting import wait_for
from tests.thermal.conftest import FakeThermalTree
from tests.thermal.kube_support import api_server, pod_token, runtime_policy, token_dir
from tests.thermal.plant import CpuQuota, Plant, Profile, process_device
from tests.thermal.runtime_proc import RuntimeProcess, start_runtime

pytestmark = pytest.mark.cluster

SITES = ["site-0"]
# A small box whose busy steady state (25 + 4 × 22 = 113 °C in a 25 °C room, +20 in the
# enclosure) is far past the policy's critical 84 °C; idle it settles at 25 + 4 × 2 = 33 °C.
BOX = Profile("test-box", 2.0, 22.0, 4.0, 40.0, 120.0, 130.0)
SPEED = 20.0  # τ = 160 s emulated, 8 s real
THERMAL = {"throttleCelsius": 70, "criticalCelsius": 84, "minBatchSize": 2}


@pytest.fixture(scope="module")
def nodes(fleet: Callable[..., list[str]]) -> list[str]:
    return fleet(1, sites=1)


@pytest.fixture
def policy(kube: Any, tmp_path: Path) -> Iterator[None]:
    with runtime_policy(kube, tmp_path):
        yield


def _load(url: str, stop: threading.Event) -> None:
    """Four back-to-back streaming clients: the work that heats the plant."""

    async def client() -> None:
        body = {"prompt": "Tell me about heat sinks.", "max_tokens": 24, "stream": True}
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            while not stop.is_set():
                try:
                    async with http.stream("POST", "/v1/completions", json=body) as resp:
                        async for _ in resp.aiter_lines():
                            pass
                except httpx.HTTPError:
                    await asyncio.sleep(0.2)

    async def main() -> None:
        await asyncio.gather(*(client() for _ in range(4)))

    asyncio.run(main())


def _steps(kube: Any, namespace: str, pod: str) -> tuple[str, int] | None:
    body = rest.get(kube.api, "pods", namespace, pod) or {}
    conds = (body.get("status") or {}).get("conditions") or []
    cond = next((c for c in conds if c["type"] == THERMAL_CONDITION), None)
    if cond is None:
        return None
    report = decode_report(str(cond["message"]))
    return report.reason, report.max_batch_size or 0


def _stand_in(
    kube: Any, namespace: str, tmp_path: Path
) -> tuple[str, RuntimeConfig, dict[str, str]]:
    infd = fleet_manifest("ladder", SITES)
    infd["spec"]["engine"] = {"maxBatchSize": 8, "minBatchSize": 2}
    infd["spec"]["thermal"] = THERMAL
    rest.create(kube.api, "infd", namespace, infd)
    pods = wait_for(
        "a running pod",
        lambda: [
            p
            for p in rest.items(
                kube.api, "pods", namespace, label_selector="ember.dev/instance=ladder"
            )
            if (p.get("status") or {}).get("phase") == "Running"
        ],
        timeout=180,
    )
    name = pods[0]["metadata"]["name"]
    config = rest.get(kube.api, "configmaps", namespace, "ladder-config") or {}
    rendered = RuntimeConfig.model_validate(yaml.safe_load(config["data"]["config.yaml"]))
    pod: Any = kube.core.read_namespaced_pod(name, namespace)
    sa = token_dir(kube, pod_token(kube.core, namespace, pod), tmp_path / "sa")
    host, port = api_server(kube)
    env = {
        "POD_NAME": name,
        "POD_NAMESPACE": namespace,
        "KUBERNETES_SERVICE_HOST": host,
        "KUBERNETES_SERVICE_PORT": str(port),
        "EMBER_SERVICEACCOUNT_DIR": str(sa),
    }
    return name, rendered, env


def throttled(obj: dict[str, Any] | None) -> str | None:
    """The object's Throttled condition's status (None before it has one)."""
    return rest.condition(obj, "Throttled").get("status")


@pytest.mark.usefixtures("operator", "nodes", "policy")
def test_the_ladder_steps_down_and_back_up_in_status(
    kube: Any, namespace: str, tmp_path: Path
) -> None:
    pod, rendered, env = _stand_in(kube, namespace, tmp_path)
    tree = FakeThermalTree(tmp_path / "sys")
    tree.zone(0, "cpu-thermal", 25.0)
    enclosure = {"hot": True}
    proc: RuntimeProcess = start_runtime(
        tmp_path,
        tree.root,
        max_batch=8,
        min_batch=2,
        interval=0.25,
        thermal=rendered.thermal,
        env=env,
    )
    quota = CpuQuota("ladder-test", 1.0)
    quota.add(proc.proc.pid)
    plant = Plant(
        BOX,
        process_device(lambda: proc.proc.pid if proc.proc.poll() is None else None, quota),
        tree,
        speed=SPEED,
        ambient=lambda _t: 45.0 if enclosure["hot"] else 25.0,
    ).start()
    stop = threading.Event()
    load = threading.Thread(target=_load, args=(proc.url, stop), daemon=True)
    load.start()
    seen: list[tuple[str, int]] = []

    def record() -> tuple[str, int] | None:
        step = _steps(kube, namespace, pod)
        if step is not None and (not seen or seen[-1] != step):
            seen.append(step)
        return step

    try:
        wait_for(
            "Critical in the pod's condition",
            lambda: (s := record()) and s[0] == "Critical",
            timeout=120,
            interval=0.2,
        )
        # The operator folds the pod's condition into the object's on its own event: a moment
        # after the pod's (the suite once read the object in between and saw FullBatch).
        wait_for(
            "Throttled on the object",
            lambda: throttled(rest.get(kube.api, "infd", namespace, "ladder")) == "True",
            timeout=30,
            interval=0.2,
        )
        enclosure["hot"] = False  # the cabinet's door opens; the load goes on
        stop.set()  # and, as a gateway would, the work moves to peers
        wait_for(
            "Normal at the full batch again",
            lambda: record() == ("Normal", 8),
            timeout=120,
            interval=0.2,
        )
    finally:
        stop.set()
        plant.stop()
        proc.stop()
        quota.close()
    reasons = [reason for reason, _ in seen]
    assert reasons[0] == "Normal" and reasons[-1] == "Normal", seen
    down = [batch for reason, batch in seen[: reasons.index("Critical") + 1]]
    assert down == sorted(down, reverse=True), f"the batch only steps down while heating: {seen}"
    assert len(set(down)) >= 3, f"several steps, not one jump: {seen}"
    assert ("Critical", 2) in seen, f"at critical the batch is at its floor: {seen}"
    assert plant.state.trips == 0
    events = wait_for(
        "an Event per step",
        lambda: (
            {"ReplicaThrottled", "ReplicaShedding", "ReplicaCooled"}
            <= (
                got := {
                    e.reason
                    for e in kube.core.list_namespaced_event(namespace).items
                    if e.involved_object.name == "ladder"
                }
            )
            and got
        ),
        timeout=20,
    )
    assert "ReplicaShedding" in events
    final = (rest.get(kube.api, "infd", namespace, "ladder") or {})["status"]
    assert wait_for(
        "status back to the full batch",
        lambda: (
            (rest.get(kube.api, "infd", namespace, "ladder") or {})["status"].get("maxBatchSize")
            == 8
        ),
        timeout=20,
    ), final
