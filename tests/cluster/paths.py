"""Where the local cluster keeps its cache (binaries, images) and its runtime state."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ember"


def bin_dir() -> Path:
    from tests.cluster.build import HELM_VERSION, KUBERNETES_VERSION, KWOK_VERSION

    return (
        cache_root() / "bin" / f"k8s-{KUBERNETES_VERSION}_kwok-{KWOK_VERSION}_helm-{HELM_VERSION}"
    )


def state_dir() -> Path:
    """Runtime state of the running cluster (certs, etcd data, logs, kubeconfig)."""
    return Path(os.environ.get("EMBER_CLUSTER_DIR", "/var/lib/ember-cluster"))


def kubeconfig_path() -> Path:
    return state_dir() / "admin.kubeconfig"
