"""The one contract between the operator and the node side (runtime, prewarm, node agent).

Both sides import it; it imports nothing of theirs (tests/test_contract.py checks), only the
stdlib, pydantic, PyYAML and `ember_runtime.memory` (the one sizing rule, pure):

- `config`: the runtime config the operator renders into the ConfigMap and the node side reads.
- `thermal`: the thermal defaults, the policy and its arithmetic, and the `ember.dev/Thermal`
  report (a typed reading, one encoder, one decoder).
- `cache`: the node cache's disk layout and the labels and annotations that name its files.
- `reasons`: every reason a user can see, and the termination message's writer and parser.
- `wire`: the camelCase base model and the YAML dumper they share.
"""
