"""The node agent: a small kubelet that runs the pods bound to its Node as local processes.

There is no container runtime on the machines this project's local cluster runs on, so instead of
a kubelet talking CRI to containerd, this agent does the runtime's part itself with the kernel's
primitives:

- the pod sandbox is a network namespace with a veth pair into the cluster's bridge
  (``network``), plus a pod directory holding its volumes, resolv.conf and hosts (``volumes``);
- an image is an entry of an image table: which directories of this machine are its PATH, its ENV,
  user, entrypoint and read-only content (``images``);
- a container is a process started by ``launch.py`` in the pod's network namespace and a mount
  namespace of its own, where the volumes are bind-mounted at their mount paths, as its user
  (``runtime``); what its ``env`` and ``command`` resolve to follows the kubelet (``envs``);
- a pod worker thread per pod runs init containers, containers, probes (``probes``), restarts
  with back-off and termination, and reports ``status`` (``status``, ``pod``);
- the Node, its Lease and status heartbeats (``node``); the pod watch and the start/stop sweeps
  (``agent``); the API client (``api``); the command line (``__main__``).

It authenticates as ``system:node:<name>`` and so can only do what a kubelet may (Node
authorizer, NodeRestriction admission). What it does not do at all: cgroups (no resource limits
are enforced), seccomp and AppArmor, user namespaces, image pulls from registries, the kubelet's
HTTP API (no ``kubectl logs``/``exec``/``port-forward``), volume plugins other than emptyDir,
configMap, secret, projected, downwardAPI and hostPath, and static or mirror pods.
"""
