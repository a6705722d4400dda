"""The thermal loop: policy (pure), replica poller (HTTP), node actions (Kubernetes API)."""
