"""Run a rendered InferenceService's pods as local processes, the way a kubelet would.

``LocalCluster`` renders an InferenceService with the operator's own builders and runs every
pod's containers as processes on this machine: the rendered ``command``/``args`` and ``env``,
ConfigMap and Secret volumes written to a temporary directory, probes polled as the kubelet
polls them, crashed containers restarted with back-off, SIGTERM and the grace period on
termination, ClusterIP Services as local TCP proxies over ready pods that see a deletion late
(as kube-proxy does), rollouts as each Deployment's ``strategy`` says (``rollout.py``). Every
pod shares the loopback address (pod IP 127.0.0.1), so each pod's container ports (and the
engine's loopback numbers, which name its sockets and shared memory) are remapped to free
ports, consistently: in its config files, its flags and its probes, and wherever another pod
names its Service; each pod has its own ``$KETCH_RUN_DIR``.

``run.py`` in this directory runs one by hand; see its ``--help``.
"""

from localpods.cluster import LocalCluster
from localpods.translate import localize

__all__ = ["LocalCluster", "localize"]
