"""A tiny loopback HTTP proxy in front of a real S3 server, for fault tests.

It forwards each request unchanged (the ``Host`` header too, so SigV4
signatures made for the proxy's address still verify upstream) and lets a
test decide, request by request, to answer ``503 SlowDown`` instead, to run
a hook first (kill the server mid-upload), or to spoil the signature (the
real server then refuses it, as it refuses revoked credentials). Not a mock:
every request that is forwarded is served by the real server.
"""

from __future__ import annotations

import http.client
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")
ACCESS_DENIED = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
                 b"<Message>Access Denied</Message></Error>")


@dataclass(frozen=True, kw_only=True)
class Seen:
    """One request the proxy received."""

    method: str
    path: str
    query: dict[str, str]


@dataclass
class Proxy:
    upstream: str                                   # http://host:port of the real server
    endpoint: str = ""                              # http://127.0.0.1:PORT of the proxy
    seen: list[Seen] = field(default_factory=list)
    slow_down: int = 0                              # answer the next N requests with 503 SlowDown
    before: Callable[[Seen], None] | None = None    # called before forwarding (may kill the server)
    deny: Callable[[Seen], bool] | None = None      # answer 403 AccessDenied where it says so (a bucket policy)
    wrong_signature: bool = False                   # forward with the signature spoilt: the server refuses (403)
    flip_put_bodies: int = 0                        # flip one byte in the body of the next N PUTs (bad wire)
    flip_put_suffix: str = ""                        # flip one byte in the next PUT to a key ending so (once)
    flip_get_suffix: str = ""                        # flip one byte in the next GET answer from a key ending so (once)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, request: Seen) -> bool:
        """Record ``request``; whether to answer it with 503."""
        with self.lock:
            self.seen.append(request)
            if self.slow_down > 0:
                self.slow_down -= 1
                return True
        return False

    def count(self, predicate: Callable[[Seen], bool]) -> int:
        with self.lock:
            return sum(1 for s in self.seen if predicate(s))


def _handler(proxy: Proxy) -> type[BaseHTTPRequestHandler]:
    upstream = urllib.parse.urlsplit(proxy.upstream)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
            pass

        def _answer(self, status: int, error: bytes) -> None:
            """Answer with an S3 error document instead of forwarding."""
            self.send_response(status)
            self.send_header("content-type", "application/xml")
            self.send_header("content-length", str(len(error)))
            self.end_headers()
            self.wfile.write(error)

        def _serve(self) -> None:
            split = urllib.parse.urlsplit(self.path)
            seen = Seen(method=self.command, path=split.path,
                        query=dict(urllib.parse.parse_qsl(split.query, keep_blank_values=True)))
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length) if length else b""
            if proxy.take(seen):
                self._answer(503, SLOW_DOWN)
                return
            if proxy.deny is not None and proxy.deny(seen):
                self._answer(403, ACCESS_DENIED)
                return
            if proxy.before is not None:
                proxy.before(seen)
            if self.command == "PUT" and len(body) > 1:
                with proxy.lock:
                    flip, proxy.flip_put_bodies = proxy.flip_put_bodies > 0, max(0, proxy.flip_put_bodies - 1)
                    if proxy.flip_put_suffix and urllib.parse.urlsplit(self.path).path.endswith(proxy.flip_put_suffix):
                        flip, proxy.flip_put_suffix = True, ""
                if flip:
                    body = body[: len(body) // 2] + bytes([body[len(body) // 2] ^ 0xFF]) + body[len(body) // 2 + 1:]
            headers = {k: v for k, v in self.headers.items()}
            if proxy.wrong_signature:  # credentials revoked or rotated under a running registry
                headers = {k: (v[:-8] + "00000000" if k.lower() == "authorization" else v)
                           for k, v in headers.items()}
            conn = http.client.HTTPConnection(upstream.hostname, upstream.port, timeout=60)
            try:
                conn.request(self.command, self.path, body=body or None, headers=headers)
                response = conn.getresponse()
                data = response.read()
            except OSError:
                self.close_connection = True  # the server is gone: so is this connection
                return
            finally:
                conn.close()
            if self.command == "GET" and response.status in (200, 206) and len(data) > 1:
                with proxy.lock:
                    flip = bool(proxy.flip_get_suffix) and split.path.endswith(proxy.flip_get_suffix)
                    if flip:
                        proxy.flip_get_suffix = ""
                if flip:  # the bytes as received, never as stored
                    data = data[: len(data) // 2] + bytes([data[len(data) // 2] ^ 0xFF]) + data[len(data) // 2 + 1:]
            self.send_response(response.status)
            head = self.command == "HEAD"  # no body: the upstream's content-length is the object's size
            for name, value in response.getheaders():
                lower = name.lower()
                if lower not in ("transfer-encoding", "connection") and (head or lower != "content-length"):
                    self.send_header(name, value)
            if not head:
                self.send_header("content-length", str(len(data)))
            self.end_headers()
            if not head:
                self.wfile.write(data)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _serve  # noqa: N815 - http.server's names

    return Handler


@contextmanager
def running(upstream: str) -> Iterator[Proxy]:
    """A proxy to ``upstream`` on a free loopback port, for the ``with`` block."""
    proxy = Proxy(upstream=upstream)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(proxy))
    server.daemon_threads = True
    proxy.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="s3proxy", daemon=True)
    thread.start()
    try:
        yield proxy
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
