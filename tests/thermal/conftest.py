"""Fixtures for the thermal tests: a fake sysfs thermal tree in a temp dir."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


@dataclass
class FakeThermalTree:
    """`<root>/class/thermal/thermal_zone<i>/{type,temp}` like the kernel's, in millidegrees."""

    root: Path

    def zone(self, index: int, kind: str, celsius: float) -> None:
        path = self.root / "class" / "thermal" / f"thermal_zone{index}"
        path.mkdir(parents=True, exist_ok=True)
        (path / "type").write_text(kind + "\n")
        self.set(index, celsius)

    def set(self, index: int, celsius: float) -> None:
        path = self.root / "class" / "thermal" / f"thermal_zone{index}" / "temp"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(f"{round(celsius * 1000)}\n")
        tmp.replace(path)  # atomic, like a sysfs read never sees half a number


@pytest.fixture
def thermal_tree(tmp_path: Path) -> FakeThermalTree:
    return FakeThermalTree(tmp_path / "sys")


API_KEY = "thermal-test-key"


@pytest.fixture(scope="session")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, FakeThermalTree]]:
    """One real runtime process for the session (the model loads once), sensor on a fake tree."""
    from tests.thermal.runtime_proc import start_runtime

    work = tmp_path_factory.mktemp("runtime")
    tree = FakeThermalTree(work / "sys")
    tree.zone(0, "soc-thermal", 60.0)
    tree.zone(1, "npu-thermal", 70.0)
    proc = start_runtime(work, tree.root, api_key=API_KEY)
    yield proc, tree
    # Graceful: uvicorn drains, then re-raises the SIGTERM it caught (exit 143), never a SIGKILL.
    assert proc.stop() in (0, -signal.SIGTERM), proc.log.read_text()[-2000:]
