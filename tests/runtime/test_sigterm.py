"""SIGTERM drains: the server stops taking connections, finishes in-flight streams, exits 0."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.support.net import free_port
from tests.support.waiting import wait_for


def test_sigterm_drains_in_flight_streams(model_path: Path, tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "EMBER_CONFIG": "", "PYTHONUNBUFFERED": "1"}
    env.pop("EMBER_CONFIG")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ember_runtime.server",
            "--model",
            str(model_path),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--threads",
            "1",
            "--max-batch-size",
            "2",
            "--context-length",
            "256",
            "--sysfs-root",
            str(tmp_path),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        base = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            return httpx.get(base + "/readyz").status_code == 200

        wait_for("the server to be ready", ready, 120, 0.2, tolerate=(httpx.TransportError,))

        body = {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0, "stream": True}
        with (
            httpx.Client(base_url=base, timeout=60) as client,
            client.stream("POST", "/v1/completions", json=body) as response,
        ):
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in [first, *rest[:-1]]]
        texts = [c["choices"][0]["text"] for c in chunks]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert "".join(texts)
        assert proc.wait(timeout=60) == 0
        output = proc.stdout.read().decode() if proc.stdout else ""
        assert "draining" in output
        assert re.search(r"froze [1-9]\d+ start-up objects", output)  # ember_runtime.heap
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
