"""Runs as experiments in the catalog: parameters, a search over them and the metrics, attempts, tags.

A run's parameters are rows of ``run_params`` (one per flattened key, see
:mod:`registry.format.params`), merged by an upsert. A search
(:mod:`registry.format.search`) is one SELECT over ``runs``: each parameter
and metric field it names is a correlated subquery served by an index
(``run_params``' primary key and ``(key, number)``; ``ix_metrics_best`` for a
metric), and every condition is a WHERE clause with bound values. A metric
field is ranked as ``RUN@best:KEY`` resolves (:func:`ranked_by_metric`): the
command line and the web view's runs table both search through here. Knows SQL
and nothing of torch or files.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from sqlalchemy import ColumnElement, Connection, exists, or_, select
from sqlalchemy.dialects import postgresql, sqlite

from registry.catalog.models import Attempt, AttemptEnvironment, CheckpointRow, Metric, Run, RunParam, Tag
from registry.catalog.queries import Catalog, ranked_by_metric
from registry.catalog.session import aware, utcnow
from registry.format.params import encode, number_of
from registry.format.search import Clause, Field, Search
from registry.records import AttemptInfo, FoundRun, TagInfo


class ParamsCatalog:
    """The queries of runs as experiments, run through a :class:`Catalog`'s transactions."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog

    # ------------------------------------------------------------------ parameters

    def set_params(self, run: str, flat: Mapping[str, Any]) -> None:
        """Merge ``flat`` (checked, flattened parameters) into ``run``'s, creating the run if need be."""
        def fn(conn: Connection) -> None:
            run_id = Catalog.lookup_run(conn, run, create=True)
            if not flat:
                return
            now = utcnow()
            rows = [{"run_id": run_id, "key": key, "value": encode(value), "number": number_of(value),
                     "updated_at": now} for key, value in flat.items()]
            dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
            stmt = dialect.insert(RunParam)
            conn.execute(stmt.on_conflict_do_update(
                index_elements=[RunParam.c.run_id, RunParam.c.key],
                set_={"value": stmt.excluded.value, "number": stmt.excluded.number,
                      "updated_at": stmt.excluded.updated_at}), rows)
        self.catalog.write(fn)

    def params(self, run: str) -> dict[str, Any]:
        """``run``'s parameters by flattened key, sorted; ``CheckpointNotFoundError`` for an unknown run."""
        def fn(conn: Connection) -> dict[str, Any]:
            run_id = self.catalog.require_run(conn, run)
            rows = conn.execute(select(RunParam.c.key, RunParam.c.value).where(RunParam.c.run_id == run_id)
                                .order_by(RunParam.c.key))
            return {key: json.loads(value) for key, value in rows}
        result: dict[str, Any] = self.catalog.read(fn)
        return result

    # ------------------------------------------------------------------ search

    def search(self, search: Search) -> list[FoundRun]:
        """The runs that meet every condition of ``search``, in its order, with its columns' values (and, for a
        metric, the step of the value)."""
        shown = search.columns
        metrics = [f for f in shown if not f.is_param]
        query = select(Run.c.name, Run.c.created_at, *(_value(f).label(f"v{i}") for i, f in enumerate(shown)),
                       *(_metric(f, Metric.c.step).label(f"s{i}") for i, f in enumerate(metrics)))
        for clause in search.where:
            query = query.where(_condition(clause))
        for key in search.sort:
            for expr in _order(key.field):
                query = query.order_by(expr.is_(None), expr.desc() if key.descending else expr.asc())
        query = query.order_by(Run.c.name)

        def fn(conn: Connection) -> list[FoundRun]:
            return [FoundRun(name=row.name, created_at=aware(row.created_at),
                             values={f.spec: _decoded(f, row._mapping[f"v{i}"]) for i, f in enumerate(shown)},
                             steps={f.spec: row._mapping[f"s{i}"] for i, f in enumerate(metrics)})
                    for row in conn.execute(query)]
        result: list[FoundRun] = self.catalog.read(fn)
        return result

    # ------------------------------------------------------------------ attempts and tags

    def attempts(self, run: str, step: int | None = None) -> list[AttemptInfo]:
        """Every attempt at ``run``, oldest first, with its environment; with ``step``, the one that wrote the
        step's current payload (none for a step adopted by fsck or written before attempts were recorded)."""
        def fn(conn: Connection) -> list[AttemptInfo]:
            run_id = self.catalog.require_run(conn, run)
            a = Attempt.c
            query = (select(a.id, a.writer, a.started_at, a.resumed_from, a.fork_run, a.fork_step,
                            AttemptEnvironment.c.environment)
                     .outerjoin(AttemptEnvironment, AttemptEnvironment.c.attempt_id == a.id)
                     .where(a.run_id == run_id).order_by(a.id))
            if step is not None:
                query = query.join(CheckpointRow, CheckpointRow.c.attempt_id == a.id).where(
                    CheckpointRow.c.run_id == run_id, CheckpointRow.c.step == step)
            return [AttemptInfo(id=r.id, run=run, writer=r.writer, started_at=aware(r.started_at),
                                resumed_from=r.resumed_from, fork_run=r.fork_run, fork_step=r.fork_step,
                                environment=_environment(r.environment)) for r in conn.execute(query)]
        result: list[AttemptInfo] = self.catalog.read(fn)
        return result

    def tags(self, run: str) -> list[TagInfo]:
        """Every tag of ``run`` by name: its step, when it was set there, its note."""
        def fn(conn: Connection) -> list[TagInfo]:
            run_id = self.catalog.require_run(conn, run)
            rows = conn.execute(select(Tag.c.name, CheckpointRow.c.step, Tag.c.updated_at, Tag.c.note)
                                .join(CheckpointRow, CheckpointRow.c.id == Tag.c.checkpoint_id)
                                .where(Tag.c.run_id == run_id).order_by(Tag.c.name))
            return [TagInfo(run=run, name=r.name, step=r.step, updated_at=aware(r.updated_at), note=r.note)
                    for r in rows]
        result: list[TagInfo] = self.catalog.read(fn)
        return result


def _environment(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        doc = json.loads(text)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def _param(column: Any, key: str) -> Any:
    """A parameter's ``column`` (its JSON or its number) for the run of the enclosing row."""
    return select(column).where(RunParam.c.run_id == Run.c.id, RunParam.c.key == key).scalar_subquery()


def _metric(field: Field, column: Any = Metric.c.value) -> Any:
    """``column`` (the value, or the step) of the metric point that ``field`` picks among the run's live
    checkpoints, for the run of the enclosing row: the very ranking of ``RUN@best:KEY``."""
    assert field.summary is not None
    return ranked_by_metric(select(column).select_from(CheckpointRow), Run.c.id, field.key,
                            field.summary).scalar_subquery()


def _value(field: Field) -> Any:
    return _param(RunParam.c.value, field.key) if field.is_param else _metric(field)


def _order(field: Field) -> list[Any]:
    """What a sort by ``field`` orders by: a parameter's numbers before its other values, each in order."""
    if field.is_param:
        return [_param(RunParam.c.number, field.key), _param(RunParam.c.value, field.key)]
    return [_metric(field)]


def _compare(column: Any, op: str, value: Any) -> ColumnElement[bool]:
    result: ColumnElement[bool] = {"<": column < value, "<=": column <= value, ">": column > value,
                                   ">=": column >= value, "=": column == value, "!=": column != value}[op]
    return result


def _condition(clause: Clause) -> ColumnElement[bool]:
    field, op, value = clause.field, clause.op, clause.value
    if not field.is_param:
        return _compare(_metric(field), op, value)
    p = RunParam.c
    if isinstance(value, float) and not isinstance(value, bool):
        test = or_(p.number.is_(None), p.number != value) if op == "!=" else _compare(p.number, op, value)
    else:
        test = _compare(p.value, op, encode(value))
    return exists().where(p.run_id == Run.c.id, p.key == field.key, test)


def _decoded(field: Field, value: Any) -> Any:
    if value is None:
        return None
    return json.loads(value) if field.is_param else float(value)


__all__ = ["ParamsCatalog"]
