"""The operator's side of thermal control: it decides nothing per sample. Runtimes govern their
own batch (ember_runtime.thermal) and report `ember.dev/Thermal` conditions; the operator folds
them into status (ember_operator.status_writer) and vacates nodes that stay critical (`nodes`,
`actions`)."""
