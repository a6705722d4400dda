"""`make e2e-kind` inside the suite: the whole flow on a two-node kind cluster (tests/e2e/kind.py),
run as its own process so its output shows each step and its time.

Needs a Docker engine or Debian's dockerd (`make test` installs docker.io where neither is
there). Marked `node` as well, so `-m "not cluster and not node"` inner loops leave it out.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.e2e.flow import REPO

pytestmark = [pytest.mark.kind, pytest.mark.node, pytest.mark.timeout(3600)]


def test_the_e2e_flow_passes_on_a_two_node_kind_cluster() -> None:
    if shutil.which("dockerd") is None and shutil.which("docker") is None:
        pytest.skip("needs a Docker engine or dockerd (apt-get install docker.io; make test does)")
    # A session that holds /tmp/ember-cluster.lock (under `flock`) already serializes cluster
    # tests; tests/e2e/kind.py must not wait for that lock from a child process.
    env = {**os.environ, "EMBER_CLUSTER_LOCK_HELD": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.e2e.kind"], cwd=REPO, env=env, check=False)
    assert proc.returncode == 0, "make e2e-kind failed: its steps and the cluster dump are above"
