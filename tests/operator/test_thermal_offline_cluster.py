"""Thermal control with the API server away, then back: the whole report path on the real
control plane.

A kwok fleet node runs the InferenceDeployment's pod (kwok pods have no processes), and a real
runtime process — real engine, real model, the sensor on a fake sysfs tree — stands in for that
pod's runtime container: the pod's name from the downward API, a token bound to that pod, the
runtime ServiceAccount's RBAC and the chart's admission policy. It reaches the API server through
a TCP proxy we can cut, so the API server goes away for it alone (the cluster is shared).

Heat while cut: the batch limit drops within 1 s all the same (nothing between the sensor and
the engine needs the network). Restore: the pod's condition, and `kubectl get infd`'s TEMP and
BATCH through the operator's pod watch, catch up within 10 s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from ember_runtime.contract.config import RuntimeConfig
from ember_runtime.contract.thermal import THERMAL_CONDITION, decode_report

from tests.e2e.flow import table_columns
from tests.operator import rest
from tests.operator.specs import fleet_manifest
from tests.support.waiting import wait_for
from tests.thermal.conftest import FakeThermalTree
from tests.thermal.kube_support import (
    TcpProxy,
    api_server,
    pod_token,
    runtime_policy,
    token_dir,
)
from tests.thermal.runtime_proc import RuntimeProcess, start_runtime

pytestmark = pytest.mark.cluster

SITES = ["site-0"]
HOT = 86.0  # 4 steps of 2 °C above 78: batch 8 → 4


@pytest.fixture(scope="module")
def nodes(fleet: Callable[..., list[str]]) -> list[str]:
    return fleet(2, sites=1)


@pytest.fixture
def policy(kube: Any, tmp_path: Path) -> Iterator[None]:
    with runtime_policy(kube, tmp_path):
        yield


def _columns(kube: Any, namespace: str, name: str) -> dict[str, str]:
    return table_columns(kube.kubectl("-n", namespace, "get", "infd", name))


def _said(condition: dict[str, Any]) -> str:
    """The human line of a runtime's report (its data line decoded: it must be one)."""
    return decode_report(str(condition["message"])).message()


def _pod_condition(kube: Any, namespace: str, pod: str) -> dict[str, Any] | None:
    body = rest.get(kube.api, "pods", namespace, pod) or {}
    conds = (body.get("status") or {}).get("conditions") or []
    return next((c for c in conds if c["type"] == THERMAL_CONDITION), None)


def _batch(proc: RuntimeProcess) -> int:
    return int(httpx.get(f"{proc.url}/admin/state", timeout=2).json()["maxBatchSize"])


@pytest.mark.usefixtures("operator", "nodes", "policy")
def test_offline_heat_then_catch_up(kube: Any, namespace: str, tmp_path: Path) -> None:
    infd = fleet_manifest("hot", SITES)
    infd["spec"]["engine"] = {"maxBatchSize": 8, "minBatchSize": 2}
    rest.create(kube.api, "infd", namespace, infd)
    pods = wait_for(
        "a running pod",
        lambda: [
            p
            for p in rest.items(
                kube.api, "pods", namespace, label_selector="ember.dev/instance=hot"
            )
            if (p.get("status") or {}).get("phase") == "Running"
        ],
        timeout=180,
    )
    pod_name = pods[0]["metadata"]["name"]
    # The stand-in runs the policy the operator rendered for this replica.
    config = rest.get(kube.api, "configmaps", namespace, "hot-config") or {}
    rendered = RuntimeConfig.model_validate(yaml.safe_load(config["data"]["config.yaml"]))
    policy, limits = rendered.thermal, rendered.limits()
    assert (limits.max_batch_size, limits.min_batch_size, policy.throttle_celsius) == (8, 2, 78)
    pod: Any = kube.core.read_namespaced_pod(pod_name, namespace)
    assert pod.spec.service_account_name == "ember-runtime"  # the operator's identity for it
    sa = token_dir(kube, pod_token(kube.core, namespace, pod), tmp_path / "sa")
    proxy = TcpProxy(api_server(kube))
    proxy.restore()
    tree = FakeThermalTree(tmp_path / "sys")
    tree.zone(0, "npu-thermal", 60.0)
    env = {
        "POD_NAME": pod_name,
        "POD_NAMESPACE": namespace,
        "KUBERNETES_SERVICE_HOST": "127.0.0.1",
        "KUBERNETES_SERVICE_PORT": str(proxy.port),
        "EMBER_SERVICEACCOUNT_DIR": str(sa),
    }
    proc = start_runtime(
        tmp_path, tree.root, max_batch=8, min_batch=2, interval=0.25, thermal=policy, env=env
    )
    try:
        # Written once at start, then the operator folds it into status.
        first = wait_for("the first condition", lambda: _pod_condition(kube, namespace, pod_name))
        assert first["reason"] == "Normal" and _said(first) == "60 °C, batch 8/8"
        wait_for("TEMP 60", lambda: _columns(kube, namespace, "hot").get("TEMP") == "60")
        resource_version = kube.core.read_namespaced_pod(pod_name, namespace).metadata
        steady = resource_version.resource_version
        time.sleep(3)  # nothing changes: nothing is written
        now: Any = kube.core.read_namespaced_pod(pod_name, namespace)
        assert now.metadata.resource_version == steady

        proxy.cut()
        heated = time.monotonic()
        tree.set(0, HOT)
        wait_for("batch 4 while cut", lambda: _batch(proc) == 4, timeout=5, interval=0.02)
        reaction = time.monotonic() - heated
        assert reaction <= 1.0, f"batch limit took {reaction:.2f}s"
        time.sleep(2)  # the runtime retries meanwhile; the API still has the old state
        stale = _pod_condition(kube, namespace, pod_name)
        assert stale is not None and _said(stale) == "60 °C, batch 8/8"

        proxy.restore()
        back = time.monotonic()
        cond = wait_for(
            "the pod condition to catch up",
            lambda: (
                (c := _pod_condition(kube, namespace, pod_name))
                and _said(c) == "86 °C, batch 4/8"
                and c
            ),
            timeout=10,
            interval=0.1,
        )
        assert cond["reason"] == "Throttled" and cond["status"] == "True"
        cols = wait_for(
            "TEMP/BATCH to catch up",
            lambda: (
                (c := _columns(kube, namespace, "hot"))
                and (c.get("TEMP"), c.get("BATCH")) == ("86", "4")
                and c
            ),
            timeout=max(0.5, 10 - (time.monotonic() - back)),
            interval=0.2,
        )
        assert cols["BATCH"] == "4"
        status = (rest.get(kube.api, "infd", namespace, "hot") or {})["status"]
        throttled = next(c for c in status["conditions"] if c["type"] == "Throttled")
        assert throttled["status"] == "True"
        assert f"{pod_name} at 86 °C: batch 4/8" in throttled["message"]
    finally:
        proxy.cut()
        proc.stop()
