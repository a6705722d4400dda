"""The InferenceDeployment API: pydantic models (the source of truth) and the CRD generator."""

GROUP = "ember.dev"
VERSION = "v1alpha1"
KIND = "InferenceDeployment"
PLURAL = "inferencedeployments"
SINGULAR = "inferencedeployment"
SHORT_NAMES = ("infd",)
CATEGORIES = ("ember",)
API_VERSION = f"{GROUP}/{VERSION}"
