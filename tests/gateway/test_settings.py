"""The gateway's settings: the flags tests and benches pass, the environment the chart writes,
and a start with nowhere to take routes from refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from ember_runtime.gateway.__main__ import main
from ember_runtime.gateway.settings import GatewaySettings
from pydantic_settings import CliApp

from tests.chart.test_chart import NAMESPACE, by_kind, helm, render
from tests.gateway.test_chart import VALUES, gateway_objects

__all__ = ["helm"]  # the fixture, shared with tests/chart
FIELDS = GatewaySettings.model_fields


def test_flags_as_the_tests_and_benches_pass_them() -> None:
    argv = ["--static", "/tmp/routes.json", "--host", "127.0.0.1", "--port", "9000",
            "--prefix-chars", "64", "--probe-interval", "0.2", "--load-factor", "1.5",
            "--hold-max-requests", "8", "--hold-timeout", "30"]  # fmt: skip
    settings = CliApp.run(GatewaySettings, cli_args=argv)
    assert settings.static == Path("/tmp/routes.json")
    assert (settings.host, settings.port, settings.prefix_chars) == ("127.0.0.1", 9000, 64)
    assert (settings.probe_interval, settings.load_factor) == (0.2, 1.5)
    assert (settings.hold_max_requests, settings.hold_timeout) == (8, 30.0)


def test_the_charts_environment(helm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every EMBER_GATEWAY_* the chart writes is a setting, read with the chart's value."""
    (deployment, *_) = by_kind(gateway_objects(render(helm, *VALUES)), "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    ours = {e["name"]: e["value"] for e in container["env"] if e["name"].startswith("EMBER_")}
    unknown = {n for n in ours if n.removeprefix("EMBER_GATEWAY_").lower() not in FIELDS}
    assert ours and unknown == set()
    for name, value in ours.items():
        monkeypatch.setenv(name, value)
    settings = CliApp.run(GatewaySettings, cli_args=[])
    assert (settings.namespace, settings.site) == (NAMESPACE, "plant-a")
    assert settings.selector == "ember.dev/exposed=true"
    assert settings.snapshot == Path("/run/ember-gateway/routes.json")
    assert (settings.probe_interval, settings.probe_timeout) == (0.4, 0.5)
    assert (settings.upstream_timeout, settings.prefix_chars, settings.load_factor) == (
        600.0,
        256,
        1.25,
    )
    assert (settings.hold_max_requests, settings.hold_timeout) == (64, 120.0)
    assert (settings.scale_interval, settings.swap_interval) == (1.0, 30.0)


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        ([], "--namespace (the API server) or --static (a routes file) is required"),
        (["--namespace", "ns", "--load-factor", "0.9"], "load_factor"),
        (["--namespace", "ns", "--probe-interval", "0"], "probe_interval"),
        (["--namespace", "ns", "--hold-timeout", "0"], "hold_timeout"),
        (["--namespace", "ns", "--hold-max-requests", "-1"], "hold_max_requests"),
    ],
)
def test_a_start_it_cannot_serve_is_refused(
    argv: list[str], why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert why in capsys.readouterr().err
