"""Origin credentials from a Secret in the node agent's own namespace.

`spec.model.source.http.secretRef` names the Secret; any user who may create an
InferenceDeployment can name it, but only the agent reads it. So the Secret itself says where
its credentials may go: `urlPrefix` is required, and a URL that does not start with it gets no
credentials (otherwise a spec pointing at a host of its author's choosing could collect them).
Keys: `token` (an `Authorization: Bearer` header) or `username` + `password` (basic auth).
"""

from __future__ import annotations

import base64
from collections.abc import Mapping

from ember_runtime.contract import reasons
from ember_runtime.nodeagent.cache import FetchError


def decode_secret_data(data: Mapping[str, str]) -> dict[str, str]:
    """A Secret's `data` (base64 values, as the API server returns them) as text."""
    return {k: base64.b64decode(v).decode() for k, v in data.items()}


def auth_headers(secret_name: str, data: Mapping[str, str], url: str) -> dict[str, str]:
    """Headers that authenticate `url` with the Secret's decoded `data`; raises FetchError."""
    prefix = data.get("urlPrefix", "").strip()
    if not prefix:
        raise FetchError(
            f"Secret {secret_name} has no urlPrefix: its credentials are sent nowhere",
            reasons.MODEL_DOWNLOAD_FAILED,
        )
    if not _within(url, prefix):
        raise FetchError(
            f"Secret {secret_name}'s urlPrefix {prefix} does not cover the model's URL",
            reasons.MODEL_DOWNLOAD_FAILED,
        )
    token = data.get("token", "").strip()
    if token:
        return {"Authorization": f"Bearer {token}"}
    if "username" in data and "password" in data:
        pair = f"{data['username']}:{data['password']}".encode()
        return {"Authorization": f"Basic {base64.b64encode(pair).decode()}"}
    raise FetchError(
        f"Secret {secret_name} has neither token nor username and password",
        reasons.MODEL_DOWNLOAD_FAILED,
    )


def _within(url: str, prefix: str) -> bool:
    """`url` starts with `prefix` at a boundary: https://a.example/ never covers
    https://a.example.evil/ — a prefix without a path must end at the host."""
    if not url.startswith(prefix):
        return False
    if prefix.endswith("/") or len(url) == len(prefix):
        return True
    return url[len(prefix)] in "/?#"
