"""The current context of a kubeconfig file: the server's URL, an SSL context with the CA and
the client certificate (inline ``-data`` or files next to the kubeconfig), and a bearer token.
One loader for every client in ``hack/localcluster`` (the node agent, the service proxy, the
cluster's own checks)."""

from __future__ import annotations

import base64
import ssl
import tempfile
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]


class Kubeconfig:
    """The current context of a kubeconfig: server URL and an SSL context with its credentials."""

    def __init__(self, path: Path) -> None:
        doc = yaml.safe_load(Path(path).read_text())
        base = Path(path).parent
        ctx_name = doc.get("current-context") or doc["contexts"][0]["name"]
        ctx = _named(doc, "contexts", ctx_name)["context"]
        cluster = _named(doc, "clusters", ctx["cluster"])["cluster"]
        user = _named(doc, "users", ctx["user"])["user"]
        self.server = cluster["server"].rstrip("/")
        self.ssl = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
        if cluster.get("insecure-skip-tls-verify"):
            self.ssl.check_hostname = False
            self.ssl.verify_mode = ssl.CERT_NONE
        elif "certificate-authority-data" in cluster:
            self.ssl.load_verify_locations(
                cadata=base64.b64decode(cluster["certificate-authority-data"]).decode()
            )
        elif "certificate-authority" in cluster:
            self.ssl.load_verify_locations(cafile=str(base / cluster["certificate-authority"]))
        self.token = user.get("token")
        cert = _material(user, "client-certificate", base)
        key = _material(user, "client-key", base)
        if cert and key:
            # load_cert_chain reads files: data from the kubeconfig goes through a private
            # temporary directory that is gone once loaded.
            with tempfile.TemporaryDirectory(prefix="nodeagent-tls-") as tmp:
                paths = []
                for name, data in (("cert", cert), ("key", key)):
                    p = Path(tmp) / name
                    p.touch(mode=0o600)
                    p.write_bytes(data)
                    paths.append(str(p))
                self.ssl.load_cert_chain(paths[0], paths[1])

    def headers(self, user_agent: str) -> dict[str, str]:
        """JSON and, when the user has a token, the bearer header."""
        out = {"Accept": "application/json", "User-Agent": user_agent}
        if self.token:
            out["Authorization"] = f"Bearer {self.token}"
        return out


def _named(doc: Obj, section: str, name: str) -> Obj:
    for item in doc.get(section) or []:
        if item.get("name") == name:
            return item
    raise ValueError(f"kubeconfig has no {section} entry {name!r}")


def _material(user: Obj, key: str, base: Path) -> bytes | None:
    if f"{key}-data" in user:
        return base64.b64decode(user[f"{key}-data"])
    if key in user:
        return (base / user[key]).read_bytes()
    return None
