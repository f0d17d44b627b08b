"""The listening sockets of `serve`, `node` and `coordinator`, bound before the model loads.

A busy port then fails at start in one line (``PortInUseError``, a ValueError the CLI prints)
instead of after minutes of loading weights. The socket is bound but not listening: while the
model loads, connections are refused (not queued), and the port cannot be taken by another
process. ``web.SockSite`` starts listening on it.
"""

from __future__ import annotations

import socket


class PortInUseError(ValueError):
    """The address cannot be bound (in use, not ours, no such interface)."""


def advertised_host(host: str) -> str:
    """The host others reach a listener bound to ``host`` at: the machine's hostname for the
    wildcard addresses, else ``host``."""
    return socket.gethostname() if host in ("0.0.0.0", "::", "") else host


def bind(host: str, port: int, section: str, prefix: str = "") -> socket.socket:
    """A TCP socket bound to ``host:port`` (the ``[section]`` keys ``<prefix>host`` and
    ``<prefix>port``), not yet listening, with the options asyncio's servers set (SO_REUSEADDR;
    IPV6_V6ONLY for an IPv6 address)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise PortInUseError(_message(host, port, f"{section}.{prefix}", e)) from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise PortInUseError(_message(host, port, f"{section}.{prefix}", e)) from None
    return sock


def _message(host: str, port: int, keys: str, error: OSError) -> str:
    reason = error.strerror or str(error)
    return f"cannot listen on {host}:{port} ({keys}host, {keys}port): {reason}"
