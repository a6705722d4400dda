"""Node-side thermal control: the governor (policy at every sample), the pod/node condition
reporter (on change, coalesced, retried) and the API client it writes with."""
