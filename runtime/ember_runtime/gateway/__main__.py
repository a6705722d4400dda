"""`python -m ember_runtime.gateway`: flags, or `EMBER_GATEWAY_*` environment (the chart's)."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import uvicorn

from ember_runtime.gateway.app import Runner, create_app
from ember_runtime.gateway.discovery import KubeDiscovery, static
from ember_runtime.gateway.fleet import Fleet
from ember_runtime.gateway.policy import Policy
from ember_runtime.kube import Endpoint, KubeClient


def _env(name: str, default: str = "") -> str:
    return os.environ.get(f"EMBER_GATEWAY_{name}", default)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ember_runtime.gateway", description=__doc__)
    p.add_argument("--host", default=_env("HOST", "0.0.0.0"))  # noqa: S104 - a LAN service
    p.add_argument("--port", type=int, default=int(_env("PORT", "8080")))
    p.add_argument("--namespace", default=_env("NAMESPACE"), help="InferenceDeployments' namespace")
    p.add_argument("--selector", default=_env("SELECTOR"), help="their label selector")
    p.add_argument("--site", default=_env("SITE"), help="only replicas on nodes of this site")
    p.add_argument(
        "--static",
        type=Path,
        default=_env("STATIC") or None,
        help="a routes file instead of the API server (routes.load_static)",
    )
    p.add_argument(
        "--snapshot",
        type=Path,
        default=_env("SNAPSHOT") or None,
        help="keep the last known routes here, for a restart while the API server is away",
    )
    p.add_argument("--probe-interval", type=float, default=float(_env("PROBE_INTERVAL", "0.4")))
    p.add_argument("--probe-timeout", type=float, default=float(_env("PROBE_TIMEOUT", "0.5")))
    p.add_argument("--upstream-timeout", type=float, default=float(_env("UPSTREAM_TIMEOUT", "600")))
    p.add_argument("--prefix-chars", type=int, default=int(_env("PREFIX_CHARS", "256")))
    p.add_argument("--load-factor", type=float, default=float(_env("LOAD_FACTOR", "1.25")))
    p.add_argument("--log-level", default=_env("LOG_LEVEL", "info"))
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the API reads: a line per request
    if args.load_factor < 1.0:
        raise SystemExit("--load-factor must be at least 1")
    if args.static is not None:
        discover: Runner = static(args.static)
    elif args.namespace:
        discover = KubeDiscovery(
            KubeClient(Endpoint.in_cluster()),
            args.namespace,
            args.selector,
            args.site,
            snapshot=args.snapshot,
        ).run
    else:
        raise SystemExit("--namespace (the API server) or --static (a routes file) is required")
    policy = Policy(prefix_chars=args.prefix_chars, load_factor=args.load_factor)
    fleet = Fleet(policy, interval=args.probe_interval, timeout=args.probe_timeout)
    app = create_app(fleet, discover, read_timeout=args.upstream_timeout)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)


if __name__ == "__main__":
    main()
