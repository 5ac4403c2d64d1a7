"""A checkpoint registry for PyTorch training: atomic publish, a real catalog,
verified and rank-consistent loads, and retention that never deletes what
must be kept. See ``Registry.open``."""

from registry.api import Registry, VerifyResult
from registry.checkpoint import Checkpoint
from registry.errors import (AsyncPublishError, CatalogError, CheckpointNotFoundError, CorruptCheckpointError,
                             DistributedError, InvalidNameError, InvalidRefError, InvalidStateError,
                             ManifestError, PolicyError, PublishError, RegistryError, RootError, SafetensorsFormatError,
                             SchemaTooNewError, StepExistsError, UnsafePathError, UnsafePickleError)
from registry.records import CheckpointInfo, EventInfo, MetricPoint, RunInfo
from registry.refs import Ref, parse_ref

__version__ = "0.1.0"

__all__ = [
    "AsyncPublishError", "CatalogError", "Checkpoint", "CheckpointInfo", "CheckpointNotFoundError", "CorruptCheckpointError",
    "DistributedError", "EventInfo", "InvalidNameError", "InvalidRefError", "InvalidStateError",
    "ManifestError", "MetricPoint", "PolicyError", "PublishError", "Ref", "Registry", "RegistryError", "RootError",
    "RunInfo", "SafetensorsFormatError", "SchemaTooNewError", "StepExistsError", "UnsafePathError",
    "UnsafePickleError", "VerifyResult", "parse_ref",
]
