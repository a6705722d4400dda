"""What fleet engines make of an InferenceDeployment: kstatus and Argo CD's health check.

`check_object(obj)` -> (kstatus status, Argo CD health status) for one object as the API server
returns it; `check_objects` does many with one start of the kstatus harness. kstatus is the real
library (tests/fleet/kstatus.py); Argo CD's verdict is charts/ember/files/argocd-health.lua run
the way Argo CD runs it: Lua 5.1 (Argo CD's gopher-lua is 5.1), the object as nested tables in
the global `obj`, and only the base and table libraries (Argo CD opens no string or math
library, so a script that used them would fail there while passing a stock interpreter).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

from tests.fleet import kstatus

ROOT = Path(__file__).resolve().parents[2]
ARGOCD_HEALTH = ROOT / "charts" / "ember" / "files" / "argocd-health.lua"
ARGOCD_CM = ROOT / "charts" / "ember" / "files" / "argocd-cm-snippet.yaml"
ARGOCD_KEY = "resource.customizations.health.ember.dev_InferenceDeployment"
ARGO_STATUSES = frozenset({"Healthy", "Progressing", "Degraded", "Suspended", "Missing"})
# Argo CD's VM opens only package, base, table and a safe os: the rest is closed here, and so
# are those three, which the script needs none of (stricter than Argo CD, never looser).
_CLOSED = ("string", "math", "io", "debug", "coroutine", "python", "os", "require", "package")


def _lua51() -> Any:
    # lupa has no type information; its Lua 5.1 build is the one Argo CD's dialect matches.
    return importlib.import_module("lupa.lua51")


def _lua_runtime() -> Any:
    lua = _lua51().LuaRuntime(register_eval=False, register_builtins=False)
    lua.execute('debug.setmetatable("", nil)')  # no s:method() either: no string library
    globals_ = lua.globals()
    for name in _CLOSED:
        globals_[name] = None
    return lua


def argo_health(obj: dict[str, Any], script: str | None = None) -> dict[str, str]:
    """The Lua health check's verdict for `obj`: {"status": ..., "message": ...}."""
    lua = _lua_runtime()
    plain = json.loads(json.dumps(obj))  # what the API server sends: JSON types only
    lua.globals().obj = lua.table_from(plain, recursive=True)
    hs = lua.execute(script if script is not None else ARGOCD_HEALTH.read_text())
    if _lua51().lua_type(hs) != "table":
        raise AssertionError(f"the health script returned {hs!r}, not a table")
    result = {"status": str(hs["status"]), "message": str(hs["message"] or "")}
    if result["status"] not in ARGO_STATUSES:
        raise AssertionError(f"Argo CD rejects health status {result['status']!r}")
    return result


def check_objects(objs: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(kstatus status, Argo CD health status) for each object, in order."""
    ks = kstatus.compute(objs)
    return [(k["status"], argo_health(obj)["status"]) for k, obj in zip(ks, objs, strict=True)]


def check_object(obj: dict[str, Any]) -> tuple[str, str]:
    """(kstatus status, Argo CD health status) for one InferenceDeployment."""
    return check_objects([obj])[0]
