"""A real Kubernetes control plane on this machine, for Ketch's tests and for trying Ketch by hand.

etcd, kube-apiserver, kube-controller-manager and kube-scheduler are the upstream programs, built
from Go modules by ``hack/build-control-plane.sh`` (wrapper modules ``hack/k8s`` and ``hack/etcd``).
What has no runnable upstream form without a container runtime is played by small programs of
our own: the node agent (``nodeagent/``: a kubelet that runs a pod's containers as processes in
the pod's own network namespace) and the service proxy with cluster DNS (``proxy/``: what
kube-proxy and CoreDNS do). ``controlplane.py`` starts and stops them all; ``python -m
localcluster up|down|status`` (``make cluster-up`` / ``make cluster-down``) is the command line.
"""
