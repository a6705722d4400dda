"""The whole chain on a real cluster, as steps shared by `make demo`, `make e2e`, `make e2e-kind`.

    images → load into the node → helm install → model on the node → InferenceDeployment
    → prewarm verifies + loads → runtime Ready → streamed chat completion through the Service
    → helm uninstall leaves nothing behind

Each step prints what it does and how long it took, so a first run (which builds images) never
looks hung. The cluster-specific parts (how images get onto the node, where the API server is)
are behind `Target`, so kind (tests/e2e/kind.py) reuses every other step.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
from ember_runtime.models import MODEL_SHA256, default_model_path

from tests.cluster.procs import free_port, wait_for

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "ember"
RELEASE = "ember"
SYSTEM_NS = "ember-system"
MODEL_DIR = Path("/var/lib/ember/models/gemma-3-270m")
MODEL_FILE = "gemma-3-270m-q4_k_m.gguf"


def step(msg: str) -> None:
    print(f"==> {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def timed(msg: str) -> Iterator[None]:
    step(msg)
    start = time.monotonic()
    yield
    print(f"    done in {time.monotonic() - start:.1f}s", file=sys.stderr, flush=True)


class Target(Protocol):
    """What differs between the project's local cluster and kind."""

    kubeconfig: Path

    def load_images(self) -> dict[str, str]:
        """Build Ember's images and make them available to the node; returns helm --set values."""

    def place_model(self, src: Path, dest_dir: Path) -> None:
        """Put the model file into `dest_dir` on the node (a hostPath source)."""

    def helm_values(self) -> list[str]:
        """Extra `--set` values for this cluster (image registry, API server address…)."""


@dataclass
class Flow:
    target: Target
    helm: str
    kubectl: str

    def run_kubectl(self, *args: str, check: bool = True, timeout: float = 120) -> str:
        cmd = [self.kubectl, f"--kubeconfig={self.target.kubeconfig}", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        if check and proc.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {proc.stderr.strip()}")
        return proc.stdout

    def run_helm(self, *args: str) -> str:
        cmd = [self.helm, f"--kubeconfig={self.target.kubeconfig}", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"helm {' '.join(args[:2])}: {proc.stderr.strip()}")
        return proc.stdout

    # -- install ---------------------------------------------------------------------------
    def install(self) -> None:
        with timed("building Ember's images and loading them into the node"):
            sets = self.target.load_images()
        with timed(f"helm install {RELEASE} charts/ember (namespace {SYSTEM_NS})"):
            values = [*self.target.helm_values(), *(f"{k}={v}" for k, v in sets.items())]
            args = [
                "upgrade",
                "--install",
                RELEASE,
                str(CHART),
                "--namespace",
                SYSTEM_NS,
                "--create-namespace",
                "--wait",
                "--timeout",
                "180s",
            ]
            for value in values:
                args += ["--set", value]
            self.run_helm(*args)
        with timed("rolling the operator onto the freshly loaded image"):
            # Same tag, new image: nothing in the pod template changed, so restart explicitly.
            deploy = f"deploy/{RELEASE}-operator"
            self.run_kubectl("-n", SYSTEM_NS, "rollout", "restart", deploy)
            self.run_kubectl(
                "-n", SYSTEM_NS, "rollout", "status", deploy, "--timeout=180s", timeout=200
            )

    def uninstall(self) -> None:
        with timed(f"helm uninstall {RELEASE}"):
            self.run_helm("uninstall", RELEASE, "--namespace", SYSTEM_NS, "--wait")

    # -- the model -----------------------------------------------------------------------
    def model_manifest(self, name: str, namespace: str, replicas: int = 1) -> dict[str, Any]:
        src = default_model_path()
        with timed(f"placing the model on the node under {MODEL_DIR}"):
            self.target.place_model(src, MODEL_DIR)
        return {
            "apiVersion": "ember.dev/v1alpha1",
            "kind": "InferenceDeployment",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "replicas": replicas,
                "model": {
                    "name": "gemma-3-270m",
                    "format": "gguf",
                    "source": {"hostPath": {"path": str(MODEL_DIR)}},
                    "files": [
                        {
                            "path": MODEL_FILE,
                            "sha256": MODEL_SHA256,
                            "sizeBytes": src.stat().st_size,
                        }
                    ],
                },
                "engine": {
                    "kind": "llamacpp",
                    "contextLength": 1024,
                    "maxBatchSize": 8,
                    "minBatchSize": 2,
                },
                "accelerator": {"kind": "cpu"},
                "prewarm": {"enabled": True, "sharedMemoryLimit": "512Mi"},
            },
        }

    def apply(self, manifest: dict[str, Any]) -> None:
        cmd = [self.kubectl, f"--kubeconfig={self.target.kubeconfig}", "apply", "-f", "-"]
        proc = subprocess.run(
            cmd, input=json.dumps(manifest), capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            raise RuntimeError(f"kubectl apply: {proc.stderr.strip()}")

    def wait_ready(self, name: str, namespace: str, timeout: float = 600) -> None:
        with timed(f"waiting for InferenceDeployment {namespace}/{name} to be Ready"):
            deadline = time.monotonic() + timeout
            last = ""
            while time.monotonic() < deadline:
                row = self.run_kubectl(
                    "get", "infd", name, "-n", namespace, "--no-headers", check=False
                ).strip()
                if row != last:
                    print(f"    {row}", file=sys.stderr, flush=True)
                    last = row
                obj = json.loads(
                    self.run_kubectl("get", "infd", name, "-n", namespace, "-o", "json")
                )
                if _condition(obj, "Ready") == "True":
                    return
                time.sleep(2)
            raise TimeoutError(f"{name} not Ready after {timeout:.0f}s\n{self.dump(namespace)}")

    # -- talking to it -------------------------------------------------------------------
    @contextlib.contextmanager
    def port_forward(self, service: str, namespace: str, port: int) -> Iterator[int]:
        local = free_port()
        cmd = [
            self.kubectl,
            f"--kubeconfig={self.target.kubeconfig}",
            "port-forward",
            "-n",
            namespace,
            f"svc/{service}",
            f"{local}:{port}",
        ]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            wait_for("kubectl port-forward", lambda: _port_open(local), timeout=30)
            yield local
        finally:
            proc.terminate()
            proc.wait(timeout=10)

    def chat(self, local_port: int, prompt: str, on_token: Callable[[str], None]) -> str:
        body = {
            "model": "gemma-3-270m",
            "stream": True,
            "max_tokens": 48,
            "temperature": 0,
            "messages": [{"role": "user", "content": prompt}],
        }
        text = []
        url = f"http://127.0.0.1:{local_port}/v1/chat/completions"
        with httpx.stream("POST", url, json=body, timeout=120) as resp:
            resp.raise_for_status()
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                delta = json.loads(line[6:])["choices"][0].get("delta", {}).get("content") or ""
                text.append(delta)
                on_token(delta)
        return "".join(text)

    # -- diagnostics ---------------------------------------------------------------------
    def dump(self, namespace: str) -> str:
        """Events, describe and logs: what a failing run prints."""
        parts = []
        for args in (
            ("get", "events", "-n", namespace, "--sort-by=.lastTimestamp"),
            ("describe", "infd", "-n", namespace),
            ("describe", "pods", "-n", namespace),
            (
                "logs",
                "-n",
                namespace,
                "-l",
                "app.kubernetes.io/managed-by=ember-operator",
                "--all-containers",
                "--tail=40",
            ),
            ("logs", "-n", SYSTEM_NS, "-l", "app.kubernetes.io/component=operator", "--tail=60"),
        ):
            parts.append(f"--- kubectl {' '.join(args)}\n" + self.run_kubectl(*args, check=False))
        return "\n".join(parts)


def _condition(obj: dict[str, Any], kind: str) -> str | None:
    for cond in obj.get("status", {}).get("conditions", []):
        if cond.get("type") == kind:
            return str(cond.get("status"))
    return None


def _port_open(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        return True
    return False


def copy_model(src: Path, dest_dir: Path) -> None:
    """Local node: the node's filesystem is this machine's."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / MODEL_FILE
    if not dest.exists() or dest.stat().st_size != src.stat().st_size:
        tmp = dest.with_suffix(".partial")
        shutil.copyfile(src, tmp)
        tmp.rename(dest)
    # The runtime runs as a non-root user: the files must be readable by it.
    for path in (dest_dir, dest):
        path.chmod(0o755 if path.is_dir() else 0o644)
    os.sync()
