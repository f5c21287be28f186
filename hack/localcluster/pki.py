"""The cluster's certificates and keys, made with the ``openssl`` command line.

What kubeadm makes for a cluster, reduced to what this one runs:

- ``ca``: signs every serving and client certificate; kube-apiserver's ``--client-ca-file``.
- ``apiserver``: kube-apiserver's serving certificate, valid for 127.0.0.1, the node's address,
  the ``kubernetes`` Service's ClusterIP and DNS names.
- client certificates, one per identity (the subject is what RBAC sees: CN = user, O = groups):
  ``admin`` (system:masters), ``controller-manager``, ``scheduler``, ``node`` (the node agent as
  ``system:node:<name>`` in ``system:nodes``: the Node authorizer's and NodeRestriction's rules
  apply to it), ``service-proxy``.
- ``front-proxy-ca`` and ``front-proxy-client``: the aggregation layer (custom metrics API).
- ``sa``: the service-account token signing key pair.
"""

from __future__ import annotations

import ipaddress
import subprocess
from pathlib import Path

DAYS = "3650"


def _openssl(*args: str, cwd: Path) -> None:
    result = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed: {result.stderr.strip()}")


def _key(pki: Path, name: str) -> None:
    _openssl(
        "genpkey",
        "-algorithm",
        "EC",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-out",
        f"{name}.key",
        cwd=pki,
    )


def make_ca(pki: Path, name: str, common_name: str) -> None:
    _key(pki, name)
    _openssl(
        "req",
        "-x509",
        "-new",
        "-key",
        f"{name}.key",
        "-sha256",
        "-days",
        DAYS,
        "-subj",
        f"/CN={common_name}",
        "-out",
        f"{name}.crt",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
        cwd=pki,
    )


def make_cert(
    pki: Path,
    name: str,
    ca: str,
    common_name: str,
    groups: tuple[str, ...] = (),
    *,
    server_names: tuple[str, ...] = (),
) -> None:
    """``<name>.crt``/``.key`` signed by ``<ca>``: a client certificate (CN, O per group), or a
    serving one when ``server_names`` (IP addresses or DNS names) are given."""
    _key(pki, name)
    subject = "".join(f"/O={g}" for g in groups) + f"/CN={common_name}"
    _openssl("req", "-new", "-key", f"{name}.key", "-subj", subject, "-out", f"{name}.csr", cwd=pki)
    ext = [
        "basicConstraints=critical,CA:FALSE",
        "keyUsage=critical,digitalSignature,keyEncipherment",
    ]
    if server_names:
        alt = []
        for entry in server_names:
            try:
                ipaddress.ip_address(entry)
                alt.append(f"IP:{entry}")
            except ValueError:
                alt.append(f"DNS:{entry}")
        ext += ["extendedKeyUsage=serverAuth,clientAuth", "subjectAltName=" + ",".join(alt)]
    else:
        ext.append("extendedKeyUsage=clientAuth")
    (pki / f"{name}.ext").write_text("\n".join(ext) + "\n")
    _openssl(
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        f"{ca}.crt",
        "-CAkey",
        f"{ca}.key",
        "-CAcreateserial",
        "-days",
        DAYS,
        "-sha256",
        "-extfile",
        f"{name}.ext",
        "-out",
        f"{name}.crt",
        cwd=pki,
    )
    (pki / f"{name}.csr").unlink()
    (pki / f"{name}.ext").unlink()


def make_all(
    pki: Path, *, node_name: str, server_names: tuple[str, ...], node_ip: str = "127.0.0.1"
) -> None:
    """Every certificate and key of one cluster (see the module docstring)."""
    pki.mkdir(parents=True, exist_ok=True)
    pki.chmod(0o700)
    make_ca(pki, "ca", "ketch-local-ca")
    make_cert(pki, "apiserver", "ca", "kube-apiserver", server_names=server_names)
    make_cert(pki, "admin", "ca", "ketch-admin", ("system:masters",))
    make_cert(pki, "controller-manager", "ca", "system:kube-controller-manager")
    make_cert(pki, "scheduler", "ca", "system:kube-scheduler")
    make_cert(pki, "node", "ca", f"system:node:{node_name}", ("system:nodes",))
    make_cert(pki, "service-proxy", "ca", "ketch:service-proxy")
    # the node agent's log endpoint (kubectl logs) and the API server's client for it
    make_cert(pki, "kubelet", "ca", f"system:node:{node_name}", server_names=(node_ip, node_name))
    make_cert(pki, "apiserver-kubelet-client", "ca", "kube-apiserver-kubelet-client")
    make_ca(pki, "front-proxy-ca", "ketch-front-proxy-ca")
    make_cert(pki, "front-proxy-client", "front-proxy-ca", "front-proxy-client")
    _openssl(
        "genpkey",
        "-algorithm",
        "RSA",
        "-pkeyopt",
        "rsa_keygen_bits:2048",
        "-out",
        "sa.key",
        cwd=pki,
    )
    _openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)
