"""Ember operator: reconciles InferenceDeployments into serving workloads."""
