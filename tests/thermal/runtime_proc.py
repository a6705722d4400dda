"""Start the real runtime (`python -m ember_runtime.server`) as a process with a fake thermal tree.

Used by the thermal tests and by bench/thermal_bench.py. The process is the one a pod runs: real
engine, real model, real HTTP; only the sysfs root points at a temp dir.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from ember_runtime.contract.config import (
    EngineConfig,
    RuntimeConfig,
    SensorConfig,
    ServerConfig,
)
from ember_runtime.contract.thermal import ThermalPolicy

from tests.support.model import default_model_path
from tests.support.net import free_port
from tests.support.waiting import WaitTimeout, wait_for


@dataclass
class RuntimeProcess:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def stop(self) -> int:
        """SIGTERM (what the kubelet sends), then wait; SIGKILL only after 60 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_runtime(
    workdir: Path,
    sysfs_root: Path,
    *,
    max_batch: int = 16,
    min_batch: int = 4,
    context: int = 256,
    interval: float = 0.2,
    api_key: str | None = None,
    threads: int = 1,
    argv_prefix: Sequence[str] = (),
    thermal: ThermalPolicy | None = None,
    env: dict[str, str] | None = None,
    nvml: bool = False,
    model: Path | None = None,
    preexec: Callable[[], None] | None = None,
    ready_timeout: float = 180.0,
    poll: float = 0.2,
    max_queue: int | None = None,
    model_name: str = "gemma3-270m",
    host: str = "127.0.0.1",
    port: int | None = None,
) -> RuntimeProcess:
    """`env` extra variables, e.g. POD_NAME/POD_NAMESPACE/KUBERNETES_SERVICE_HOST and
    EMBER_SERVICEACCOUNT_DIR to have it report its condition to a real API server. `nvml`: the
    NVML sensor on, as the operator renders it for `accelerator: nvidia-gpu`. `model`: another
    GGUF than the packaged one; `preexec` runs in the child before exec (bench/prewarm_bench.py
    moves it into a throttled cgroup); `max_queue`: requests waiting beyond the batch before 429
    (the server's default where None); `model_name`: the served name; `host`/`port`: where it
    listens (another loopback address stands in for a pod IP; a free port where None); returns
    once /readyz answers 200, polled every `poll` s."""
    model = model or default_model_path()
    key_file = None
    if api_key is not None:
        key_file = workdir / "api-key"
        key_file.write_text(api_key)
    port = port or free_port()
    config = RuntimeConfig(
        model_name=model_name,
        model_dir=str(model.parent),
        engine=EngineConfig(
            max_batch_size=max_batch,
            context_length=context,
            threads=threads,
        ),
        server=ServerConfig(
            host=host,
            port=port,
            api_key_file=str(key_file) if key_file else None,
            request_timeout_seconds=120,
            **({"max_queue": max_queue} if max_queue is not None else {}),
        ),
        sensors=SensorConfig(
            sysfs_root=str(sysfs_root),
            interval_seconds=interval,
            nvml=nvml,
            report_condition=env is not None and "POD_NAME" in env,
        ),
        thermal=thermal or ThermalPolicy(min_batch_size=min_batch),
        termination_log=str(workdir / "termination-log"),
    )
    cfg = workdir / "config.yaml"
    cfg.write_text(config.to_yaml())
    log = workdir / "runtime.log"
    argv = [
        *argv_prefix,
        sys.executable,
        "-m",
        "ember_runtime.server",
        "--config",
        str(cfg),
        "--model",
        str(model),
        "--log-level",
        "warning",
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            preexec_fn=preexec,  # noqa: PLW1509 (the caller starts no threads first)
        )
    url = f"http://{host}:{port}"
    running = RuntimeProcess(proc, url, log)

    def ready() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"runtime exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        return httpx.get(f"{url}/readyz", timeout=1).status_code == 200

    try:
        wait_for(
            "the runtime to be ready",
            ready,
            ready_timeout,
            poll,
            tolerate=(httpx.TransportError,),
            on_fail=lambda: log.read_text()[-3000:],
        )
    except WaitTimeout:
        running.stop()
        raise
    return running
