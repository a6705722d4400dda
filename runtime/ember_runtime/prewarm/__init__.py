"""Prewarm init container and node preflight (`python -m ember_runtime.prewarm`).

The runtime finds the copy to load with `contract.manifest.resolve_model_path(config)`.
"""
