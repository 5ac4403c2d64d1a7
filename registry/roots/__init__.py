"""Where payloads live: one :class:`~registry.roots.base.Root` interface, three kinds.

A directory root (:mod:`.directory`), an object-storage root (:mod:`.objectstore`)
and a tiered root, a fast directory over a durable object-storage root
(:mod:`.tiered`). :mod:`registry.roots.open` is the one place that
tells them apart by what the user wrote; everything above asks the root
what it can do (:class:`~registry.roots.base.Capabilities`) and where a step is.
This layer knows nothing of SQL: it sits above ``fs`` and ``format``, beside
nothing, and below ``ops``.
"""
