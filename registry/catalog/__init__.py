"""The SQL catalog: schema, migrations runner and queries. Knows nothing of torch."""

from registry.catalog.queries import Catalog
from registry.catalog.records import Claim, CommitRecord, FileRecord, PayloadRecord

__all__ = ["Catalog", "Claim", "CommitRecord", "FileRecord", "PayloadRecord"]
