"""`python -m ember_operator`: run the operator (a `kopf run` with Ember's defaults).

    python -m ember_operator [-n NAMESPACE ...] [--metrics-port 9090] [--liveness-port 8081]
                             [--peering ember-operator | --standalone] [--verbose]

Namespaces come from -n flags, else $EMBER_OPERATOR_NAMESPACES (comma separated), else the whole
cluster. Peering: every replica joins the same Kopf peering with a random priority, so exactly
one (the highest) acts and the others stay paused until it disappears; two never act at once.
SIGTERM/SIGINT are handled by Kopf: handlers finish, watches close, the process exits 0.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import secrets
import sys
from collections.abc import Sequence

import kopf
import kubernetes
from prometheus_client import start_http_server

import ember_operator.handlers  # noqa: F401  (importing registers the Kopf handlers)
from ember_operator.apply import api_client
from ember_operator.settings import load_settings


def _namespaces(flags: Sequence[str]) -> list[str]:
    if flags:
        return list(flags)
    raw = os.environ.get("EMBER_OPERATOR_NAMESPACES", "")
    return [n.strip() for n in raw.replace(",", " ").split() if n.strip()]


def _ensure_peering(name: str, namespaces: list[str]) -> None:
    """Create the (Cluster)KopfPeering object Kopf coordinates through, if it is missing."""
    api = kubernetes.client.CustomObjectsApi(api_client())
    body = {"apiVersion": "kopf.dev/v1", "metadata": {"name": name}}
    try:
        if not namespaces:
            api.create_cluster_custom_object(
                "kopf.dev", "v1", "clusterkopfpeerings", {**body, "kind": "ClusterKopfPeering"}
            )
        for ns in namespaces:
            api.create_namespaced_custom_object(
                "kopf.dev", "v1", ns, "kopfpeerings", {**body, "kind": "KopfPeering"}
            )
    except kubernetes.client.exceptions.ApiException as exc:
        if exc.status != 409:  # already there is the normal case
            raise


M_ARENA_MAX = -8  # glibc malloc.h


def cap_malloc_arenas(arenas: int = 2) -> bool:
    """Why: glibc gives threads that allocate concurrently their own malloc arenas (up to eight
    per core), and Kopf runs sync handlers in a thread pool; each arena keeps freed memory
    mapped, so RSS grows with the thread count rather than with what Python holds. Two arenas
    keep allocation contention low on the small machines this runs on. False where libc is not
    glibc (nothing to cap there)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(M_ARENA_MAX, arenas))


def main(argv: Sequence[str] | None = None) -> int:
    cap_malloc_arenas()  # before any thread exists
    settings = load_settings()
    parser = argparse.ArgumentParser(prog="ember-operator", description="Ember's operator")
    parser.add_argument("-n", "--namespace", action="append", default=[], help="repeatable")
    parser.add_argument("--metrics-port", type=int, default=settings.metrics_port)
    parser.add_argument("--liveness-port", type=int, default=settings.liveness_port)
    parser.add_argument("--peering", default=settings.peering_name, help="Kopf peering name")
    parser.add_argument("--standalone", action="store_true", help="no peering (one replica)")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)

    namespaces = _namespaces(args.namespace)
    kopf.configure(verbose=args.verbose)
    if args.metrics_port:
        start_http_server(args.metrics_port)
    if not args.standalone:
        _ensure_peering(args.peering, namespaces)

    kopf.run(
        clusterwide=not namespaces,
        namespaces=namespaces,
        standalone=args.standalone,
        peering_name=None if args.standalone else args.peering,
        # Random, so two replicas (almost) never tie; a tie freezes both, which is still safe.
        priority=secrets.randbelow(1 << 30) + 1,
        liveness_endpoint=f"http://0.0.0.0:{args.liveness_port}/healthz"
        if args.liveness_port
        else None,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
