"""What every contract model shares: camelCase on the wire, frozen, unknown fields refused."""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

# libyaml's emitter when PyYAML has it (its wheels do). Its output is the pure-Python
# SafeDumper's, byte for byte, for the plain data dumped here (tests/operator/test_render.py
# compares them), so digests and the pod template's hash do not move; it is 5x faster, and
# the operator dumps four documents per InferenceDeployment it renders.
_YAML_DUMPER = yaml.CSafeDumper if yaml.__with_libyaml__ else yaml.SafeDumper


def dump_yaml(data: Any, *, sort_keys: bool) -> str:
    """`yaml.safe_dump`, through libyaml where available."""
    return str(yaml.dump(data, Dumper=_YAML_DUMPER, sort_keys=sort_keys))


class Wire(BaseModel):
    """camelCase on the wire (like every Kubernetes object), snake_case in Python."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )
