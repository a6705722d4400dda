"""The node agent: one small process per Ember node (a DaemonSet) that reports the node's own
temperature as an `ember.dev/Thermal` Node condition, on change only, and keeps the models of
`http` sources that its node's pods need in a content-addressed cache (`cache`, `fetcher`).

Why it exists: once a critically hot node is tainted and its replicas are evicted, no runtime is
left there to say it has cooled; the operator releases the taint when this condition says so.
"""
