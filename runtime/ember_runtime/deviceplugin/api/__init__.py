"""Kubelet gRPC APIs: the `.proto` files written from the published APIs, and stubs generated
from them at build time by `python -m ember_runtime.deviceplugin.api.generate` (`make protos`)."""
