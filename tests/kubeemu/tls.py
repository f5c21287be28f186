"""The emulator's TLS listener: a second port, served over HTTPS with a throwaway certificate.

Why: kubectl (client-go) sends a kubeconfig's credentials to https servers only, so the
identities RBAC checks need TLS. The kubeconfigs `start_emulator` writes point here. The plain
HTTP port stays for the tests' own helpers and treats a request without credentials as the
admin (like kube-apiserver's old insecure port); on this port such a request is
`system:anonymous`. The certificate is self-signed by `openssl` (the kubeconfigs skip
verification); without an openssl binary there is no TLS port.
"""

from __future__ import annotations

import shutil
import ssl
import subprocess
from pathlib import Path

from aiohttp import web


def self_signed_context(directory: Path) -> ssl.SSLContext | None:
    """A server context with a new certificate for 127.0.0.1/localhost, or None (no openssl)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        return None
    cert, key = directory / "kubeemu-tls.crt", directory / "kubeemu-tls.key"
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "7",
            "-subj",
            "/CN=kubeemu",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    return context


async def start_site(runner: web.AppRunner, host: str, directory: Path) -> str | None:
    """Serve `runner` over TLS on a free port; its https URL, or None."""
    context = self_signed_context(directory)
    if context is None:
        return None
    site = web.TCPSite(runner, host, 0, ssl_context=context)
    await site.start()
    server = getattr(site, "_server", None)
    sockets = getattr(server, "sockets", None) or []
    if not sockets:
        return None
    return f"https://{host}:{sockets[0].getsockname()[1]}"
