"""The governor inside the real runtime process (real engine, real model, the sensor on a fake
sysfs tree): sensor → batch limit within 1 s, the manual override and its expiry, and a policy
change picked up from the config file without a restart."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.support.waiting import wait_for
from tests.thermal.conftest import API_KEY, FakeThermalTree

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _state(proc: Any) -> dict[str, Any]:
    state: dict[str, Any] = httpx.get(f"{proc.url}/admin/state", headers=AUTH, timeout=5).json()
    return state


def _until_batch(proc: Any, batch: int, timeout: float, interval: float = 0.02) -> float:
    """Seconds until the runtime's batch limit is `batch`; fails after `timeout`."""
    start = time.monotonic()
    wait_for(
        f"batch limit {batch}",
        lambda: _state(proc)["maxBatchSize"],
        timeout,
        interval,
        until=lambda got: got == batch,
    )
    return time.monotonic() - start


def test_sensor_to_batch_limit_within_a_second(runtime: tuple[Any, FakeThermalTree]) -> None:
    proc, tree = runtime
    try:
        assert _until_batch(proc, 16, timeout=5) < 5
        tree.set(1, 84.0)  # the hottest zone: 84 °C → 13 (throttle 78, step 2)
        took = _until_batch(proc, 13, timeout=5)
        assert took <= 1.0, f"{took:.2f}s from the sensor to the limit"
        assert _state(proc)["thermalReason"] == "Throttled"
        tree.set(1, 92.0)  # past critical (90): the floor, and shedding to peers
        assert _until_batch(proc, 4, timeout=5) <= 1.0
        assert _state(proc)["thermalReason"] == "Critical"
    finally:
        tree.set(1, 70.0)
    # Falling readings are smoothed (and the policy's hysteresis holds): the full batch returns
    # only after a few samples below throttle − 3 °C.
    assert _until_batch(proc, 16, timeout=10) > 0.2


def test_manual_override_expires(runtime: tuple[Any, FakeThermalTree]) -> None:
    proc, _ = runtime
    url = f"{proc.url}/admin/batch"
    pinned = httpx.put(url, json={"maxBatchSize": 3, "expiresInSeconds": 1.0}, headers=AUTH)
    assert pinned.status_code == 200, pinned.text
    assert pinned.json()["maxBatchSize"] == 3
    assert 0 < pinned.json()["overrideExpiresInSeconds"] <= 1.0
    assert _until_batch(proc, 16, timeout=5) >= 0.5
    assert _state(proc)["overrideExpiresInSeconds"] is None
    httpx.put(url, json={"maxBatchSize": 2}, headers=AUTH)  # default expiry: 600 s
    assert _state(proc)["overrideExpiresInSeconds"] > 590
    ended = httpx.delete(url, headers=AUTH).json()
    assert ended["overrideExpiresInSeconds"] is None and ended["maxBatchSize"] == 16
    bad = httpx.put(url, json={"maxBatchSize": 2, "expiresInSeconds": 0}, headers=AUTH)
    assert bad.status_code == 400


def test_policy_change_is_reloaded_without_a_restart(
    runtime: tuple[Any, FakeThermalTree],
) -> None:
    proc, tree = runtime
    config = Path(proc.log).parent / "config.yaml"
    original = config.read_text()
    pid = proc.proc.pid
    try:
        tree.set(1, 74.0)
        assert _until_batch(proc, 16, timeout=10) < 10
        data = yaml.safe_load(original)
        data["thermal"]["throttleCelsius"] = 70.0  # 74 °C is now two steps above throttle
        tmp = config.with_suffix(".new")
        tmp.write_text(yaml.safe_dump(data))
        tmp.replace(config)  # atomic, like the kubelet's symlink swap
        assert _until_batch(proc, 14, timeout=10, interval=0.2) < 10
        assert proc.proc.pid == pid and proc.proc.poll() is None
    finally:
        config.write_text(original)
        tree.set(1, 70.0)
    assert _until_batch(proc, 16, timeout=15, interval=0.2) < 15
