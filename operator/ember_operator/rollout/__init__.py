"""Site-by-site rollouts (spec.rollout): the wave planner, the revision, the progress machine.

`waves` and `progress` are pure (no API call, no clock of their own): what the operator observes
goes in, the next rollout status and each site's revision come out. `observe` reads the sites
from the operator's indexes; `reconcile` applies what `progress` decided.
"""
