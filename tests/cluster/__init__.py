"""A real single-node Kubernetes (plus a kwok fleet) on this machine, for tests and the demo."""
