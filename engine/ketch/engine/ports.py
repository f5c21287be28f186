"""What a ``ketch`` process listens on, as its subcommand's ``listening_ports`` reports it.

Each CLI module (``serve``, ``cache-manager``, ``router``) has a ``listening_ports(args,
file_values)`` next to its parser that builds the real config dataclasses (so a bad value raises
the ValueError ``ketch`` would print) and returns ``{port number: Listener}``. A ``Listener`` *is*
the flag that sets the port (``Listener("--port", ...) == "--port"``), and also says where it
binds and which HTTP paths it serves, for checks such as ``ketch-operator check-wiring``.

Only config-level imports here: the operator (no paddle in its image) imports this.
"""

from __future__ import annotations

import socket

LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")


class Listener(str):
    """A listening port's flag (the ``str`` value), bind address and HTTP paths (none: not HTTP)."""

    host: str
    http_paths: tuple[str, ...]

    def __new__(cls, flag: str, host: str, http_paths: tuple[str, ...] = ()) -> Listener:
        self = super().__new__(cls, flag)
        self.host = host
        self.http_paths = tuple(http_paths)
        return self

    @property
    def flag(self) -> str:
        return str(self)

    @property
    def config_key(self) -> str:
        """The config-file key setting this port: ``--kv-transfer-port`` -> ``kv_transfer_port``."""
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def loopback(self) -> bool:
        """Bound to loopback only: nothing outside the pod can reach it (nor probe it)."""
        return self.host in LOOPBACK_HOSTS or self.host.startswith("127.")

    @property
    def http(self) -> bool:
        return bool(self.http_paths)

    def describe(self) -> str:
        """``--kv-transfer-port (config key kv_transfer_port) on 0.0.0.0``."""
        kind = ", HTTP" if self.http else ""
        return f"{self.flag} (config key {self.config_key}) on {self.host}{kind}"

    def __reduce__(self) -> tuple:  # pickle/copy keep host and paths
        return (Listener, (self.flag, self.host, self.http_paths))


def check_free(listeners: dict[int, Listener]) -> None:
    """Fails fast, naming the flag, if a port the process is about to listen on is taken."""
    for port, listener in listeners.items():
        family = socket.AF_INET6 if ":" in listener.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((listener.host, port))
            except OSError as exc:
                raise ValueError(
                    f"{listener.flag} {port} on {listener.host} is not free: {exc.strerror}"
                ) from exc
