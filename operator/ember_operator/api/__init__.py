"""The InferenceDeployment API: pydantic models (the source of truth) and the CRD generator.

Its group, version, kind and plural are the contract's (`contract.resource`): the gateway and
the node agent read the objects at the same paths."""

from ember_runtime.contract.resource import API_VERSION, GROUP, KIND, PLURAL, VERSION

SINGULAR = "inferencedeployment"
SHORT_NAMES = ("infd",)
CATEGORIES = ("ember",)

__all__ = [
    "API_VERSION",
    "CATEGORIES",
    "GROUP",
    "KIND",
    "PLURAL",
    "SHORT_NAMES",
    "SINGULAR",
    "VERSION",
]
