"""`python -m ember_runtime.gateway`: flags, or `EMBER_GATEWAY_*` environment (the chart's);
`settings.GatewaySettings` lists them."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

import uvicorn

from ember_runtime.cli import configure_logging, read_settings
from ember_runtime.gateway.app import Runner, Scaling, create_app
from ember_runtime.gateway.discovery import KubeDiscovery, static
from ember_runtime.gateway.fleet import Fleet
from ember_runtime.gateway.policy import Policy
from ember_runtime.gateway.scaler import scale_writer
from ember_runtime.gateway.settings import GatewaySettings
from ember_runtime.kube import Endpoint, KubeClient


def discovery(settings: GatewaySettings) -> Runner:
    """Where the routes come from: the static file if one is named, else the API server."""
    if settings.static is not None:
        return static(settings.static)
    return KubeDiscovery(
        KubeClient(Endpoint.in_cluster()),
        settings.namespace,
        settings.selector,
        settings.site,
        snapshot=settings.snapshot,
    ).run


def scaling(settings: GatewaySettings) -> Scaling:
    """Held requests always; the scaler only with the API server (a static file has no
    InferenceDeployment to scale). Its own client: short timeouts, no watches."""
    writer = None
    if settings.static is None:
        writer = scale_writer(KubeClient(Endpoint.in_cluster(), 5.0, watches=False))
    return Scaling(
        settings.hold_max_requests,
        settings.hold_timeout,
        writer,
        settings.scale_interval,
        settings.swap_interval,
        settings.swap_order,
    )


def main(argv: Sequence[str] | None = None) -> int:
    settings = read_settings(GatewaySettings, argv, "gateway")
    if settings is None:
        return 2
    configure_logging(settings.log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the API reads: a line per request
    policy = Policy(prefix_chars=settings.prefix_chars, load_factor=settings.load_factor)
    fleet = Fleet(policy, interval=settings.probe_interval, timeout=settings.probe_timeout)
    app = create_app(
        fleet,
        discovery(settings),
        read_timeout=settings.upstream_timeout,
        scaling=scaling(settings),
    )
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        access_log=False,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
