"""Kopf's watch decoding goes through orjson (ember_operator.kopf_json) and means the same."""

from __future__ import annotations

import inspect
import json

from ember_operator import kopf_json, kopf_setup
from kopf._cogs.clients import api as kopf_api

DECODER = getattr(kopf_api, "json")  # noqa: B009 - Kopf does not export the name


def test_the_operator_installs_it() -> None:
    assert "kopf_json.install()" in inspect.getsource(kopf_setup)
    assert kopf_json.installed()
    assert DECODER.dumps is json.dumps  # the rest of the module is the standard one


def test_kopf_still_decodes_watch_lines_where_it_is_installed() -> None:
    """A Kopf release that decodes elsewhere would silently lose the speed-up: fail instead."""
    source = inspect.getsource(kopf_api.stream)
    assert "json.loads(line" in source
    assert [n for n in kopf_api.stream.__code__.co_names if n == "json"] == ["json"]


def test_same_objects_as_the_standard_library() -> None:
    event = {
        "type": "MODIFIED",
        "object": {
            "metadata": {"name": "pod-é✓", "resourceVersion": "18446744073", "generation": 3},
            "spec": {"replicas": 0, "ratio": 0.25, "big": 2**62, "none": None, "on": True},
            "status": {"conditions": [{"message": 'quote " and \\ backslash\nnewline'}]},
        },
    }
    line = json.dumps(event, ensure_ascii=False)
    assert DECODER.loads(line) == json.loads(line) == event
