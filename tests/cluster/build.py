"""Build the pinned Kubernetes binaries (and etcd, kwok, helm) from the Go module proxy, cached.

`go install k8s.io/kubernetes/cmd/...@vX` is refused because k8s.io/kubernetes' go.mod
`replace`s every staging module with a local path. We therefore generate a small wrapper
module that requires k8s.io/kubernetes and replaces each staging module with its published
`k8s.io/<name> v0.Y.Z` twin; the list of staging modules is read from the release's own
go.mod so a new release needs no code change.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tests.cluster.paths import bin_dir, cache_root

KUBERNETES_VERSION = "v1.36.3"
KWOK_VERSION = "v0.7.0"
# The etcd that Kubernetes v1.36.3 is built and tested against (k8s.io/apiserver's go.mod).
# Debian's etcd 3.4.23 cannot serve progress-notify requests, so a 1.36 API server refuses
# every watch that asks for initial events or bookmarks from "now" (as kwok's do), and its
# own watch cache lags: kwok then re-lists on a backoff of up to 30 s and sees new nodes, and
# renews leases, that late.
ETCD_VERSION = "v3.6.8"
ETCD_MODULE = "go.etcd.io/etcd/server/v3"  # its root package is etcd's main
HELM_VERSION = "v3.20.2"
GOPROXY = os.environ.get("GOPROXY", "https://proxy.golang.org").split(",")[0]

KUBE_BINARIES = (
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubelet",
    "kubectl",
)


@dataclass(frozen=True)
class Tool:
    name: str
    module: str
    version: str
    package: str


EXTRA_TOOLS = (
    # Versioned file name: a new pin builds only etcd, not the Kubernetes binaries beside it.
    Tool(f"etcd-{ETCD_VERSION}", ETCD_MODULE, ETCD_VERSION, ETCD_MODULE),
    Tool("kwok", "sigs.k8s.io/kwok", KWOK_VERSION, "sigs.k8s.io/kwok/cmd/kwok"),
    Tool("helm", "helm.sh/helm/v3", HELM_VERSION, "helm.sh/helm/v3/cmd/helm"),
)

ALL_BINARIES = KUBE_BINARIES + tuple(t.name for t in EXTRA_TOOLS)


def log(msg: str) -> None:
    print(f"[ember-cluster] {msg}", file=sys.stderr, flush=True)


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=60) as resp:
        return str(resp.read().decode())


def staging_modules(version: str) -> list[str]:
    """Names of the staging modules that the release's go.mod replaces with local paths."""
    gomod = _fetch(f"{GOPROXY}/k8s.io/kubernetes/@v/{version}.mod")
    return sorted(set(re.findall(r"k8s\.io/([\w.-]+)\s*=>\s*\./staging/", gomod)))


def go_env() -> dict[str, str]:
    env = dict(os.environ)
    # Go 1.27's json/v2 default breaks the apiserver's OpenAPI ("$root has invalid property").
    env.setdefault("GOEXPERIMENT", "nojsonv2")
    env["GOFLAGS"] = "-mod=mod -buildvcs=false -trimpath"
    env["CGO_ENABLED"] = "0"
    # Two cores: one package compile at a time keeps the apiserver link under ~2 GB RSS.
    env.setdefault("GOMAXPROCS", "2")
    return env


def _wrapper_module(root: Path, module: str, version: str, replaces: dict[str, str]) -> Path:
    wrapper = root / "wrapper" / f"{module.replace('/', '_')}@{version}"
    wrapper.mkdir(parents=True, exist_ok=True)
    lines = ["module ember.dev/k8sbuild", "", "go 1.26", "", f"require {module} {version}", ""]
    lines += [f"replace {name} => {name} {ver}" for name, ver in sorted(replaces.items())]
    (wrapper / "go.mod").write_text("\n".join(lines) + "\n")
    return wrapper


def version_ldflags(version: str) -> str:
    """Stamp the release version, as the upstream build does (else it reports v0.0.0-master,
    which kubectl, helm and version-skew checks refuse to parse)."""
    major, minor = version.lstrip("v").split(".")[:2]
    pairs = {
        "gitVersion": version,
        "gitMajor": major,
        "gitMinor": minor,
        "gitTreeState": "clean",
        "buildDate": "1970-01-01T00:00:00Z",
    }
    pkgs = ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")
    return " ".join(f"-X {pkg}.{key}={value}" for pkg in pkgs for key, value in pairs.items())


def _run_go(args: list[str], cwd: Path, what: str) -> None:
    start = time.monotonic()
    log(f"building {what} (go {' '.join(args[:2])} …)")
    proc = subprocess.run(["go", *args], cwd=cwd, env=go_env(), check=False)
    if proc.returncode != 0:
        raise SystemExit(f"go build of {what} failed (exit {proc.returncode})")
    log(f"built {what} in {time.monotonic() - start:.0f}s")


# What a kind node image needs beyond the local cluster's binaries (tests/e2e/kind_node.py).
KIND_BINARIES = ("kubeadm", "kube-proxy")


def build_kubernetes(out: Path, names: tuple[str, ...] = KUBE_BINARIES) -> None:
    missing = [b for b in names if not (out / b).exists()]
    if not missing:
        return
    minor = KUBERNETES_VERSION.split(".", 1)[1]  # "36.3"
    replaces = {f"k8s.io/{m}": f"v0.{minor}" for m in staging_modules(KUBERNETES_VERSION)}
    wrapper = _wrapper_module(cache_root(), "k8s.io/kubernetes", KUBERNETES_VERSION, replaces)
    for name in missing:
        # One binary at a time: each `go build` reuses the shared build cache of the previous.
        target = f"k8s.io/kubernetes/cmd/{name}"
        ldflags = f"-s -w {version_ldflags(KUBERNETES_VERSION)}"
        _run_go(["build", "-ldflags", ldflags, "-o", str(out / name), target], wrapper, name)


def build_tool(tool: Tool, out: Path) -> None:
    if (out / tool.name).exists():
        return
    wrapper = _wrapper_module(cache_root(), tool.module, tool.version, {})
    _run_go(["build", "-o", str(out / tool.name), tool.package], wrapper, tool.name)


def ensure_binaries(extra: tuple[str, ...] = ()) -> Path:
    """Build whatever is missing (plus the `extra` Kubernetes commands); a second call builds
    nothing."""
    if shutil.which("go") is None:
        raise SystemExit("Go is required to build the local cluster's binaries (see README)")
    out = bin_dir()
    out.mkdir(parents=True, exist_ok=True)
    if all((out / name).exists() for name in ALL_BINARIES + extra):
        return out
    # One builder at a time (a test session and `make cluster-up` may race); the others wait.
    with (cache_root() / "build.lock").open("w") as lock:
        if not _try_lock(lock):
            log("another build is running; waiting for it")
            fcntl.flock(lock, fcntl.LOCK_EX)
        build_kubernetes(out, KUBE_BINARIES + extra)
        for tool in EXTRA_TOOLS:
            build_tool(tool, out)
    return out


def _try_lock(lock: IO[str]) -> bool:
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


if __name__ == "__main__":
    print(ensure_binaries())
