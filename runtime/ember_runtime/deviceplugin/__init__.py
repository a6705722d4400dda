"""Ember's NPU device plugin for the kubelet (device plugin API v1beta1).

Every allocation gets its own ACL context ID, never handed to two live containers, kept across
plugin and kubelet restarts. The split follows NVIDIA's k8s-device-plugin: `discovery` finds the
device nodes, `health` turns them into a health stream, `allocator` issues context IDs (with its
checkpoint), `server` serves the gRPC API and registers, `watch` notices kubelet restarts,
`podresources` releases IDs of containers that are gone, and `plugin` wires them together.
"""
