"""`make demo`: Ember's main job on its embedded default.

A local real cluster (built from source), Ember installed with Helm, the Gemma 3 270M model
served by an InferenceDeployment, and one streamed chat completion through its Service.
The cluster and the deployment stay up afterwards; the last lines say how to look around.
"""

from __future__ import annotations

import sys

from tests.cluster.cluster import Cluster
from tests.e2e.flow import step, timed
from tests.e2e.local import local_flow

NAMESPACE = "default"
NAME = "gemma"


def main() -> int:
    cluster = Cluster()
    with timed("local cluster (control plane + kubelet node)"):
        cluster.up()
    flow = local_flow(cluster)
    flow.install()
    # A fresh InferenceDeployment each run: a leftover from an interrupted run (a pod stuck
    # mid-rollout on this 2-CPU node) must not block the new one.
    flow.run_kubectl("delete", "infd", NAME, "-n", NAMESPACE, "--ignore-not-found", "--wait")
    flow.apply(flow.model_manifest(NAME, NAMESPACE))
    flow.wait_ready(NAME, NAMESPACE)
    print(flow.run_kubectl("get", "infd", "-n", NAMESPACE), file=sys.stderr)
    # The packaged model is the *pretrained* Gemma 3 270M (no chat tuning, no chat template in
    # the GGUF): it continues text well and answers chat turns poorly, so the demo completes.
    prompt = "The capital of France is"
    step(f"streamed completion through svc/{NAME}: {prompt!r}")
    with flow.port_forward(NAME, NAMESPACE, 8080) as port:
        print(prompt, end="", flush=True)
        flow.complete(port, prompt, lambda tok: print(tok, end="", flush=True))
    print("\n", flush=True)
    env = cluster.env()
    step("Ember is running. Look around with:")
    print(f"    export KUBECONFIG={env['KUBECONFIG']} PATH={env['PATH'].split(':')[0]}:$PATH")
    print(f"    kubectl get infd {NAME} && kubectl describe infd {NAME}")
    print("    make cluster-down   # when done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
