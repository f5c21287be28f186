"""Service proxy and cluster DNS of the local cluster, one process: ``-m localcluster.proxy``.

A real cluster runs kube-proxy (which programs iptables/nftables/IPVS so that packets to a
ClusterIP are DNAT'ed to a pod) and CoreDNS (a Deployment behind the ``kube-dns`` Service).
This machine has neither a container runtime nor iptables, so this process does both jobs the
old way: it owns every ClusterIP on a dummy interface and terminates connections to them in
user space, splicing each to an endpoint (``proxy``); and it answers the ``cluster.local``
zone itself on ``layout.dns_ip`` (``dns``). It reads Services and EndpointSlices with a
list+watch of its own (``kubeapi``), needing only list and watch on those two resources.

Modules: ``kubeapi`` (kubeconfig, informer), ``model`` (the objects, endpoint selection),
``proxy`` (interface, listeners, forwarding), ``dns`` (codec, zone, servers), ``__main__``.
"""
