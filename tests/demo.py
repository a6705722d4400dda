"""`make demo`: Ember's main job on its embedded default.

A local real cluster (built from source), Ember installed with Helm and its site gateway, the
Gemma 3 270M model served by an InferenceDeployment, and one streamed completion through the
gateway's one URL (the base URL an OpenAI client uses for every model of the site).
The cluster, the gateway and the deployment stay up afterwards; the last lines say how to look
around.
"""

from __future__ import annotations

import sys

from tests.cluster.cluster import Cluster
from tests.e2e.flow import SYSTEM_NS, Gateway, step, timed
from tests.e2e.local import local_flow

NAMESPACE = "default"
NAME = "gemma"
MODEL = "gemma-3-270m"  # the manifest's model.name: what a request's `model` names


def main() -> int:
    cluster = Cluster()
    with timed("local cluster (control plane + kubelet node)"):
        cluster.up()
    flow = local_flow(cluster)
    # A fresh InferenceDeployment each run: a leftover from an interrupted run (a pod stuck
    # mid-rollout on this 2-CPU node) must not block the new one, nor keep the restarted
    # gateway unready (a model it knows with no replica that answers). Before the first
    # install there is no such resource type: nothing to delete.
    flow.run_kubectl(
        "delete", "infd", NAME, "-n", NAMESPACE, "--ignore-not-found", "--wait", check=False
    )
    gateway = Gateway(NAMESPACE)
    flow.install(gateway=gateway)
    flow.apply(flow.model_manifest(NAME, NAMESPACE))
    flow.wait_ready(NAME, NAMESPACE)
    print(flow.run_kubectl("get", "infd", "-n", NAMESPACE), file=sys.stderr)
    # The packaged model is the *pretrained* Gemma 3 270M (no chat tuning, no chat template in
    # the GGUF): it continues text well and answers chat turns poorly, so the demo completes.
    prompt = "The capital of France is"
    with flow.port_forward(gateway.service, SYSTEM_NS, 8080) as port:
        flow.wait_gateway(port, MODEL)
        step(f"streamed completion through svc/{gateway.service} (model {MODEL}): {prompt!r}")
        print(prompt, end="", flush=True)
        flow.complete(port, prompt, lambda tok: print(tok, end="", flush=True))
    print("\n", flush=True)
    env = cluster.env()
    step("Ember is running. Look around with:")
    print(f"    export KUBECONFIG={env['KUBECONFIG']} PATH={env['PATH'].split(':')[0]}:$PATH")
    print(f"    kubectl get infd {NAME} && kubectl describe infd {NAME}")
    print(f"    kubectl -n {SYSTEM_NS} port-forward svc/{gateway.service} 8080:8080 &")
    print("    export OPENAI_BASE_URL=http://127.0.0.1:8080/v1   # every model of the site")
    print("    make cluster-down   # when done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
