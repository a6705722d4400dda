"""Prewarm init container and node preflight (`python -m ember_runtime.prewarm`).

The runtime finds the copy to load with `manifest.resolve_model_path(config)`.
"""

from ember_runtime.prewarm.manifest import resolve_model_path

__all__ = ["resolve_model_path"]
