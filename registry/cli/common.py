"""What the commands share: the state a command opens the registry through, the error wrapper, output helpers.

Exit status: 0 on success, 1 with a one-line message on a registry error,
2 on a usage error (click's own).
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import click

from registry.errors import RegistryError

F = TypeVar("F", bound=Callable[..., Any])


CREATORS = frozenset({"import", "db"})  # may create the root and the catalog; other commands need them to exist


class State:
    def __init__(self, url: str | None, root: str | None, *, command: str | None = None,
                 read_only: bool = False, quiet: bool = False, durable: str | None = None) -> None:
        self.url = url
        self.durable = durable
        self.quiet = quiet
        self.root = root
        self.command = command
        self.read_only = read_only
        self._registry: Any = None

    def registry(self, *, migrate: bool = True, rebind_root: bool = False) -> Any:
        if self._registry is None:
            from registry.api import Registry
            self._registry = Registry.open(url=self.url, root=self.root, migrate=migrate,
                                           create=self.command in CREATORS, read_only=self.read_only,
                                           rebind_root=rebind_root, durable=self.durable)
        return self._registry

    def progress(self, as_json: bool) -> Any:
        """Progress bars on stderr for long work: on a terminal only, never with --json or --quiet."""
        from registry.cli.terminal import progress_bar
        return progress_bar(enabled=not (as_json or self.quiet))

    def close(self) -> None:
        if self._registry is not None:
            self._registry.close()


def command(fn: F) -> F:
    """Turn every failure that is not a bug into one line ``registry: error: ...``.

    A ``RegistryError`` exits 1 (a retention metric nobody logged is a usage
    error: 2); so do a raw ``OSError`` (named by its file and cause) and a
    catalog error that escaped the library (named by its catalog). Hints
    that name a Python argument are shown as the command's flag.
    """
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except RegistryError as exc:
            from registry.errors import UnknownMetricError
            fail(cli_hints(str(exc)), status=2 if isinstance(exc, UnknownMetricError) else 1)
        except BrokenPipeError:
            # the reader went away (``registry diff A B | head``): nothing to say to it; the shell's usual status
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush does not fail again
            sys.exit(141)
        except OSError as exc:
            fail(os_error_line(exc))
        except Exception as exc:
            import sqlite3

            from sqlalchemy.exc import DBAPIError, SQLAlchemyError
            if not isinstance(exc, (SQLAlchemyError, sqlite3.Error)):
                raise
            cause = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
            state = next((a for a in args if isinstance(a, State)), None)
            where = catalog_name(state) if state is not None else "catalog"
            fail(f"catalog {where}: {first_line(cause)}")
    return wrapper  # type: ignore[return-value]


def fail(message: str, *, status: int = 1) -> None:
    click.echo(f"registry: error: {message}", err=True)
    sys.exit(status)


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def os_error_line(exc: OSError) -> str:
    """``/path: No space left on device``: the file and the cause, whatever raised it."""
    cause = exc.strerror or first_line(exc)
    if exc.filename is None:
        return cause
    files = str(exc.filename) + (f" -> {exc.filename2}" if exc.filename2 is not None else "")
    return f"{files}: {cause}"


def catalog_name(state: State) -> str:
    """The catalog's database file (SQLite) or its URL without its passwords."""
    from registry.api import locations
    from registry.catalog.session import catalog_name as named
    return named(locations(state.url, state.root)[1])


def cli_hints(message: str) -> str:
    """A library message with its hints about Python arguments put as this CLI's flags."""
    from registry.retention import MISSING_METRIC_HINT
    flags = {MISSING_METRIC_HINT: "pass --allow-missing-metric (or missing_ok=True to the policy in a --policy "
                                  "file) if that is intended",
             "pass overwrite=True": "pass --overwrite"}
    for python, flag in flags.items():
        message = message.replace(python, flag)
    return message


def stdin_is_terminal() -> bool:
    """Whether a person can answer a question (gc's confirmation): stdin is a terminal, not a pipe or a file."""
    return sys.stdin.isatty()


def emit_json(doc: Any) -> None:
    click.echo(json.dumps(doc, indent=2, sort_keys=False, default=str))


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[str(c) for c in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for r in cells:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
