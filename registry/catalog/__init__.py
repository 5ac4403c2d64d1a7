"""The SQL catalog: schema, migrations runner and queries. Knows nothing of torch."""

from registry.catalog.queries import Catalog, Claim, FileRecord

__all__ = ["Catalog", "Claim", "FileRecord"]
