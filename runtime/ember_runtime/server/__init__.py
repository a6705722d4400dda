"""Ember's inference sidecar: OpenAI-compatible HTTP over a batching engine."""
