"""The runtime's `ember.dev/Health`, on the real server with the real model: what its requests
count in the window (in process, read from the app's tracker), and the condition the runtime
process patches onto its own pod (a fake API server over HTTPS that records the patches, reached
the way a pod reaches its API server: KUBERNETES_SERVICE_HOST/PORT and the ServiceAccount dir)."""

from __future__ import annotations

import json
import shutil
import ssl
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from ember_runtime.contract.rollout import HEALTH_CONDITION, HealthReport, parse_health_condition
from ember_runtime.server.app import create_app
from ember_runtime.server.health import HealthTracker

from tests.cluster.pki import PKI, CertSpec
from tests.runtime.conftest import LiveServer, make_config, start_live
from tests.runtime.test_embeddings import embed_config
from tests.support.waiting import wait_for
from tests.thermal.conftest import FakeThermalTree
from tests.thermal.runtime_proc import start_runtime

COMPLETION = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Iterator[LiveServer]:
    config = make_config(tmp_path_factory.mktemp("health"), maxQueue=16)
    server = start_live(create_app(config, model_path=model_path))
    yield server
    server.stop()


def tracker_of(server: LiveServer) -> HealthTracker:
    tracker: HealthTracker = server.app.state.health
    return tracker


def counts(server: LiveServer) -> tuple[int, int]:
    report = tracker_of(server).report()
    return report.requests, report.errors


def assert_counts_reach(server: LiveServer, want: tuple[int, int]) -> None:
    """The server counts a request once its response is sent, which may be just after the
    client has read it: wait for the count, and then it must be exactly `want`."""
    wait_for(f"{want[0]} counted requests", lambda: counts(server)[0] >= want[0], timeout=5)
    assert counts(server) == want


def test_finished_requests_count_with_their_ttft(live: LiveServer) -> None:
    before = counts(live)
    with httpx.Client(base_url=live.url, timeout=120) as http:
        assert http.post("/v1/completions", json=COMPLETION).status_code == 200
        streamed = http.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert streamed.status_code == 200 and "[DONE]" in streamed.text
        n2 = http.post("/v1/completions", json={**COMPLETION, "n": 2})  # one request, 2 choices
        assert n2.status_code == 200
    assert_counts_reach(live, (before[0] + 3, before[1]))
    report = tracker_of(live).report()
    assert report.ttft_p99_ms is not None and not report.throttled
    assert report.reason == "Serving"


def test_client_errors_are_not_counted(live: LiveServer) -> None:
    before = counts(live)
    with httpx.Client(base_url=live.url, timeout=120) as http:
        for body in (
            {**COMPLETION, "bogus": 1},  # unsupported parameter
            {**COMPLETION, "prompt": ""},  # empty prompt
            {**COMPLETION, "max_tokens": 100_000},  # beyond the context
        ):
            assert http.post("/v1/completions", json=body).status_code == 400
        assert http.post("/v1/chat/completions", content=b"{not json").status_code == 400
        assert http.post("/v1/embeddings", json={"input": "x"}).status_code == 400  # generate
        assert http.get("/v1/models").status_code == 200  # not an inference endpoint
    assert counts(live) == before


def test_timeouts_are_server_errors_streamed_or_not(live: LiveServer) -> None:
    before = counts(live)
    timeout = live.state.request_timeout
    live.state.request_timeout = 1e-6  # no token comes that fast: a 504, or its stream event
    try:
        with httpx.Client(base_url=live.url, timeout=120) as http:
            assert http.post("/v1/completions", json=COMPLETION).status_code == 504
            streamed = http.post("/v1/completions", json={**COMPLETION, "stream": True})
            assert streamed.status_code == 200 and '"code": "timeout"' in streamed.text
    finally:
        live.state.request_timeout = timeout
    assert_counts_reach(live, (before[0] + 2, before[1] + 2))
    assert tracker_of(live).report().reason == "ServerErrors"


def test_a_client_that_leaves_is_not_counted(live: LiveServer) -> None:
    before = counts(live)
    body = {**COMPLETION, "max_tokens": 200, "stream": True}
    with (
        httpx.Client(base_url=live.url, timeout=120) as http,
        http.stream("POST", "/v1/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        next(resp.iter_lines())  # the first chunk, then hang up
    state = live.state.engine.state
    wait_for("the abandoned stream's slot freed", lambda: state().active == 0, timeout=30)
    time.sleep(0.3)  # the response's end reaches the middleware after the slot is freed
    assert counts(live) == before


def test_a_batch_held_below_capacity_marks_the_window_throttled(live: LiveServer) -> None:
    """Last in this module: the flag stays for the window."""
    ttft_before = tracker_of(live).report().ttft_p99_ms
    with httpx.Client(base_url=live.url, timeout=120) as http:
        held = http.put("/admin/batch", json={"maxBatchSize": 1, "expiresInSeconds": 60})
        assert held.status_code == 200, held.text
        try:
            assert http.post("/v1/completions", json=COMPLETION).status_code == 200
        finally:
            assert http.delete("/admin/batch").status_code == 200
    report = tracker_of(live).report()
    assert report.throttled
    assert report.ttft_p99_ms == ttft_before  # its TTFT is not the version's


def test_embeddings_count_the_time_to_their_response(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    server = start_live(create_app(embed_config(tmp_path_factory.mktemp("embed-health"))))
    try:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            assert http.post("/v1/embeddings", json={"input": ["a", "b"]}).status_code == 200
            assert http.post("/v1/embeddings", json={"input": ""}).status_code == 400
        report = tracker_of(server).report()
    finally:
        server.stop()
    assert (report.requests, report.errors) == (1, 0)
    assert report.ttft_p99_ms is not None


# ----------------------------------------------------------------------------- the condition


class FakeApiServer:
    """HTTPS on 127.0.0.1 with a certificate of its own CA; answers every PATCH with 200 and
    records it (path, headers by lower-case name, JSON body). Nothing else is served."""

    def __init__(self, tmp: Path) -> None:
        pki = PKI(tmp / "pki")
        spec = CertSpec(
            "apiserver", "fake-apiserver", server=True, client=False, ips=("127.0.0.1",)
        )
        crt, key = pki.issue(spec)
        self.ca = pki.ca_cert_path
        self.patches: list[tuple[str, dict[str, str], dict[str, Any]]] = []
        self._lock = threading.Lock()
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(crt, key)
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.socket = context.wrap_socket(self._httpd.socket, server_side=True)
        self.port: int = self._httpd.server_address[1]
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_PATCH(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with api._lock:
                    headers = {k.lower(): v for k, v in self.headers.items()}
                    api.patches.append((self.path, headers, body))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler

    def conditions(self, ctype: str) -> list[tuple[str, dict[str, str], dict[str, Any]]]:
        with self._lock:
            patches = list(self.patches)
        return [
            (path, headers, cond)
            for path, headers, body in patches
            for cond in body["status"]["conditions"]
            if cond["type"] == ctype
        ]

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def _reported(api: FakeApiServer, at_least: int) -> HealthReport | None:
    for _, _, cond in reversed(api.conditions(HEALTH_CONDITION)):
        report = parse_health_condition([cond])
        if report is not None and report.requests >= at_least:
            return report
    return None


def test_the_runtime_patches_its_pods_health_condition(tmp_path: Path) -> None:
    api = FakeApiServer(tmp_path)
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("pod-bound-token\n")
    shutil.copy(api.ca, sa / "ca.crt")
    tree = FakeThermalTree(tmp_path / "sys")
    tree.zone(0, "soc-thermal", 50.0)
    env = {
        "POD_NAME": "replica-0",
        "POD_NAMESPACE": "shop",
        "KUBERNETES_SERVICE_HOST": "127.0.0.1",
        "KUBERNETES_SERVICE_PORT": str(api.port),
        "EMBER_SERVICEACCOUNT_DIR": str(sa),
    }
    proc = start_runtime(tmp_path, tree.root, env=env)
    sent = 4  # a power of two: whatever count an earlier write had, this one is a new band
    try:
        with httpx.Client(base_url=proc.url, timeout=120) as http:
            assert http.post("/v1/completions", json=COMPLETION).status_code == 200
            assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
            for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
                streamed = http.post(path, json={**body, "stream": True})
                assert streamed.status_code == 200 and "[DONE]" in streamed.text
            refused = http.post("/v1/completions", json={**COMPLETION, "prompt": ""})
            assert refused.status_code == 400  # the client's error: not counted
        # One write per 10 s at most: the first (Idle) went out at start.
        report = wait_for(
            "a health condition with the requests sent",
            lambda: _reported(api, sent),
            timeout=60,
            on_fail=lambda: proc.log.read_text()[-2000:],
        )
    finally:
        proc.stop()
        api.stop()
    assert report.requests == sent and report.errors == 0
    assert report.ttft_p99_ms is not None and not report.throttled
    assert report.window_seconds == 300
    written = api.conditions(HEALTH_CONDITION)
    path, headers, first = written[0]
    assert path == "/api/v1/namespaces/shop/pods/replica-0/status"
    assert headers["content-type"] == "application/strategic-merge-patch+json"
    assert headers["authorization"] == "Bearer pod-bound-token"
    assert first["reason"] == "Idle" and first["status"] == "True"  # the first, at start
    assert written[-1][2]["reason"] == "Serving"
    assert len(written) <= 3  # coalesced: Idle, then at most one write per band reached
