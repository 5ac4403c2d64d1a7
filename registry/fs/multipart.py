"""Incomplete multipart uploads on an S3 root: list them under a prefix, and abort them.

An upload that was started and never completed or aborted (a writer killed
mid-upload, a server that died under it) holds its parts on the server: they
are billed, yet they never appear as objects, so listing objects cannot find
them. The object client the data path uses cannot list or abort them, so
these two requests are signed here (AWS Signature Version 4, standard library
only) from the root's connection settings. Path-style URLs
(``ENDPOINT/BUCKET/KEY``), which every S3-compatible server and AWS accept.

Knows keys and HTTP, nothing of the catalog: deciding which uploads are
abandoned is fsck's business.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import time
import urllib.parse
import xml.etree.ElementTree as ET
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Protocol

from registry.errors import StorageError

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
#: statuses S3 asks the client to retry (with backoff): throttling and transient server trouble
RETRY_STATUS = frozenset({500, 502, 503, 504})
BACKOFF_S = 0.2
TIMEOUT_S = 30.0


class SigningConfig(Protocol):
    """What signing needs of a root's connection settings (``registry.fs.objects.ObjectConfig`` has these)."""

    @property
    def endpoint_url(self) -> str: ...
    @property
    def region(self) -> str: ...
    @property
    def bucket(self) -> str: ...
    @property
    def access_key_id(self) -> str | None: ...
    @property
    def secret_access_key(self) -> str | None: ...
    @property
    def session_token(self) -> str | None: ...
    @property
    def max_retries(self) -> int: ...


@dataclass(frozen=True, kw_only=True)
class Upload:
    """One multipart upload that was started and neither completed nor aborted."""

    key: str               # the object key it would create, from the bucket's top
    upload_id: str
    initiated: datetime | None


@dataclass(frozen=True, kw_only=True)
class Response:
    status: int
    body: bytes
    headers: Mapping[str, str]


def _quote(text: str, *, safe: str = "") -> str:
    return urllib.parse.quote(text, safe="-_.~" + safe)


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


def sign(config: SigningConfig, method: str, path: str, query: Mapping[str, str], *, payload_sha256: str,
         now: datetime, extra_headers: Mapping[str, str] | None = None) -> dict[str, str]:
    """The headers that authenticate one request (SigV4, service ``s3``); ``path`` is already URI-encoded."""
    parts = urllib.parse.urlsplit(config.endpoint_url)
    amz_date = now.strftime("%Y%m%dT%H%M%SZ")
    day = amz_date[:8]
    headers = {"host": parts.netloc, "x-amz-content-sha256": payload_sha256, "x-amz-date": amz_date,
               **{k.lower(): v for k, v in (extra_headers or {}).items()}}
    if config.session_token:
        headers["x-amz-security-token"] = config.session_token
    if not config.access_key_id or not config.secret_access_key:
        return headers  # anonymous: a public bucket may still answer
    names = sorted(headers)
    canonical = "\n".join([
        method, path,
        "&".join(f"{_quote(k)}={_quote(v)}" for k, v in sorted(query.items())),
        "".join(f"{n}:{' '.join(headers[n].split())}\n" for n in names),
        ";".join(names), payload_sha256])
    scope = f"{day}/{config.region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = _hmac(_hmac(_hmac(_hmac(("AWS4" + config.secret_access_key).encode(), day), config.region), "s3"),
                "aws4_request")
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (f"AWS4-HMAC-SHA256 Credential={config.access_key_id}/{scope}, "
                                f"SignedHeaders={';'.join(names)}, Signature={signature}")
    return headers


def _url(config: SigningConfig, key: str) -> str:
    return f"s3://{config.bucket}/{key}"


def _error_line(response: Response) -> str:
    """``Code: Message`` from an S3 error document, else the HTTP status."""
    try:
        doc = ET.fromstring(response.body)
        code, message = doc.findtext("Code") or "", doc.findtext("Message") or ""
        if code or message:
            return f"{code}: {message}".strip(": ") + f" (HTTP {response.status})"
    except ET.ParseError:
        pass
    return f"HTTP {response.status}"


def request(config: SigningConfig, method: str, key: str = "", query: Mapping[str, str] | None = None, *,
            body: bytes = b"", headers: Mapping[str, str] | None = None,
            ok: frozenset[int] = frozenset({200})) -> Response:
    """One signed request to the bucket (``key`` empty: the bucket itself), retried with backoff where S3
    says to retry (5xx, ``SlowDown``) and when the server cannot be reached.

    A status outside ``ok`` raises :class:`StorageError` (the server's trouble, never a verdict on a step).
    The root's ``max_retries`` bounds the retries, as it bounds the data path's.
    """
    retries = config.max_retries
    query = dict(query or {})
    parts = urllib.parse.urlsplit(config.endpoint_url)
    base = parts.path.rstrip("/")
    path = f"{base}/{_quote(config.bucket)}" + (f"/{_quote(key, safe='/')}" if key else "")
    target = path + ("?" + "&".join(f"{_quote(k)}={_quote(v)}" if v else _quote(k)
                                    for k, v in sorted(query.items())) if query else "")
    payload = hashlib.sha256(body).hexdigest() if body else EMPTY_SHA256
    connection_type = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    where = _url(config, key)
    for attempt in range(retries + 1):
        signed = sign(config, method, path, query, payload_sha256=payload, now=datetime.now(timezone.utc),
                      extra_headers=headers)
        if body:
            signed["content-length"] = str(len(body))
        conn = connection_type(parts.netloc, timeout=TIMEOUT_S)
        try:
            conn.request(method, target, body=body or None, headers=signed)
            raw = conn.getresponse()
            response = Response(status=raw.status, body=raw.read(), headers={k.lower(): v for k, v in
                                                                             raw.getheaders()})
        except OSError as exc:  # refused, reset, timed out: the server's trouble, worth retrying
            if attempt == retries:
                raise StorageError(f"S3 {method} {where}: cannot reach {config.endpoint_url}: "
                                   f"{exc.strerror or exc} (after {retries + 1} tries)", url=where) from None
            time.sleep(BACKOFF_S * 2 ** attempt)
            continue
        except http.client.HTTPException as exc:
            if attempt == retries:
                raise StorageError(f"S3 {method} {where}: bad answer from {config.endpoint_url}: {exc}",
                                   url=where) from None
            time.sleep(BACKOFF_S * 2 ** attempt)
            continue
        finally:
            conn.close()
        if response.status in ok:
            return response
        if response.status in RETRY_STATUS and attempt < retries:
            time.sleep(BACKOFF_S * 2 ** attempt)
            continue
        raise StorageError(f"S3 {method} {where}: {_error_line(response)}", url=where)
    raise AssertionError("unreachable")  # pragma: no cover


def _parse_time(text: str | None) -> datetime | None:
    if not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def list_uploads(config: SigningConfig, prefix: str, *, page_size: int = 1000) -> Iterator[Upload]:
    """Every incomplete multipart upload whose key starts with ``prefix``, page by page, each once.

    S3 pages by ``key-marker`` plus ``upload-id-marker``; SeaweedFS sends only
    ``NextUploadIdMarker`` and pages by it alone, so whichever the server
    sent is sent back. A page with nothing new ends the listing (a server
    that says "truncated" without a way on would loop forever).
    """
    marker: dict[str, str] = {}
    seen: set[tuple[str, str]] = set()
    while True:
        query = {"uploads": "", "prefix": prefix, "max-uploads": str(page_size), **marker}
        doc = ET.fromstring(request(config, "GET", "", query).body)
        fresh = 0
        for upload in doc.iter(f"{_NS}Upload"):
            key, upload_id = upload.findtext(f"{_NS}Key"), upload.findtext(f"{_NS}UploadId")
            if not key or not upload_id or not key.startswith(prefix) or (key, upload_id) in seen:
                continue
            seen.add((key, upload_id))
            fresh += 1
            yield Upload(key=key, upload_id=upload_id, initiated=_parse_time(upload.findtext(f"{_NS}Initiated")))
        if (doc.findtext(f"{_NS}IsTruncated") or "").lower() != "true" or not fresh:
            return
        next_key = doc.findtext(f"{_NS}NextKeyMarker") or ""
        next_id = doc.findtext(f"{_NS}NextUploadIdMarker") or ""
        if not next_key and not next_id:
            return
        marker = {"upload-id-marker": next_id} | ({"key-marker": next_key} if next_key else {})


def abort_upload(config: SigningConfig, upload: Upload) -> bool:
    """Abort one upload (its parts are freed); False when the server says it was already gone.

    (Some servers, SeaweedFS among them, answer 204 for an unknown upload too.)
    """
    response = request(config, "DELETE", upload.key, {"uploadId": upload.upload_id}, ok=frozenset({200, 204, 404}))
    return response.status != 404


def start_upload(config: SigningConfig, key: str) -> Upload:
    """Start a multipart upload of ``key`` (CreateMultipartUpload); for tests and tools that stage parts."""
    doc = ET.fromstring(request(config, "POST", key, {"uploads": ""}).body)
    upload_id = doc.findtext(f"{_NS}UploadId")
    if not upload_id:
        raise StorageError(f"S3 POST {_url(config, key)}: the server returned no upload id", url=_url(config, key))
    return Upload(key=key, upload_id=upload_id, initiated=None)


def upload_part(config: SigningConfig, upload: Upload, number: int, data: bytes) -> str:
    """Send part ``number`` (from 1) of ``upload``; returns its ETag."""
    response = request(config, "PUT", upload.key, {"partNumber": str(number), "uploadId": upload.upload_id},
                       body=data)
    return response.headers.get("etag", "")


__all__ = ["SigningConfig", "Upload", "abort_upload", "list_uploads", "request", "sign", "start_upload",
           "upload_part"]
