"""Hole 4 of issue 34: a client of the inference port cannot switch thermal protection off.

Before: `PUT /admin/batch` was served to anyone who reached the port (the API key is off by
default) and its override beat the thermal policy at any temperature for up to a day. Now the
writes are taken only from a loopback peer (inside the pod), and an override only lowers the
limit (tests/thermal/test_governor.py::test_an_override_never_lifts_the_batch_above_the_policy).

The app is the real one, served by the session's live server; a client "on the LAN" is the
same app behind httpx's ASGI transport with a non-loopback peer address, and a proxy sidecar's
client is a real loopback connection that says whom it forwards for (uvicorn believes
X-Forwarded-For from loopback, as it does in the runtime).
"""

from __future__ import annotations

import httpx

from tests.runtime.conftest import API_KEY, LiveServer

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PIN = {"maxBatchSize": 1, "expiresInSeconds": 86_400}


def from_lan(live: LiveServer, headers: dict[str, str] | None = None) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=live.app, client=("10.20.30.40", 40_000))
    return httpx.AsyncClient(transport=transport, base_url="http://replica", headers=headers)


async def test_a_lan_client_cannot_pin_the_batch(server: LiveServer) -> None:
    async with from_lan(server) as client:
        before = await client.get("/admin/state")  # read-only state stays reachable
        pinned = await client.put("/admin/batch", json=PIN)
        cleared = await client.delete("/admin/batch")
    assert before.status_code == 200
    assert pinned.status_code == 403, pinned.text
    assert pinned.json()["error"]["code"] == "admin_from_outside"
    assert cleared.status_code == 403
    governed = server.state.governor
    assert governed is None or governed.state().override is None
    assert server.state.engine.state().max_batch_size == before.json()["maxBatchSize"]


async def test_the_api_key_does_not_open_admin_writes_from_outside(guarded: LiveServer) -> None:
    async with from_lan(guarded, AUTH) as client:
        assert (await client.get("/admin/state")).status_code == 200
        assert (await client.put("/admin/batch", json=PIN)).status_code == 403


async def test_a_forwarded_client_is_outside_too(server: LiveServer) -> None:
    """A proxy in the pod (a mesh sidecar) connects from loopback: the client it names counts."""
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        forwarded = await client.put(
            "/admin/batch", json=PIN, headers={"X-Forwarded-For": "10.20.30.40"}
        )
        inside = await client.put("/admin/batch", json={"maxBatchSize": 2})
        await client.delete("/admin/batch")
    assert forwarded.status_code == 403, forwarded.text
    assert inside.status_code == 200 and inside.json()["maxBatchSize"] == 2
