"""Serving the web view with uvicorn: loopback by default, a token required anywhere else."""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from registry.errors import RegistryError

log = logging.getLogger(__name__)

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})


class UnsafeBindError(RegistryError, PermissionError):
    """An address other machines can reach, asked for without an access token."""


class BindError(RegistryError, OSError):
    """The address cannot be listened on: the port is taken, the address is not this machine's, no permission."""


def is_loopback(host: str) -> bool:
    """True for ``localhost``, 127.0.0.0/8 and ``::1``: addresses only this machine can reach."""
    if host in LOOPBACK_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None) -> None:
    """Refuse to serve the catalog to the network without a token: runs, paths and metrics are not public."""
    if not is_loopback(host) and not token:
        raise UnsafeBindError(f"refusing to bind {host}: it is reachable from other machines; "
                              "pass --token (or set REGISTRY_UI_TOKEN) to require one, or bind 127.0.0.1")


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` (0: any free port), so a taken port fails before anything is printed."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart is not refused for TIME_WAIT
        sock.bind((host, port))
        sock.listen(2048)  # connections wait in the backlog until the server accepts them
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise BindError(f"port {port} on {host} is in use (another registry ui?); "
                            "pick another with --port") from None
        raise BindError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def serve(app: Any, *, sock: socket.socket) -> None:
    """Run ``app`` under uvicorn on the listening ``sock`` (see :func:`listen`) until interrupted."""
    import uvicorn
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    with sock:
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:  # uvicorn shut down cleanly, then re-raised the Ctrl-C it caught
            pass


@contextmanager
def background_server(app: Any, *, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve ``app`` from a thread (tests, screenshots, benchmarks); yields its base URL."""
    import uvicorn
    check_bind(host, None)
    sock = listen(host, port)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="registry-ui")
    thread.start()
    try:
        while not server.started and thread.is_alive():
            thread.join(0.02)
        if not server.started:
            raise RuntimeError("the web view's server did not start")
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


__all__ = ["LOOPBACK_HOSTS", "BindError", "UnsafeBindError", "background_server", "check_bind", "is_loopback",
           "listen", "serve"]
