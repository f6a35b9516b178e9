"""`ft serve`'s listening socket, bound before anything is loaded: a port in use or an address
that is not this machine's fails in a moment, not after a model's load."""

from __future__ import annotations

import errno
import socket

from freetoken.errors import FreetokenError


class BindError(FreetokenError):
    """The server's address cannot be bound."""


def bind(host: str, port: int) -> socket.socket:
    """A socket listening on host:port (as uvicorn would bind it), or BindError saying why
    not."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise BindError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            why = "is in use (another ft serve?); stop it or pick another port with --port"
        elif e.errno == errno.EACCES:
            why = "needs privileges this process lacks; pick a port above 1023 with --port"
        elif e.errno == errno.EADDRNOTAVAIL:
            why = "is not an address of this machine; see --host"
        else:
            why = f"cannot be bound ({e.strerror})"
        raise BindError(f"{host}:{port} {why}") from None
    return sock
