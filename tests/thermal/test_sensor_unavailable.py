"""A GPU replica on a node where NVML cannot start (this machine: no NVIDIA driver, so
nvidia-ml-py's `nvmlInit` raises): the real runtime process, configured as the operator renders
`accelerator: nvidia-gpu`, must come up, serve, and say why it has no temperature.

It used to raise `SensorUnavailableError` while building the app: the container exited and the
pod crash-looped on every GPU node whose image lacked nvidia-ml-py or the driver's library.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from tests.support.waiting import wait_for
from tests.thermal.conftest import API_KEY, FakeThermalTree
from tests.thermal.runtime_proc import start_runtime

AUTH = {"Authorization": f"Bearer {API_KEY}"}
# nvidia-ml-py installed: nvmlInit's "NVML Shared Library Not Found"; absent: the pip hint.
NVML_CAUSE = re.compile(r"^nvml: .*(NVIDIA driver|nvidia-ml-py)")


def test_gpu_replica_without_nvml_serves_and_reports_why(tmp_path: Path) -> None:
    tree = FakeThermalTree(tmp_path / "sys")  # the node's sysfs: no zones (a GPU box's own
    (tree.root / "class" / "thermal").mkdir(parents=True)  # sensors are NVML's)
    proc = start_runtime(tmp_path, tree.root, max_batch=4, api_key=API_KEY, nvml=True)
    try:
        with httpx.Client(base_url=proc.url, headers=AUTH, timeout=120) as client:
            assert client.get("/readyz").status_code == 200
            answer = client.post("/v1/completions", json={"prompt": "The sky is", "max_tokens": 4})
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["text"]
            state = wait_for(
                "thermalReason SensorUnavailable",
                lambda: client.get("/admin/state").json(),
                10,
                0.1,
                until=lambda s: s["thermalReason"] == "SensorUnavailable",
            )
        assert state["thermalReason"] == "SensorUnavailable"
        assert NVML_CAUSE.search(state["sensorProblem"] or ""), state
        assert state["maxBatchSize"] == 4  # no reading: serve at full batch
        assert state["temperatures"] == {}
        assert proc.proc.poll() is None
    finally:
        proc.stop()
    # Logged once when it starts failing, not at every sample (4 a second).
    log = proc.log.read_text()
    assert log.count("nvml sensor gives no reading") == 1, log[-3000:]
