"""A checkpoint registry for PyTorch training: atomic publish, a real catalog,
verified and rank-consistent loads, and retention that never deletes what
must be kept. See ``Registry.open``.

The names below are imported on first use, so that ``import registry.catalog``
or ``registry --help`` does not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from registry.api import Registry
    from registry.catalog.lineage import LineageHop
    from registry.checkpoint import Checkpoint
    from registry.distributed.sharded import ShardedLoad
    from registry.errors import (AsyncPublishError, CatalogError, CheckpointDeletedError, CheckpointNotFoundError,
                                 CheckpointReadError, CorruptCheckpointError, DcpMetadataError, DeltaBaseError,
                                 DistributedError,
                                 ExtraNotFoundError, InvalidNameError, InvalidNumberError, InvalidQueryError,
                                 InvalidRefError, InvalidStateError, LagTimeoutError, ManifestError, NoCopyError,
                                 DurableTimeoutError, ObjectExistsError,
                                 ObjectNotFoundError, PolicyError, PolicyVersionConflictError,
                                 PublishError, ReadOnlyError, RegistryError, RootError, RootMismatchError,
                                 SafetensorsFormatError, SchemaTooNewError, StepExistsError, StorageError,
                                 UnknownMetricError, UnsafePathError, UnsafePickleError, WebhookError)
    from registry.ops.diff import CheckpointDiff
    from registry.ops.export import Checkout, Exported
    from registry.ops.scrub import VerifyResult
    from registry.records import CheckpointInfo, EventInfo, MetricPoint, RunInfo
    from registry.format.refs import Ref, parse_ref

__version__ = "0.1.0"

_ERRORS = (
    "AsyncPublishError", "CatalogError", "CheckpointDeletedError", "CheckpointNotFoundError", "CheckpointReadError",
    "CorruptCheckpointError", "DcpMetadataError", "DeltaBaseError", "DistributedError", "DurableTimeoutError",
    "ExtraNotFoundError",
    "InvalidNameError",
    "InvalidNumberError", "InvalidQueryError",
    "InvalidRefError", "InvalidStateError", "LagTimeoutError", "ManifestError", "NoCopyError", "ObjectExistsError",
    "ObjectNotFoundError", "PolicyError", "PolicyVersionConflictError", "PublishError", "ReadOnlyError",
    "RegistryError", "RootError", "RootMismatchError", "SafetensorsFormatError", "SchemaTooNewError", "StepExistsError",
    "StorageError", "UnknownMetricError", "UnsafePathError", "UnsafePickleError", "WebhookError",
)

# public name -> the module that defines it
_HOMES: dict[str, str] = {
    "Registry": "registry.api", "VerifyResult": "registry.ops.scrub",
    "Checkpoint": "registry.checkpoint",
    "CheckpointInfo": "registry.records", "EventInfo": "registry.records", "MetricPoint": "registry.records",
    "RunInfo": "registry.records",
    "Ref": "registry.format.refs", "parse_ref": "registry.format.refs",
    "LineageHop": "registry.catalog.lineage", "CheckpointDiff": "registry.ops.diff",
    "Checkout": "registry.ops.export", "Exported": "registry.ops.export", "ShardedLoad": "registry.distributed.sharded",
    **{name: "registry.errors" for name in _ERRORS},
}

# spelled out (not computed) so that type checkers see what the package exports
__all__ = [
    "AsyncPublishError", "CatalogError", "Checkpoint", "CheckpointDeletedError", "CheckpointDiff", "CheckpointInfo",
    "CheckpointNotFoundError", "CheckpointReadError", "Checkout", "CorruptCheckpointError", "DcpMetadataError",
    "DeltaBaseError",
    "DistributedError", "DurableTimeoutError", "EventInfo", "Exported", "ExtraNotFoundError", "InvalidNameError",
    "InvalidNumberError",
    "InvalidQueryError", "InvalidRefError",
    "InvalidStateError", "LagTimeoutError", "LineageHop", "ManifestError", "MetricPoint", "NoCopyError",
    "ObjectExistsError",
    "ObjectNotFoundError", "PolicyError", "PolicyVersionConflictError", "PublishError",
    "ReadOnlyError", "Ref", "Registry", "RegistryError", "RootError", "RootMismatchError", "RunInfo",
    "SafetensorsFormatError", "SchemaTooNewError", "ShardedLoad", "StepExistsError", "StorageError",
    "UnknownMetricError",
    "UnsafePathError", "UnsafePickleError", "VerifyResult", "WebhookError", "parse_ref",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        # AttributeError (not ImportError) lets ``from registry import retention`` fall back to the submodule
        raise AttributeError(f"module 'registry' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
