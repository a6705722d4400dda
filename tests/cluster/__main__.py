"""CLI: python -m tests.cluster build|up|down|status|env|fleet N."""

from __future__ import annotations

import argparse
import json
import sys

from tests.cluster.build import ensure_binaries
from tests.cluster.images import ensure_images


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.cluster", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build", help="build/cache binaries and images only")
    up = sub.add_parser("up", help="start the control plane, kwok and the real node")
    up.add_argument("--no-node", action="store_true", help="control plane + kwok only")
    sub.add_parser("down", help="stop everything and clean up")
    sub.add_parser("status", help="which components run (exit 1 unless all)")
    sub.add_parser("env", help='print shell exports (eval "$(python -m tests.cluster env)")')
    fleet = sub.add_parser("fleet", help="create N kwok nodes over S sites")
    fleet.add_argument("n", type=int)
    fleet.add_argument("--sites", type=int, default=5)
    args = parser.parse_args(argv)

    if args.cmd == "build":
        ensure_binaries()
        ensure_images()
        return 0
    from tests.cluster.cluster import Cluster  # needs `cryptography` and the dev extras

    cluster = Cluster()
    if args.cmd == "up":
        cluster.up(with_node=not args.no_node)
    elif args.cmd == "down":
        cluster.down()
    elif args.cmd == "status":
        status = cluster.status()
        print(json.dumps(status, indent=2))
        return 0 if all(status.values()) else 1
    elif args.cmd == "env":
        for key, value in cluster.env().items():
            print(f"export {key}={value}")
    elif args.cmd == "fleet":
        from kubernetes import config

        from tests.cluster.fleet import ensure_fleet

        api = config.new_client_from_config(str(cluster.kubeconfig))
        print(len(ensure_fleet(api, args.n, args.sites)), "fleet nodes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
