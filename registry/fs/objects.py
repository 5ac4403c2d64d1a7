"""An ``s3://BUCKET/PREFIX`` checkpoint root: its location, its client, and the few requests everything uses.

Every other module reaches the object store through :class:`ObjectRoot`, and
every failure of a request leaves it through :func:`storage_error`: the
server's trouble (down, overloaded, wrong credentials, no such bucket) as a
one-line :class:`~registry.errors.StorageError`, never as corruption; a
missing object as :class:`~registry.errors.ObjectNotFoundError`, so that a
caller decides whether that is a missing payload; an existing key refused by
a create-only put as :class:`~registry.errors.ObjectExistsError`.

Credentials come from the standard AWS environment or from
``storage_options`` (obstore's S3 configuration keys); they live only in
:class:`ObjectConfig`, whose repr hides them, and never in a URL, a log line
or an error message. Keys are relative to the root's prefix. Knows no SQL.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from registry.errors import (ObjectExistsError, ObjectNotFoundError, RegistryError, RootError, StorageError,
                             install_hint)
from registry.format.layout import REGISTRY_DIR, ROOT_MARKER

if TYPE_CHECKING:
    from obstore.store import S3Store
    from typing_extensions import Buffer

SCHEME = "s3://"
NO_BUCKET = ("the bucket does not exist on the server; the registry never creates one: make it with your "
             "storage's own tool (e.g. 'aws s3 mb s3://BUCKET' or 'mc mb ALIAS/BUCKET'; see docs/guide/s3.md)")
PART_SIZE = 8 << 20  # multipart part size; S3 wants at least 5 MiB for every part but the last
UPLOAD_CONCURRENCY = 8  # parts of one object in flight at once
MARKER = f"{REGISTRY_DIR}/{ROOT_MARKER}"

_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_SEGMENT_RE = re.compile(r"[A-Za-z0-9!_.*'()=+,;~-][A-Za-z0-9!_.*'()=+,;~ -]*")


def is_object_url(text: object) -> bool:
    """Whether ``text`` names an object-store root (``s3://...``) rather than a directory."""
    return isinstance(text, str) and text.startswith(SCHEME)


@dataclass(frozen=True)
class ObjectLocation:
    """``s3://bucket/prefix``: the bucket and the key prefix (no leading or trailing slash; may be empty)."""

    bucket: str
    prefix: str = ""

    @classmethod
    def parse(cls, url: str) -> ObjectLocation:
        """Check and normalise an ``s3://BUCKET[/PREFIX]`` URL; a one-line ``RootError`` says what is wrong."""
        if not is_object_url(url):
            raise RootError(f"not an s3:// URL: {url!r}")
        rest = url[len(SCHEME):].rstrip("/")
        bucket, _, prefix = rest.partition("/")
        if "@" in bucket or ":" in bucket:
            raise RootError("an s3:// root never carries credentials or a port: put credentials in the AWS "
                            "environment or storage_options, and the endpoint in AWS_ENDPOINT_URL")
        if not _BUCKET_RE.fullmatch(bucket) or ".." in bucket:
            raise RootError(f"s3:// root {url!r}: {bucket!r} is not a bucket name (3-63 lowercase letters, "
                            "digits, dots and hyphens)")
        if any(c in rest for c in "?#\\"):
            raise RootError(f"s3:// root {url!r}: a root is a bucket and a key prefix, without '?', '#' or '\\'")
        segments = prefix.split("/") if prefix else []
        for segment in segments:
            if segment in ("", ".", "..") or not _SEGMENT_RE.fullmatch(segment):
                raise RootError(f"s3:// root {url!r}: prefix segment {segment!r} is not allowed (no empty, '.' "
                                "or '..' segments; letters, digits and -_.!*'()=+,;~ only)")
        return cls(bucket=bucket, prefix="/".join(segments))

    def key(self, rel: str = "") -> str:
        """The full key of ``rel`` (a key relative to the root) in the bucket."""
        return "/".join(p for p in (self.prefix, rel.strip("/")) if p)

    def url(self, rel: str = "") -> str:
        """``s3://bucket/prefix/rel``: the root itself for ``rel=""``. Never holds credentials."""
        key = self.key(rel)
        return f"{SCHEME}{self.bucket}/{key}" if key else f"{SCHEME}{self.bucket}"

    def __str__(self) -> str:
        return self.url()


_ENV = {  # our record's fields -> the standard AWS environment variables, first found wins
    "access_key_id": ("AWS_ACCESS_KEY_ID",),
    "secret_access_key": ("AWS_SECRET_ACCESS_KEY",),
    "session_token": ("AWS_SESSION_TOKEN",),
    "region": ("AWS_REGION", "AWS_DEFAULT_REGION"),
    "endpoint": ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"),
    "allow_http": ("AWS_ALLOW_HTTP",),
}
_ALIASES = {"token": "session_token", "aws_session_token": "session_token", "aws_access_key_id": "access_key_id",
            "aws_secret_access_key": "secret_access_key", "aws_region": "region", "aws_endpoint": "endpoint",
            "aws_endpoint_url": "endpoint", "endpoint_url": "endpoint", "aws_allow_http": "allow_http"}
_SECRET_FIELDS = ("secret_access_key", "session_token")


def _truthy(value: object) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True, kw_only=True, repr=False)
class ObjectConfig:
    """How to reach the root's bucket: endpoint, region and credentials. The repr shows no credential.

    ``max_retries`` and ``retry_timeout`` (seconds) bound obstore's retries
    with backoff of what S3 says to retry (5xx, SlowDown, a dropped
    connection), so a server that is down answers in seconds, not minutes;
    ``storage_options`` may set both.

    ``checksum`` sends every PUT and multipart part with the sha256 of its
    body (``x-amz-checksum-sha256``), which the server checks before it
    stores anything: a byte changed on the wire is a refused request, not a
    published object that differs from the manifest (a server need not check
    the signed payload hash, and SeaweedFS does not). ``storage_options``
    ``{"checksum_algorithm": "none"}`` turns it off for a server that rejects
    the header.
    """

    bucket: str
    endpoint: str | None = None
    region: str = "us-east-1"
    access_key_id: str | None = None
    secret_access_key: str | None = None
    session_token: str | None = None
    allow_http: bool = False
    max_retries: int = 3
    retry_timeout: float = 15.0
    checksum: bool = True
    options: tuple[tuple[str, str], ...] = field(default=())  # other obstore config keys, passed through

    @property
    def endpoint_url(self) -> str:
        """The endpoint requests go to: the configured one, else AWS's for the region (virtual-host style aside)."""
        return (self.endpoint or f"https://s3.{self.region}.amazonaws.com").rstrip("/")

    @classmethod
    def resolve(cls, bucket: str, storage_options: Mapping[str, Any] | None = None, *,
                environ: Mapping[str, str] | None = None) -> ObjectConfig:
        """The environment's settings, overridden by ``storage_options``; a bad option is a one-line error."""
        env = os.environ if environ is None else environ
        found: dict[str, Any] = {}
        for name, variables in _ENV.items():
            value = next((env[v] for v in variables if env.get(v)), None)
            if value is not None:
                found[name] = value
        passthrough: dict[str, str] = {}
        for raw_key, value in (storage_options or {}).items():
            if not isinstance(raw_key, str):
                raise RootError(f"storage_options keys are strings, got {type(raw_key).__name__}")
            key = _ALIASES.get(raw_key.lower(), raw_key.lower())
            if key in _ENV or key in ("max_retries", "retry_timeout", "checksum_algorithm"):
                found[key] = value
            elif key == "bucket":
                raise RootError("storage_options cannot name the bucket: it is the s3:// root's")
            else:
                passthrough[key] = str(value)
        try:
            retries = int(found.pop("max_retries", cls.max_retries))
            timeout = float(found.pop("retry_timeout", cls.retry_timeout))
        except (TypeError, ValueError):
            raise RootError("storage_options max_retries must be an integer and retry_timeout seconds") from None
        if retries < 0 or not timeout > 0:
            raise RootError("storage_options max_retries must be >= 0 and retry_timeout > 0")
        algorithm = str(found.pop("checksum_algorithm", "sha256")).strip().lower()
        if algorithm not in ("sha256", "none"):
            raise RootError(f"storage_options checksum_algorithm must be 'sha256' or 'none', got {algorithm!r}")
        allow_http = _truthy(found.pop("allow_http", False))
        strings = {k: str(v) for k, v in found.items() if v is not None and str(v) != ""}
        return cls(bucket=bucket, allow_http=allow_http, max_retries=retries, retry_timeout=timeout,
                   checksum=algorithm == "sha256", options=tuple(sorted(passthrough.items())), **strings)

    def store_config(self) -> dict[str, Any]:
        """The obstore S3 configuration (credentials included: hand it only to obstore)."""
        config: dict[str, Any] = dict(self.options)
        config.update({"region": self.region, "allow_http": "true" if self.allow_http else "false"})
        if self.checksum:
            config["checksum_algorithm"] = "sha256"
        for name in ("endpoint", "access_key_id", "secret_access_key", "session_token"):
            value = getattr(self, name)
            if value is not None:
                config[name] = value
        return config

    def secrets(self) -> tuple[str, ...]:
        """Every credential value, to be scrubbed from any text that leaves the process."""
        values = [getattr(self, name) for name in _SECRET_FIELDS] + [self.access_key_id]
        values += [v for k, v in self.options if any(w in k for w in ("secret", "token", "key", "password"))]
        return tuple(v for v in values if v and len(v) >= 4)

    def __repr__(self) -> str:
        creds = "set" if self.access_key_id or self.secret_access_key else "from the environment chain"
        return (f"ObjectConfig(bucket={self.bucket!r}, endpoint={self.endpoint!r}, region={self.region!r}, "
                f"credentials={creds}, allow_http={self.allow_http})")


@dataclass(frozen=True, kw_only=True)
class ObjectEntry:
    """One listed object: its key relative to the root, its size and when it was last written."""

    rel: str
    size: int
    last_modified: datetime | None = None
    e_tag: str | None = None


def _scrub(text: str, secrets: Iterable[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


def storage_error(exc: BaseException, *, url: str, action: str,
                  secrets: Sequence[str] = ()) -> RegistryError:
    """The one translation of an obstore failure into the registry's errors (see the module's docstring).

    ``action`` says what was asked ("upload", "read", ...); the message is one
    line, names ``url`` and carries no credential.
    """
    from obstore import exceptions as ox

    text = str(exc)
    code_match = re.search(r"<Code>([^<]{1,64})</Code>", text)
    status_match = re.search(r"status code: (\d{3})", text)
    code = code_match.group(1) if code_match else ""
    status = int(status_match.group(1)) if status_match else 0
    if code == "NoSuchBucket":
        return StorageError(f"cannot {action} {url}: {NO_BUCKET}", url=url)
    if isinstance(exc, (ox.NotFoundError, FileNotFoundError)) or code == "NoSuchKey" or status == 404:
        return ObjectNotFoundError(f"cannot {action} {url}: no such object", url=url)
    if (isinstance(exc, (ox.AlreadyExistsError, ox.PreconditionError, FileExistsError))
            or status == 412 or code == "PreconditionFailed"):
        return ObjectExistsError(f"cannot {action} {url}: the key already exists", url=url)
    if (isinstance(exc, (ox.PermissionDeniedError, ox.UnauthenticatedError, PermissionError))
            or status in (401, 403) or code in _DENIED):
        why = f" ({code})" if code else ""
        return StorageError(f"cannot {action} {url}: access denied by the server{why}; check the credentials "
                            "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or storage_options)", url=url)
    if status:
        return StorageError(f"cannot {action} {url}: the server answered {status} {code}".rstrip()
                            + " after retries", url=url)
    first = _scrub(text.strip().splitlines()[0] if text.strip() else type(exc).__name__, secrets)
    if "error sending request" in text or "Connection refused" in text or "timed out" in text.lower():
        first = "the server did not answer (down or unreachable?) after retries"
    elif len(first) > 200:
        first = first[:200] + "..."
    return StorageError(f"cannot {action} {url}: {first}", url=url)


_DENIED = ("AccessDenied", "SignatureDoesNotMatch", "InvalidAccessKeyId", "ExpiredToken", "InvalidToken")


class ObjectRoot:
    """A checkpoint root in a bucket: the client and the requests the publish, load, gc and fsck paths make.

    Keys (``rel``) are relative to the root's prefix. Each method raises only
    the errors :func:`storage_error` makes.
    """

    def __init__(self, location: ObjectLocation, config: ObjectConfig) -> None:
        try:
            from obstore.store import S3Store
        except ImportError:
            raise RootError(f"an s3:// root needs obstore: {install_hint('s3')}") from None
        self.location = location
        self.config = config
        try:
            self.store: S3Store = S3Store(
                location.bucket, prefix=location.prefix or None, config=config.store_config(),  # type: ignore[arg-type]
                client_options={"connect_timeout": timedelta(seconds=5), "timeout": timedelta(seconds=120)},
                retry_config={"max_retries": config.max_retries,
                              "retry_timeout": timedelta(seconds=config.retry_timeout),
                              "backoff": {"init_backoff": timedelta(milliseconds=100),
                                          "max_backoff": timedelta(seconds=2), "base": 2}})
        except Exception as exc:  # noqa: BLE001 - obstore's configuration errors: one line, no credential
            raise RootError(f"cannot configure s3:// root {location}: "
                            f"{_scrub(str(exc).splitlines()[0] if str(exc) else type(exc).__name__, config.secrets())}"
                            ) from None

    @classmethod
    def open(cls, url: str, storage_options: Mapping[str, Any] | None = None, *,
             check: bool = True) -> ObjectRoot:
        """The root at ``url``, configured from the environment and ``storage_options``.

        ``check`` makes one LIST request, so a missing bucket, wrong
        credentials or a server that does not answer fail here, in one line.
        """
        location = ObjectLocation.parse(url)
        root = cls(location, ObjectConfig.resolve(location.bucket, storage_options))
        if check:
            root.check_bucket()
        return root

    # ------------------------------------------------------------------ names

    def url(self, rel: str = "") -> str:
        return self.location.url(rel)

    def key(self, rel: str = "") -> str:
        return self.location.key(rel)

    def __repr__(self) -> str:
        return f"ObjectRoot({self.url()!r})"

    def error(self, exc: BaseException, rel: str, action: str) -> RegistryError:
        return storage_error(exc, url=self.url(rel), action=action, secrets=self.config.secrets())

    # ------------------------------------------------------------------ requests

    def check_bucket(self) -> None:
        """One LIST of the root: a missing bucket (which HEAD and GET report as a missing key) fails here."""
        import obstore
        try:
            stream = obstore.list(self.store, MARKER, chunk_size=1)
            next(iter(stream), None)
        except Exception as exc:  # noqa: BLE001 - translated
            err = self.error(exc, "", "open")
            if isinstance(err, ObjectNotFoundError):
                err = StorageError(f"cannot open {self.url()}: {NO_BUCKET}", url=self.url())
            raise err from None

    def put(self, rel: str, data: bytes | Buffer, *, create_only: bool = True) -> None:
        """One PUT of a small object; ``create_only`` sends ``If-None-Match: *`` (an existing key is refused)."""
        import obstore
        try:
            obstore.put(self.store, rel, data, mode="create" if create_only else "overwrite", use_multipart=False)
        except Exception as exc:  # noqa: BLE001 - translated
            raise self.error(exc, rel, "upload") from None

    def upload(self, rel: str, data: bytes | Buffer) -> None:
        """A large buffer as a parallel multipart upload (never create-only: S3 has no such multipart mode).

        Callers upload only to keys no other writer can use (a fresh attempt prefix).
        """
        import obstore
        try:
            obstore.put(self.store, rel, data, use_multipart=True, chunk_size=PART_SIZE,
                        max_concurrency=UPLOAD_CONCURRENCY)
        except Exception as exc:  # noqa: BLE001 - translated
            raise self.error(exc, rel, "upload") from None

    def writer(self, rel: str) -> ObjectWriter:
        """A write-only file that uploads as it is written (multipart once past one part); see :class:`ObjectWriter`."""
        import obstore
        try:
            out = obstore.open_writer(self.store, rel, buffer_size=PART_SIZE, max_concurrency=UPLOAD_CONCURRENCY)
        except Exception as exc:  # noqa: BLE001 - translated
            raise self.error(exc, rel, "upload") from None
        return ObjectWriter(self, rel, out)

    def get(self, rel: str) -> memoryview:
        """The whole object, in memory."""
        import obstore
        try:
            return memoryview(obstore.get(self.store, rel).bytes())
        except Exception as exc:  # noqa: BLE001 - translated
            raise self.error(exc, rel, "read") from None

    def chunks(self, rel: str, size: int) -> Iterator[memoryview]:
        """The object in order, ``size`` bytes or more at a time (the last less): one GET, streamed."""
        import obstore
        try:
            for block in obstore.get(self.store, rel).stream(min_chunk_size=size):
                yield memoryview(block)
        except Exception as exc:  # noqa: BLE001 - translated
            raise self.error(exc, rel, "read") from None

    def get_ranges(self, rel: str, starts: Sequence[int], ends: Sequence[int]) -> list[memoryview]:
        """Byte ranges ``[start, end)`` of one object, fetched concurrently."""
        import obstore
        if not starts:
            return []
        try:
            return [memoryview(b) for b in obstore.get_ranges(self.store, rel, starts=list(starts), ends=list(ends))]
        except Exception as exc:  # noqa: BLE001 - translated
            raise self.error(exc, rel, "read") from None

    def head(self, rel: str) -> ObjectEntry | None:
        """The object's size and date, or None where there is no such object."""
        import obstore
        try:
            meta = obstore.head(self.store, rel)
        except Exception as exc:  # noqa: BLE001 - translated
            err = self.error(exc, rel, "inspect")
            if isinstance(err, ObjectNotFoundError):
                return None
            raise err from None
        return ObjectEntry(rel=rel, size=int(meta["size"]), last_modified=meta.get("last_modified"),
                           e_tag=meta.get("e_tag"))

    def list(self, rel_prefix: str = "") -> list[ObjectEntry]:
        """Every object under ``rel_prefix`` (a whole path segment, recursive). For fsck and gc, never to find steps."""
        import obstore
        prefix = rel_prefix.strip("/")
        try:
            entries = [ObjectEntry(rel=m["path"], size=int(m["size"]), last_modified=m.get("last_modified"),
                                   e_tag=m.get("e_tag"))
                       for chunk in obstore.list(self.store, prefix or None, chunk_size=1000) for m in chunk]
        except Exception as exc:  # noqa: BLE001 - translated
            raise self.error(exc, prefix, "list") from None
        return sorted(entries, key=lambda e: e.rel)

    def delete(self, rels: Iterable[str]) -> None:
        """Delete these keys (a missing one is no error), in batches of at most 1000."""
        import obstore
        keys = list(rels)
        for start in range(0, len(keys), 1000):
            batch = keys[start:start + 1000]
            try:
                obstore.delete(self.store, batch)
            except Exception as exc:  # noqa: BLE001 - translated
                err = self.error(exc, batch[0], "delete")
                if not isinstance(err, ObjectNotFoundError):
                    raise err from None

    # ------------------------------------------------------------------ the root marker

    def read_marker(self) -> str | None:
        """The id of the catalog this root is bound to, or None for a root not bound yet (as ``Store.read_marker``)."""
        try:
            raw = bytes(self.get(MARKER))
        except ObjectNotFoundError:
            return None
        try:
            catalog_id = json.loads(raw)["catalog_id"]
        except (ValueError, TypeError, KeyError):
            catalog_id = None
        if not isinstance(catalog_id, str) or not catalog_id:
            raise RootError(f"{self.url(MARKER)} is not a root marker (expected JSON with a catalog_id)")
        return catalog_id

    def write_marker(self, catalog_id: str, *, bound_from: str, overwrite: bool = False) -> None:
        """Bind this root to ``catalog_id`` with a create-only put (``overwrite`` rebinds).

        Another opener that bound the root first to the same catalog is no
        error; to another catalog, a ``RootError``.
        """
        from registry.fs.store import now_timestamp
        doc = {"catalog_id": catalog_id, "bound_from": bound_from, "bound_at": now_timestamp()}
        try:
            self.put(MARKER, (json.dumps(doc, indent=2) + "\n").encode(), create_only=not overwrite)
        except ObjectExistsError:
            if self.read_marker() != catalog_id:
                raise RootError(f"checkpoint root {self.url()} was bound to another catalog meanwhile") from None

    def remove_marker(self) -> None:
        self.delete([MARKER])


class ObjectWriter:
    """A sink that uploads to one key as it is written; ``close()`` completes the object.

    Wrapped by :class:`registry.fs.objectwrite.HashingUpload`, which makes it a file for the writers.

    Writes are buffered into ``PART_SIZE`` parts uploaded concurrently; an
    object that ends smaller goes as one PUT. :meth:`abort` drops what was
    written (an upload left incomplete by a crash is fsck's to abort).
    """

    def __init__(self, root: ObjectRoot, rel: str, out: Any) -> None:
        self._root = root
        self.rel = rel
        self._out = out
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        try:
            self._out.write(view)
        except Exception as exc:  # noqa: BLE001 - translated
            raise self._root.error(exc, self.rel, "upload") from None
        self.size += len(view)
        return len(view)

    def flush(self) -> None:
        """Wait until every part written so far is on the server."""
        try:
            self._out.flush()
        except Exception as exc:  # noqa: BLE001 - translated
            raise self._root.error(exc, self.rel, "upload") from None

    def close(self) -> None:
        try:
            self._out.close()
        except Exception as exc:  # noqa: BLE001 - translated
            raise self._root.error(exc, self.rel, "upload") from None

    def abort(self) -> None:
        try:
            abort = getattr(self._out, "abort", None)
            if abort is not None:
                abort()
        except Exception:  # noqa: BLE001 - the original error is the one to report
            pass
