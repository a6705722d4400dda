"""Drill 2: specs generated from the API's own schema (the pydantic models, as `crdgen` turns
them into the CRD), then one mutation each. A mutated spec must be refused by the API server
with a message naming the field; an unmutated one must be accepted, and then served by the
operator (children and observedGeneration) or reported (a Degraded condition with a reason)."""

from __future__ import annotations

import copy
import re
import string
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ember_operator.api.crdgen import open_api_schema
from hypothesis import strategies as st

from tests.operator.specs import manifest

Path = tuple[str | int, ...]
TEXT = string.ascii_letters + string.digits + "-._/"
# Hypothesis leans towards the first choice (about half the cases): the valid specs, which
# then exercise the operator; the mutations share the other half.
MUTATIONS = (
    "none",
    "wrong-type",
    "out-of-range",
    "unknown-field",
    "missing-required",
    "bad-quantity",
    "bad-enum",
)
UNKNOWN = "bogusField"
BAD_QUANTITIES = ("12 GiB", "lots", "1.5.0Mi", "Mi")
# The model section stays the valid one of the other tests: the files and their source are
# where mutations go, but a random valid source would only be unschedulable, not interesting.
FIXED = {"model": manifest()["spec"]["model"]}
SMALL = {("replicas",): st.integers(0, 2)}  # enough to create pods, not to fill the machine
RESOURCES = ("cpu", "memory")  # resource names: the CRD checks them with a regex in CEL
ORDERS = ("sites", "selector", "count", "percent")  # a rollout wave sets exactly one


def spec_schema() -> dict[str, Any]:
    return dict(open_api_schema()["properties"]["spec"])


def _is_quantity(node: dict[str, Any]) -> bool:
    return bool(node.get("x-kubernetes-int-or-string"))


def from_schema(node: dict[str, Any], path: Path = ()) -> st.SearchStrategy[Any]:
    """Values the schema allows (single-field rules only; `repair` does the cross-field ones)."""
    if path in SMALL:
        return SMALL[path]
    if _is_quantity(node):
        return st.from_regex(node["pattern"], fullmatch=True).filter(lambda s: len(s) < 20)
    if "enum" in node:
        return st.sampled_from(node["enum"])
    if node.get("type") == "object":
        return _object(node, path) if "properties" in node else _map(node, path)
    if node.get("type") == "array":
        return _array(node, path)
    return _scalar(node)


def _scalar(node: dict[str, Any]) -> st.SearchStrategy[Any]:
    if node.get("type") == "integer":
        return st.integers(node.get("minimum", -(2**31)), node.get("maximum", 2**31))
    if node.get("type") == "number":
        low, high = node.get("minimum", -1e6), node.get("maximum", 1e6)
        return st.floats(
            low,
            high,
            exclude_min=node.get("exclusiveMinimum", False),
            exclude_max=node.get("exclusiveMaximum", False),
            allow_nan=False,
            allow_infinity=False,
        )
    if node.get("type") == "boolean":
        return st.booleans()
    low, high = node.get("minLength", 0), min(node.get("maxLength", 24), 24)
    return st.text(TEXT, min_size=low, max_size=max(low, high))


def _map(node: dict[str, Any], path: Path) -> st.SearchStrategy[Any]:
    values = from_schema(node.get("additionalProperties") or {"type": "string"}, path)
    return st.dictionaries(st.text(TEXT, min_size=1, max_size=12), values, max_size=2)


def _object(node: dict[str, Any], path: Path) -> st.SearchStrategy[Any]:
    props = node["properties"]
    required = set(node.get("required") or ())
    return st.fixed_dictionaries(
        {k: from_schema(v, (*path, k)) for k, v in props.items() if k in required},
        optional={k: from_schema(v, (*path, k)) for k, v in props.items() if k not in required},
    )


def _array(node: dict[str, Any], path: Path) -> st.SearchStrategy[Any]:
    low = node.get("minItems", 0)
    items = from_schema(node.get("items") or {"type": "string"}, (*path, 0))
    unique = node.get("x-kubernetes-list-type") == "set"
    return st.lists(items, min_size=low, max_size=max(low, 2), unique=unique)


def repair(spec: dict[str, Any]) -> dict[str, Any]:
    """Satisfy the CRD's cross-field rules (CEL) that a per-field generator cannot see."""
    spec.update(copy.deepcopy(FIXED))
    engine = spec.get("engine")
    if engine is not None:
        engine["kind"] = "llamacpp"  # the fixed model is a GGUF
        if "minBatchSize" in engine or "maxBatchSize" in engine:
            low, high = engine.get("minBatchSize", 4), engine.get("maxBatchSize", 16)
            engine["minBatchSize"], engine["maxBatchSize"] = min(low, high), max(low, high)
        speculation = engine.get("speculation")
        if speculation is not None:
            low, high = speculation.get("ngramMin", 2), speculation.get("ngramMax", 4)
            speculation["ngramMin"], speculation["ngramMax"] = min(low, high), max(low, high)
        engine.pop("draftModel", None)  # it must name a second file of the fixed model
    accelerator = spec.get("accelerator")
    if accelerator is not None and accelerator.get("kind", "cpu") != "cpu":
        accelerator["count"] = max(1, accelerator.get("count", 1))
    gpu = (accelerator or {}).get("kind") == "nvidia-gpu"
    if engine is not None and engine.get("gpuLayers", 0) > 0 and not gpu:
        del engine["gpuLayers"]  # offloading needs a GPU
    thermal = spec.get("thermal")
    if thermal is not None:
        throttle = min(thermal.get("throttleCelsius", 78), 129)
        thermal["throttleCelsius"] = throttle
        thermal["criticalCelsius"] = max(thermal.get("criticalCelsius", 90), throttle + 1)
    for kind, amounts in (spec.get("resources") or {}).items():  # names are CEL-checked
        spec["resources"][kind] = dict(zip(RESOURCES, amounts.values(), strict=False))
    rollout = spec.get("rollout")
    if rollout is not None:
        rollout["waves"] = [_repair_wave(w, i) for i, w in enumerate(rollout["waves"])]
    if "adapters" in spec:
        spec["adapters"] = [_repair_adapter(a, i) for i, a in enumerate(spec["adapters"])]
    scaling = spec.get("scaling")
    if scaling is not None:
        spec.pop("rollout", None)  # the two cannot be combined
        low, high = scaling.get("minReplicas", 0), scaling.get("maxReplicas", 1)
        scaling["minReplicas"], scaling["maxReplicas"] = min(low, high), max(low, high)
    return spec


def _repair_adapter(adapter: dict[str, Any], index: int) -> dict[str, Any]:
    """A unique name other than the model's, a relative path, a digest, and no URL (the fixed
    model's source is a hostPath: a URL is for http sources only)."""
    adapter["name"] = f"a{index}-" + re.sub("[^a-z0-9]", "", adapter["name"].lower())[:50]
    adapter["path"] = f"adapters/a{index}.gguf"
    adapter["sha256"] = f"{index:x}" * 64
    adapter.pop("url", None)
    return adapter


def _repair_wave(wave: dict[str, Any], index: int) -> dict[str, Any]:
    """A DNS-label name, unique in the list, and exactly one way to choose the wave's sites."""
    wave["name"] = f"w{index}-" + re.sub("[^a-z0-9]", "", wave["name"].lower())[:50] + "x"
    orders = [k for k in ORDERS if k in wave]
    for extra in orders[1:]:
        del wave[extra]
    if not orders:
        wave["count"] = 1
    return wave


def valid_specs() -> st.SearchStrategy[dict[str, Any]]:
    schema = spec_schema()
    props = {k: v for k, v in schema["properties"].items() if k not in FIXED}
    return _object({**schema, "properties": props, "required": []}, ()).map(repair)


# ----------------------------------------------------------------------------- mutations


def walk(
    value: Any, node: dict[str, Any], path: Path = ()
) -> Iterator[tuple[Path, Any, dict[str, Any]]]:
    """(path, value, schema) of everything present in a document, root first."""
    yield path, value, node
    if isinstance(value, dict) and "properties" in node:
        for key, child in value.items():
            if key in node["properties"]:
                yield from walk(child, node["properties"][key], (*path, key))
    elif isinstance(value, dict) and isinstance(node.get("additionalProperties"), dict):
        for key, child in value.items():
            yield from walk(child, node["additionalProperties"], (*path, key))
    elif isinstance(value, list) and "items" in node:
        for i, child in enumerate(value):
            yield from walk(child, node["items"], (*path, i))


@dataclass(frozen=True)
class Case:
    spec: dict[str, Any]
    mutation: str
    path: Path  # where it went ((): nowhere)
    field: str  # what the API server's message must name

    @property
    def valid(self) -> bool:
        return self.mutation == "none"


def _wrong_type(node: dict[str, Any]) -> Any:
    kind = node.get("type")
    if kind in ("integer", "number", "boolean", "object", "array"):
        return "x" if kind != "boolean" else "yes"
    return True  # a string (or an int-or-string quantity): a boolean is neither


def _out_of_range(node: dict[str, Any]) -> Any:
    if node.get("exclusiveMinimum"):
        return node["minimum"]  # the bound itself: the one value a plain minimum would allow
    if "maximum" in node:
        return node["maximum"] + 1
    if "minimum" in node:
        return node["minimum"] - 1
    if "maxLength" in node:
        return "a" * (node["maxLength"] + 1)
    if node.get("minLength"):
        return ""
    return None


def candidates(spec: dict[str, Any], mutation: str) -> list[tuple[Path, Any]]:
    """(path, new value) pairs this mutation could make in `spec` (value None: delete)."""
    out: list[tuple[Path, Any]] = []
    for path, value, node in walk(spec, spec_schema()):
        last = path[-1] if path else None
        if mutation == "wrong-type" and path and not isinstance(last, int):
            out.append((path, _wrong_type(node)))
        elif mutation == "out-of-range" and not _is_quantity(node) and path:
            bad = _out_of_range(node)
            if bad is not None:
                out.append((path, bad))
        elif mutation == "unknown-field" and isinstance(value, dict) and "properties" in node:
            out.append(((*path, UNKNOWN), 1))
        elif mutation == "missing-required" and isinstance(value, dict):
            out += [((*path, k), None) for k in node.get("required") or () if k in value]
        elif mutation == "bad-quantity" and _is_quantity(node):
            out += [(path, q) for q in BAD_QUANTITIES]
        elif mutation == "bad-enum" and "enum" in node:
            out.append((path, "no-such-" + str(node["enum"][0])))
    return out


def mutate(spec: dict[str, Any], path: Path, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(spec)
    node: Any = out
    for part in path[:-1]:
        node = node[part]
    if value is None:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return out


@st.composite
def cases(draw: st.DrawFn) -> Case:
    spec = draw(valid_specs())
    mutation = draw(st.sampled_from(MUTATIONS))
    options = candidates(spec, mutation) if mutation != "none" else []
    if not options:
        return Case(spec, "none", (), "")
    path, value = draw(st.sampled_from(options))
    field = next(str(p) for p in reversed(path) if not isinstance(p, int))
    return Case(mutate(spec, path, value), mutation, path, field)
