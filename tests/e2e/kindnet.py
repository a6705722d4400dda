#!/usr/bin/python3
"""A stand-in for kindnetd (no registry here to pull it from): the same CNI layout on each node.

Run by the DaemonSet in tests/e2e/kindnet.yaml (host network) on the Debian base image:
writes the node's CNI config (ptp + host-local over its podCIDR, as kindnetd does) once the
controller manager assigned one, and keeps a route to every other node's podCIDR via that
node's InternalIP. Standard library and `ip` only.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

SA = Path("/var/run/secrets/kubernetes.io/serviceaccount")
CNI_CONF = Path("/etc/cni/net.d/10-kindnet.conflist")


def api_base() -> str:
    # kind patches CONTROL_PLANE_ENDPOINT in: the API server without waiting for kube-proxy.
    endpoint = os.environ.get("CONTROL_PLANE_ENDPOINT")
    if not endpoint:
        endpoint = (
            f"{os.environ['KUBERNETES_SERVICE_HOST']}:{os.environ['KUBERNETES_SERVICE_PORT']}"
        )
    return f"https://{endpoint}"


def list_nodes(base: str, context: ssl.SSLContext) -> list[dict[str, Any]]:
    request = urllib.request.Request(
        f"{base}/api/v1/nodes",
        headers={"Authorization": f"Bearer {(SA / 'token').read_text().strip()}"},
    )
    with urllib.request.urlopen(request, context=context, timeout=10) as resp:
        return list(json.load(resp)["items"])


def internal_ip(node: dict[str, Any]) -> str | None:
    for address in node.get("status", {}).get("addresses", []):
        if address.get("type") == "InternalIP" and ":" not in address.get("address", ""):
            return str(address["address"])
    return None


def conflist(pod_cidr: str) -> str:
    ipam = {
        "type": "host-local",
        "dataDir": "/run/cni-ipam-state",
        "routes": [{"dst": "0.0.0.0/0"}],
        "ranges": [[{"subnet": pod_cidr}]],
    }
    plugins = [
        {"type": "ptp", "ipMasq": False, "ipam": ipam, "mtu": 1500},
        {"type": "portmap", "capabilities": {"portMappings": True}},
    ]
    return json.dumps({"cniVersion": "0.4.0", "name": "kindnet", "plugins": plugins}, indent=2)


def sync(me: str, nodes: list[dict[str, Any]]) -> None:
    for node in nodes:
        cidr, ip = node.get("spec", {}).get("podCIDR"), internal_ip(node)
        if not cidr:
            continue
        if node["metadata"]["name"] == me:
            text = conflist(cidr)
            if not CNI_CONF.exists() or CNI_CONF.read_text() != text:
                tmp = CNI_CONF.with_suffix(".tmp")
                tmp.write_text(text)
                tmp.replace(CNI_CONF)
                print(f"wrote {CNI_CONF} for {cidr}", flush=True)
        elif ip:
            subprocess.run(["ip", "route", "replace", cidr, "via", ip], check=False)


def main() -> None:
    me = os.environ["NODE_NAME"]
    context = ssl.create_default_context(cafile=str(SA / "ca.crt"))
    base = api_base()
    while True:
        try:
            sync(me, list_nodes(base, context))
        except (OSError, ValueError, KeyError) as exc:
            print(f"sync failed: {exc}", file=sys.stderr, flush=True)
        time.sleep(5)


if __name__ == "__main__":
    main()
