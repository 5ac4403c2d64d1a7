"""Every error the registry raises on purpose.

One root, :class:`RegistryError`, so callers can catch the registry's own
failures without swallowing bugs. Each subclass also derives from the builtin
that describes it best, so ``except LookupError`` keeps working for code that
knows nothing of the registry. Errors carry the offending run, step or path as
attributes and print as one line.
"""

from __future__ import annotations

from pathlib import Path


class RegistryError(Exception):
    """Root of every error raised by the registry."""

    def __init__(self, message: str, *, path: str | Path | None = None,
                 run: str | None = None, step: int | None = None) -> None:
        super().__init__(" ".join(str(message).split()))
        self.path = Path(path) if path is not None else None
        self.run = run
        self.step = step


def install_hint(extra: str) -> str:
    """How to install an optional part: from a checkout, or from an index that carries the package."""
    return f"pip install -e '.[{extra}]' in a checkout (or pip install 'checkpoint-registry[{extra}]' from an index)"


class InvalidNameError(RegistryError, ValueError):
    """A run name, tag name or step that does not follow the rules."""


class InvalidRefError(RegistryError, ValueError):
    """A checkpoint reference that does not parse."""


class InvalidNumberError(RegistryError, ValueError):
    """A count or size typed as text (an option, a query, a policy clause) that does not parse or is out of range."""


class InvalidQueryError(RegistryError, ValueError):
    """A search of runs (``--where``, ``--sort``, ``--columns``) that does not parse: the message names the part."""


class InvalidStateError(RegistryError, TypeError):
    """A state dict, metric or option that cannot be published."""


class CheckpointNotFoundError(RegistryError, LookupError):
    """A reference that resolves to no checkpoint."""


class StepExistsError(RegistryError, FileExistsError):
    """The step is already published, or another writer holds it."""


class CorruptCheckpointError(RegistryError, ValueError):
    """A checkpoint whose files are missing, truncated or fail their checksum."""


class ManifestError(CorruptCheckpointError):
    """A manifest that is not valid JSON or breaks the format's rules."""


class UnsafePathError(CorruptCheckpointError):
    """A file name that would reach outside the checkpoint directory."""


class SafetensorsFormatError(CorruptCheckpointError):
    """A safetensors file whose header or offsets are malformed."""


class DeltaBaseError(RegistryError, ValueError):
    """A delta and a base that do not belong together.

    Encoding: the target's tensor names, shapes or dtypes differ from the
    base's, so only a full publish can store it. Decoding: the base is not
    the one the delta was made against.
    """


class PolicyVersionConflictError(RegistryError, ValueError):
    """A policy version published again with other bytes: a version names one set of weights for good."""


class UnsafePickleError(RegistryError, ValueError):
    """A ``.pt`` extra that needs full unpickling and was not trusted, or a DCP ``.metadata`` naming code."""


class CatalogError(RegistryError, RuntimeError):
    """The catalog cannot be reached, or is in a state we cannot use."""


class SchemaTooNewError(CatalogError):
    """The catalog was migrated by a newer version of the registry."""


class ReadOnlyError(CatalogError):
    """A write asked of a catalog that was opened read-only."""


class RootError(RegistryError, NotADirectoryError):
    """The checkpoint root is not a usable directory."""


class RootMismatchError(RootError):
    """The checkpoint root and the catalog do not belong together (wrong or unmounted path, wrong URL)."""


class PublishError(RegistryError, OSError):
    """Publishing failed on the filesystem; nothing was made visible."""

    def __init__(self, message: str, *, errno: int | None = None, **kwargs: object) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.errno = errno


class DistributedError(RegistryError, RuntimeError):
    """A collective load failed or timed out on some rank."""


class PolicyError(RegistryError, ValueError):
    """A retention policy that is malformed, or that misbehaved when asked what to keep."""


class UnknownMetricError(PolicyError):
    """A policy ranks by a metric that no checkpoint of the run has (a typo would keep nothing by it).

    ``metric`` is the key asked for; ``known`` the keys the run's checkpoints
    do have, closest match first.
    """

    def __init__(self, message: str, *, metric: str, known: tuple[str, ...] = (), **kwargs: object) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.metric = metric
        self.known = known


class CheckpointDeletedError(CheckpointNotFoundError):
    """The step stopped being loadable (retention deleted it) between resolving it and reading it."""


class NoCopyError(CheckpointNotFoundError):
    """A tiered root's step with no copy this host can read: not on its fast tier, and not yet durable.

    Not evidence against the step (another host's fast tier may hold it):
    nothing is marked; ``@latest`` goes on to an older step.
    """


class AsyncPublishError(RegistryError, RuntimeError):
    """A background publish (``blocking=False``) failed; raised once on the next call.

    The original exception is also the result of that publish's future, and is
    this error's ``__cause__``.
    """


class CheckpointReadError(RegistryError, OSError):
    """This process could not read a checkpoint (missing mount, no file descriptors, no permission).

    A reader's local trouble, not evidence against the checkpoint: nothing is
    marked corrupt and no older step is tried.
    """

    def __init__(self, message: str, *, errno: int | None = None, **kwargs: object) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.errno = errno


class ExtraNotFoundError(RegistryError, LookupError):
    """A load asked for an extra (``NAME.pt``) the checkpoint does not have."""


class DcpMetadataError(CorruptCheckpointError):
    """A DCP ``.metadata`` that is truncated or malformed, or names data files that are missing or short."""


class StorageError(RegistryError, OSError):
    """The object store failed a request: server down or overloaded, wrong credentials, no such bucket.

    The server's trouble, never evidence against a checkpoint: a read that
    meets it marks nothing corrupt and tries no older step; a publish that
    meets it ends its claim ``failed`` and leaves what was published alone.
    ``url`` is the object or root concerned, never with credentials in it.
    """

    def __init__(self, message: str, *, url: str | None = None, **kwargs: object) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.url = url


class ObjectNotFoundError(RegistryError, FileNotFoundError):
    """An object-store key that does not exist (``url`` names it): the caller decides whether a payload is missing."""

    def __init__(self, message: str, *, url: str | None = None, **kwargs: object) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.url = url


class ObjectExistsError(RegistryError, FileExistsError):
    """A create-only put refused: the key already exists (``url`` names it)."""

    def __init__(self, message: str, *, url: str | None = None, **kwargs: object) -> None:
        super().__init__(message, **kwargs)  # type: ignore[arg-type]
        self.url = url


class WebhookError(RegistryError, ValueError):
    """A webhook refused: a URL that is not http(s), a host not allowed (only loopback by default), an unknown
    event name, or a webhook id that does not exist. The message never shows the URL's credentials."""


class LagTimeoutError(RegistryError, TimeoutError):
    """``wait_lag`` gave up: a live policy consumer still lagged more versions than allowed after the timeout."""


class DurableTimeoutError(RegistryError, TimeoutError):
    """``wait_durable`` or ``replicate(wait=True)`` gave up after its timeout: the step keeps its place in the
    replication queue and becomes durable later."""
