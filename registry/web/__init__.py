"""``registry ui``: a read-only web view of runs, curves, checkpoints and retention previews.

A Starlette app over one read-only :class:`~registry.api.Registry`; every
``/api/...`` document is built by :mod:`registry.views`, the same functions
that the command line's ``--json`` prints. Nothing else in the package
imports this; training never needs it.
"""

from __future__ import annotations

from registry.web.app import create_app
from registry.web.server import LOOPBACK_HOSTS, check_bind, is_loopback, listen, serve

__all__ = ["LOOPBACK_HOSTS", "check_bind", "create_app", "is_loopback", "listen", "serve"]
