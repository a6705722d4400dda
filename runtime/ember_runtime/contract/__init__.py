"""The one contract between Ember's processes: the operator, the runtime server, prewarm, the
node agent, the device plugin and the gateway. Every format that crosses from one process to
another is defined here, once.

Every process imports it; it imports nothing of theirs (tests/test_contract.py checks), only
the stdlib, pydantic and PyYAML; the processes import nothing of each other's
(tests/test_import_graph.py checks):

- `config`: the runtime config the operator renders into the ConfigMap and the node side reads.
- `thermal`: the thermal defaults, the policy and its arithmetic, and the `ember.dev/Thermal`
  report (a typed reading, one encoder, one decoder).
- `cache`: the node cache's disk layout and the labels and annotations that name its files.
- `reasons`: every reason a user can see, and the termination message's writer and parser.
- `rollout`: the `ember.dev/Health` report and the Node stage request of fleet rollouts.
- `resource`: the InferenceDeployment's API names and paths, the site label, and the one
  read-only view of the spec fields the gateway and the node agent read.
- `admin`: the runtime's `GET /admin/state` body, which the gateway routes on.
- `errors`: OpenAI's error body, which the runtime and the gateway answer with.
- `manifest`: the prewarm manifest, and which file the runtime loads.
- `download`: the download-progress sentence the node agent and prewarm both write.
- `wire`: the camelCase base model and the YAML dumper they share.
"""
