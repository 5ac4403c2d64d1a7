"""Statements run straight on a pooled SQLite driver connection, for the few a load makes every time.

SQLAlchemy's execution around a statement (pool events, ``BEGIN``, the
compiled-cache lookup, result wrapping) costs several times the statement
itself when the interpreter's caches are cold, as they are for a load between
training steps. Here the SQL, the order of its parameters and the conversions
of parameters and results are compiled from the Core statement once, by
SQLAlchemy's own compiler and types, so that statement stays the one
definition; errors are raised as SQLAlchemy raises them, so the catalog's
retries and one-line errors apply unchanged.
"""

from __future__ import annotations

import sqlite3
from collections import namedtuple
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError

T = TypeVar("T")


class DriverStatement:
    """A prebuilt statement run straight on a pooled SQLite driver connection: as one autocommit statement
    (:meth:`run`: a load's reader lease, its release), or inside a :class:`DriverRead` (:meth:`rows`: its resolve).

    The read engine's pooled connections are in autocommit mode (its
    ``connect`` pragmas in :mod:`registry.catalog.session`), so a statement
    run alone is its own transaction, and ``busy_timeout`` waits for the lock
    as ``BEGIN IMMEDIATE`` would.
    """

    def __init__(self, statement: Any, engine: Engine) -> None:
        self._engine = engine
        self._compiled = statement.compile(dialect=engine.dialect)
        self._error: type[Exception] = engine.dialect.loaded_dbapi.Error
        self._plan: tuple[str, list[str], dict[str, Any], dict[str, Any], frozenset[str]] | None = None
        # a row of its result columns from a driver row, and the conversions of those columns; at the first rows()
        self._rows: tuple[Callable[[Any], Any], list[tuple[int, Callable[[Any], Any]]]] | None = None

    def _arguments(self, params: dict[str, Any]) -> tuple[str, list[Any]]:
        plan = self._plan
        if plan is None or plan[4] != params.keys():  # built for the names given (the values bound later)
            plan = self._plan = self._build(params)
        sql, order, fixed, processors, _ = plan
        values = {**fixed, **params}
        return sql, [processors[name](values[name]) if name in processors else values[name] for name in order]

    def _build(self, params: dict[str, Any]) -> tuple[str, list[str], dict[str, Any], dict[str, Any], frozenset[str]]:
        """The SQL, its parameters' order, the values the statement fixes and each parameter's conversion.

        The statement's own IN lists expand the same way every time; one whose
        values the caller gives could expand to another length at each call.
        """
        varying = sorted(n for n, bind in self._compiled.binds.items() if bind.expanding and n in params)
        if varying:
            raise TypeError(f"a driver statement cannot bind a list given per call ({', '.join(varying)})")
        state = self._compiled.construct_expanded_state(params)
        fixed = {k: v for k, v in state.parameters.items() if k not in params}
        processors = dict(state.processors)  # the expanded IN lists'; then each parameter type's own
        dialect = self._engine.dialect
        for name, bind in self._compiled.binds.items():
            convert = bind.type.dialect_impl(dialect).bind_processor(dialect)
            if convert is not None and name in (state.positiontup or ()):
                processors.setdefault(name, convert)
        return state.statement, list(state.positiontup or ()), fixed, processors, frozenset(params)

    def run(self, params: dict[str, Any]) -> Any:
        """Execute with ``params`` on one of the engine's pooled connections; the first column of its first row."""
        conn = self._engine.raw_connection()
        try:
            # every row fetched: the statement ends, and with it its implicit transaction
            rows = self._fetch(conn.driver_connection, params)
        finally:
            conn.close()
        return rows[0][0] if rows else None

    def rows(self, driver: sqlite3.Connection, params: dict[str, Any]) -> DriverRows:
        """Every row of the statement on ``driver``, each value converted as SQLAlchemy's types convert it
        (a stored timestamp back into a datetime), each row a named tuple of the statement's columns."""
        if self._rows is None:  # one assignment: a thread never sees the row type without its conversions
            dialect = self._engine.dialect
            columns = self._compiled._result_columns
            row = namedtuple("DriverRow", [c[0] for c in columns])  # type: ignore[misc]
            self._rows = (row._make, [(i, convert) for i, c in enumerate(columns) if (
                convert := c[3].dialect_impl(dialect).result_processor(dialect, None)) is not None])
        make, convert = self._rows
        out = DriverRows()
        for raw in self._fetch(driver, params):
            values = list(raw)
            for i, fn in convert:
                values[i] = fn(values[i])
            out.append(make(values))
        return out

    def _fetch(self, driver: Any, params: dict[str, Any]) -> list[Any]:
        sql, args = self._arguments(params)
        try:
            return list(driver.execute(sql, args).fetchall())
        except self._error as exc:  # as SQLAlchemy would raise it: retried, then reported, like any other
            raise DBAPIError.instance(sql, args, exc, self._error) from exc


class DriverRows(list[Any]):
    """A statement's rows, with the two calls of SQLAlchemy's result that the readers here use."""

    def first(self) -> Any:
        return self[0] if self else None

    def all(self) -> list[Any]:
        return list(self)


class DriverRead:
    """Read transactions of prebuilt statements on a pooled SQLite driver connection: ``BEGIN``, the
    statements, ``COMMIT``, with none of SQLAlchemy's execution around each (see :class:`DriverStatement`).

    ``fn(conn)`` gets a connection whose ``execute(statement, params)`` and
    ``.first()``/``.all()`` of its rows are all a reader may use: a reader
    written for a SQLAlchemy connection runs unchanged on it, the same
    statements, one snapshot. Each statement is compiled once and kept (up to
    :data:`PLANS`; past that, compiled at each use), so it should be one the
    caller builds once.
    """

    PLANS = 64

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._plans: dict[int, tuple[Any, DriverStatement]] = {}  # by id; the statement is kept, so is its id
        self._error: type[Exception] = engine.dialect.loaded_dbapi.Error

    def plan(self, statement: Any) -> DriverStatement:
        found = self._plans.get(id(statement))
        if found is not None and found[0] is statement:
            return found[1]
        made = DriverStatement(statement, self._engine)
        if len(self._plans) < self.PLANS:
            self._plans[id(statement)] = (statement, made)
        return made

    def run(self, fn: Callable[[Any], T]) -> T:
        conn = self._engine.raw_connection()
        try:
            driver = conn.driver_connection
            try:
                driver.execute("BEGIN")  # type: ignore[union-attr]
                try:
                    result = fn(_DriverConnection(driver, self))
                finally:
                    driver.execute("COMMIT")  # type: ignore[union-attr]  # a read: it ends the snapshot
            except self._error as exc:
                raise DBAPIError.instance("BEGIN ... COMMIT", (), exc, self._error) from exc
            return result
        finally:
            conn.close()


class _DriverConnection:
    def __init__(self, driver: Any, read: DriverRead) -> None:
        self._driver = driver
        self._read = read

    def execute(self, statement: Any, params: dict[str, Any] | None = None) -> DriverRows:
        return self._read.plan(statement).rows(self._driver, params or {})


__all__ = ["DriverRead", "DriverRows", "DriverStatement"]
