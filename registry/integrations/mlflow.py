"""A registry run mirrored into MLflow 3, for a team whose tracker is MLflow (extra ``checkpoint-registry[mlflow]``).

:func:`mirror_run` makes the MLflow side match the registry's, and only adds or changes what differs:

- the run becomes an MLflow run (tagged ``registry.run``) in an experiment named after it (or ``experiment=``),
  with its params and every current metric point at its step;
- each verified step becomes an external ``LoggedModel`` (MLflow 3's model of a deep-learning checkpoint) whose
  bytes stay in the registry: tagged with its ref (``registry.ref``: ``RUN@STEP``), the object URL on an
  ``s3://`` root (``registry.url``), its manifest digest, step, status and tags, and carrying the metrics logged
  at its step, so ``search_logged_models`` ordered by a metric finds what ``RUN@best:METRIC`` resolves;
- the registry's tags become aliases of a registered model named after the run (one model version per tagged
  step); a tag removed takes its alias away, aliases set by hand stay;
- a step that retention deleted, or that was found corrupt, keeps its ``LoggedModel``, tagged with that status.

Every object is found again by its ``registry.*`` tags, so running it twice changes nothing the second time,
and running it after each event (:func:`mirror_event`, e.g. from a webhook's receiver) keeps MLflow current.
No payload byte is copied unless ``copy_payload=True``. MLflow's own failures (a server down, a refusal) are
raised as MLflow raises them.
"""

from __future__ import annotations

import json
import math
import posixpath
import re
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from registry.errors import InvalidStateError, RegistryError, install_hint
from registry.records import CheckpointInfo, EventInfo, MetricPoint, Status

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import LoggedModel

    from registry.api import Registry

TAG_RUN = "registry.run"
TAG_REF = "registry.ref"
TAG_STEP = "registry.step"
TAG_DIGEST = "registry.manifest_sha256"
TAG_STATUS = "registry.status"
TAG_TAGS = "registry.tags"
TAG_URL = "registry.url"
TAG_ROOT = "registry.root"
TAG_PAYLOAD = "registry.payload"
TAG_ALIASES = "registry.aliases"  # on the registered model: the aliases this mirror set, so it removes only those
RUN_TAG_PREFIX = "registry.tag."  # on the MLflow run: one tag per registry tag, naming its step
EXTERNAL = "mlflow.external"  # MLflow's own mark of a model whose bytes live elsewhere (create_external_model)
MODEL_TYPE = "checkpoint"

# MLflow's limits (mlflow.utils.validation): entries per log_batch, and a param value's length
_METRICS_PER_BATCH = 1000
_PARAMS_PER_BATCH = 100
_MAX_PARAM_VALUE = 6000
_MAX_KEY = 250
_NAME_RE = re.compile(r"[/\w.\- ]+")  # a param, metric or tag key MLflow takes (no ':', which Windows refuses)
_ALIAS_RE = re.compile(r"[\w\-]+")
_VERSION_ALIAS_RE = re.compile(r"[vV]\d+")


@dataclass
class MirrorResult:
    """What one mirror added or changed on the MLflow side (all zeros: it was already current)."""

    run: str
    experiment_id: str
    run_id: str
    registered_model: str | None = None
    params: int = 0
    metrics: int = 0
    run_tags: int = 0
    models_created: int = 0
    models_updated: int = 0
    versions_created: int = 0
    versions_updated: int = 0
    aliases_set: int = 0
    aliases_removed: int = 0
    payloads_copied: int = 0
    skipped: list[str] = field(default_factory=list)  # what could not be mirrored, and why

    @property
    def changed(self) -> bool:
        return any((self.params, self.metrics, self.run_tags, self.models_created, self.models_updated,
                    self.versions_created, self.versions_updated, self.aliases_set, self.aliases_removed,
                    self.payloads_copied))

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "changed": self.changed}


def client(tracking_uri: str) -> MlflowClient:
    """An MLflow client of ``tracking_uri`` (its model registry too), or the error naming the extra to install."""
    try:
        from mlflow import MlflowClient
    except ImportError:
        from registry.cli.terminal import MissingExtraError
        raise MissingExtraError(f"mirroring into MLflow needs mlflow: {install_hint('mlflow')}") from None
    return MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)


def mirror_run(reg: Registry, run: str, *, tracking_uri: str, experiment: str | None = None,
               model_name: str | None = None, copy_payload: bool = False) -> MirrorResult:
    """Make MLflow at ``tracking_uri`` hold ``run`` as the registry does; return what changed.

    ``experiment``: the MLflow experiment (created if missing; default: the run's name). ``model_name``: the
    registered model whose aliases are the run's tags (default: the run's name; one made by someone else is
    refused). ``copy_payload``: also upload each verified step's files as its model's artifacts.
    """
    checkpoints = reg.checkpoints(run, include_deleted=True)  # an unknown run raises here, before MLflow
    points = reg.metrics(run)
    return _Mirror(reg, run, client(tracking_uri), checkpoints, points).run(
        experiment=experiment or run, model_name=model_name or run, copy_payload=copy_payload)


def mirror_event(reg: Registry, event: Mapping[str, Any] | EventInfo, *, tracking_uri: str,
                 experiment: str | None = None, model_name: str | None = None,
                 copy_payload: bool = False) -> MirrorResult | None:
    """Bring the run an event is about up to date in MLflow: the continuous mirror's one step.

    ``event``: a webhook's JSON body (its ``run``) or an :class:`~registry.records.EventInfo`; None for an
    event of no run. The whole run is compared (not only the event's step), so an event delivered twice, late
    or out of order leaves MLflow as correct as one delivered once.
    """
    run = event.get("run") if isinstance(event, Mapping) else event.run
    if not run:
        return None
    return mirror_run(reg, str(run), tracking_uri=tracking_uri, experiment=experiment, model_name=model_name,
                      copy_payload=copy_payload)


def run_params(reg: Registry, run: str, checkpoints: Sequence[CheckpointInfo]) -> dict[str, Any]:
    """The run's params: its run-level params (``Registry.set_params``), else the newest step's config."""
    found = reg.params(run)
    if found:
        return dict(found)
    for info in reversed(checkpoints):
        if info.status in (Status.PUBLISHED, Status.VERIFIED):
            return step_config(info)
    return {}


def step_config(info: CheckpointInfo) -> dict[str, Any]:
    """``config.json`` of a step in a directory of this host (``{}`` elsewhere), checked against its manifest."""
    from registry.format.manifest import CONFIG, read_manifest
    from registry.fs.filemaps import read_json
    directory = Path(info.path)
    if info.url is not None or not directory.is_absolute() or not directory.is_dir():
        return {}
    try:
        manifest, digest = read_manifest(directory)
        if digest != info.manifest_sha256 or CONFIG not in manifest.files:
            return {}
        return read_json(directory, CONFIG)
    except (RegistryError, OSError):
        return {}


def flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested params as MLflow keeps them: ``{"opt": {"lr": 0.1}}`` is ``opt.lr = "0.1"``; lists as JSON."""
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, prefix=f"{name}."))
        elif isinstance(value, str):
            flat[name] = value
        else:
            flat[name] = json.dumps(value, sort_keys=True, default=str)
    return flat


def aliasable(tag: str) -> bool:
    """Whether MLflow takes registry tag ``tag`` as an alias: letters, digits, ``_`` and ``-``; not
    ``latest`` nor ``v<N>`` (a version's name)."""
    return (_ALIAS_RE.fullmatch(tag) is not None and tag.lower() != "latest"
            and _VERSION_ALIAS_RE.fullmatch(tag) is None)


def mlflow_key(name: str) -> bool:
    """Whether MLflow takes ``name`` as a param, metric or tag key: its characters, and a path that does not
    resolve to another name (``a//b``, ``a/``, ``../a`` are refused)."""
    return (len(name) <= _MAX_KEY and _NAME_RE.fullmatch(name) is not None
            and posixpath.normpath(name) == name and not name.startswith(("/", "..")) and name != ".")


def millis(when: datetime | None) -> int:
    return int(when.timestamp() * 1000) if when is not None else 0


def _chunks(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def _quoted(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


class _Mirror:
    """One mirror of one run: reads the MLflow side once, then writes only the differences."""

    def __init__(self, reg: Registry, run: str, mlflow: MlflowClient, checkpoints: Sequence[CheckpointInfo],
                 points: Sequence[MetricPoint]) -> None:
        self.reg, self.name, self.client = reg, run, mlflow
        self.checkpoints = list(checkpoints)
        self.points = [p for p in points if math.isfinite(p.value) and mlflow_key(p.key)]
        self.refused_keys = sorted({p.key for p in points} - {p.key for p in self.points})
        self.result: MirrorResult

    def run(self, *, experiment: str, model_name: str, copy_payload: bool) -> MirrorResult:
        experiment_id = self._experiment(experiment)
        mlrun = self._mlflow_run(experiment_id)
        self.result = MirrorResult(run=self.name, experiment_id=experiment_id, run_id=mlrun.info.run_id)
        self.result.skipped.extend(f"metric {key}: not a name MLflow takes" for key in self.refused_keys)
        self._params(mlrun)
        self._run_tags(mlrun)
        models = self._models(experiment_id, mlrun.info.run_id, copy_payload=copy_payload)
        self._metrics(mlrun, models)
        self._aliases(model_name, mlrun.info.run_id, models)
        self._finish(mlrun)
        return self.result

    # ------------------------------------------------------------------ the experiment and the run

    def _experiment(self, name: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is None:
            return str(self.client.create_experiment(name))
        if found.lifecycle_stage != "active":
            raise InvalidStateError(f"MLflow experiment {name!r} is deleted: restore it, or mirror into another "
                                    "experiment", run=self.name)
        return str(found.experiment_id)

    def _mlflow_run(self, experiment_id: str) -> Any:
        found = self.client.search_runs([experiment_id], filter_string=f"tags.`{TAG_RUN}` = {_quoted(self.name)}",
                                        max_results=1, order_by=["attributes.start_time ASC"])
        if found:
            return found[0]
        times = [i.created_at for i in self.checkpoints if i.created_at] + \
            [p.logged_at for p in self.points if p.logged_at]
        return self.client.create_run(experiment_id, start_time=millis(min(times)) if times else None,
                                      run_name=self.name, tags={TAG_RUN: self.name})

    def _params(self, mlrun: Any) -> None:
        from mlflow.entities import Param
        have: dict[str, str] = mlrun.data.params
        new = []
        for key, value in sorted(flatten(run_params(self.reg, self.name, self.checkpoints)).items()):
            if not mlflow_key(key):
                self.result.skipped.append(f"param {key}: not a name MLflow takes")
            elif key in have:
                if have[key] != value:  # MLflow never changes a param once logged
                    self.result.skipped.append(f"param {key}: MLflow has {have[key]!r}, the registry {value!r}")
            elif len(value) > _MAX_PARAM_VALUE:
                self.result.skipped.append(f"param {key}: {len(value)} characters, over MLflow's {_MAX_PARAM_VALUE}")
            else:
                new.append(Param(key, value))
        for chunk in _chunks(new, _PARAMS_PER_BATCH):
            self.client.log_batch(mlrun.info.run_id, params=list(chunk))
        self.result.params = len(new)

    def _run_tags(self, mlrun: Any) -> None:
        from mlflow.entities import RunTag
        have: dict[str, str] = mlrun.data.tags
        want = {TAG_ROOT: self.reg.root_url}
        for info in self.checkpoints:
            for tag in info.tags:
                if mlflow_key(RUN_TAG_PREFIX + tag):  # else reported with the aliases
                    want[RUN_TAG_PREFIX + tag] = str(info.step)
        changed = [RunTag(k, v) for k, v in sorted(want.items()) if have.get(k) != v]
        gone = [k for k in have if k.startswith(RUN_TAG_PREFIX) and k not in want]
        for chunk in _chunks(changed, _PARAMS_PER_BATCH):
            self.client.log_batch(mlrun.info.run_id, tags=list(chunk))
        for key in gone:
            self.client.delete_tag(mlrun.info.run_id, key)
        self.result.run_tags = len(changed) + len(gone)

    def _finish(self, mlrun: Any) -> None:
        """A mirrored run is not running in MLflow: the registry, not MLflow, knows whether training goes on."""
        if mlrun.info.status != "FINISHED":
            self.client.update_run(mlrun.info.run_id, status="FINISHED")

    # ------------------------------------------------------------------ checkpoints as LoggedModels

    def _existing_models(self, experiment_id: str) -> dict[int, LoggedModel]:
        found: dict[int, LoggedModel] = {}
        token = None
        while True:
            page = self.client.search_logged_models(
                [experiment_id], filter_string=f"tags.`{TAG_RUN}` = {_quoted(self.name)}", page_token=token)
            for model in page:
                step = model.tags.get(TAG_STEP)
                if step is not None and step.isdigit():
                    found.setdefault(int(step), model)
            token = page.token
            if not token:
                return found

    def _model_tags(self, info: CheckpointInfo) -> dict[str, str]:
        tags = {TAG_RUN: self.name, TAG_REF: f"{self.name}@{info.step}", TAG_STEP: str(info.step),
                TAG_STATUS: str(info.status), TAG_TAGS: ",".join(info.tags), TAG_ROOT: self.reg.root_url}
        if info.manifest_sha256:
            tags[TAG_DIGEST] = info.manifest_sha256
        if info.url:
            tags[TAG_URL] = info.url
        return tags

    def _models(self, experiment_id: str, run_id: str, *, copy_payload: bool) -> dict[int, LoggedModel]:
        models = self._existing_models(experiment_id)
        for info in self.checkpoints:
            model = models.get(info.step)
            want = self._model_tags(info)
            if model is None:
                if info.status != Status.VERIFIED:
                    continue  # only a verified step becomes a model; one mirrored before keeps its own
                models[info.step] = self._create_model(experiment_id, run_id, info, want, copy_payload=copy_payload)
                self.result.models_created += 1
                continue
            changed = {k: v for k, v in want.items() if model.tags.get(k) != v}
            if changed:
                self.client.set_logged_model_tags(model.model_id, changed)
                self.result.models_updated += 1
            if copy_payload and info.status == Status.VERIFIED and model.tags.get(TAG_PAYLOAD) != "copied":
                self._copy_payload(model.model_id, info)
        return models

    def _create_model(self, experiment_id: str, run_id: str, info: CheckpointInfo, tags: dict[str, str], *,
                      copy_payload: bool) -> LoggedModel:
        """As ``mlflow.create_external_model`` makes one, on this client rather than the process's global URI."""
        from mlflow.entities import LoggedModelStatus
        from mlflow.models.model import MLMODEL_FILE_NAME
        from mlflow.models.utils import get_external_mlflow_model_spec
        name = f"{self.name}-step-{info.step}".replace(".", "_")  # MLflow refuses '.' in a model's name
        model = self.client.create_logged_model(experiment_id, name=name, source_run_id=run_id,
                                                tags={**tags, EXTERNAL: "true"}, model_type=MODEL_TYPE)
        # the MLmodel file MLflow writes for an external model: what lets a version be registered from it
        with tempfile.TemporaryDirectory() as spec:
            get_external_mlflow_model_spec(model).save(str(Path(spec, MLMODEL_FILE_NAME)))
            self.client.log_model_artifacts(model.model_id, spec)
        if copy_payload:
            self._copy_payload(model.model_id, info)
        return self.client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)

    def _copy_payload(self, model_id: str, info: CheckpointInfo) -> None:
        with tempfile.TemporaryDirectory() as scratch, \
                self.reg.checkout(f"{self.name}@{info.step}", Path(scratch, "step"), fallback=False) as path:
            self.client.log_model_artifacts(model_id, str(path))
        self.client.set_logged_model_tags(model_id, {TAG_PAYLOAD: "copied", EXTERNAL: "false"})
        self.result.payloads_copied += 1

    # ------------------------------------------------------------------ metrics

    def _metrics(self, mlrun: Any, models: Mapping[int, LoggedModel]) -> None:
        """Every current point at its step on the run, and each model's own step's points on the model.

        A point's timestamp is when the registry recorded it, so a point logged again is an exact duplicate,
        which MLflow drops: that is how a model made after its step's points were mirrored gets them."""
        from mlflow.entities import Metric
        run_id = mlrun.info.run_id
        history: dict[tuple[str, int, float], int] = {}
        for key in sorted({p.key for p in self.points} & set(mlrun.data.metrics)):
            for m in self.client.get_metric_history(run_id, key):
                history.setdefault((key, m.step, m.value), m.timestamp)
        on_model = {model_step: {(m.key, m.value) for m in (model.metrics or []) if m.step == model_step}
                    for model_step, model in models.items()}
        batch, new = [], 0
        for p in self.points:
            at = (p.key, p.step, p.value)
            model = models.get(p.step)
            missing_on_model = model is not None and (p.key, p.value) not in on_model[p.step]
            if at in history and not missing_on_model:
                continue
            new += at not in history
            batch.append(Metric(p.key, p.value, history.get(at, millis(p.logged_at)), p.step,
                                model_id=model.model_id if missing_on_model and model is not None else None))
        for chunk in _chunks(batch, _METRICS_PER_BATCH):
            self.client.log_batch(run_id, metrics=list(chunk))
        self.result.metrics = new

    # ------------------------------------------------------------------ tags as aliases

    def _aliases(self, model_name: str, run_id: str, models: Mapping[int, LoggedModel]) -> None:
        from mlflow.exceptions import MlflowException
        tagged: dict[str, int] = {}
        for info in self.checkpoints:
            for tag in info.tags:
                if not aliasable(tag):
                    self.result.skipped.append(f"tag {tag}: not an MLflow alias (letters, digits, '_', '-'; "
                                               "not 'latest' nor v<N>)")
                elif info.step not in models:
                    self.result.skipped.append(f"tag {tag}: step {info.step} is {info.status}, not a model yet")
                else:
                    tagged[tag] = info.step
        try:
            registered = self.client.get_registered_model(model_name)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            if not tagged:
                return  # no tag, no registered model to make
            registered = self.client.create_registered_model(model_name, tags={TAG_RUN: self.name})
        if registered.tags.get(TAG_RUN) != self.name:
            raise InvalidStateError(f"MLflow registered model {model_name!r} is not the mirror of run "
                                    f"{self.name!r}: name another (model_name=, --model-name)", run=self.name)
        self.result.registered_model = model_name
        versions = self._versions(model_name, run_id, models, needed=set(tagged.values()))
        have: dict[str, str] = dict(registered.aliases or {})
        owned = set(json.loads(registered.tags.get(TAG_ALIASES, "[]")))
        for alias, step in sorted(tagged.items()):
            if have.get(alias) != versions[step]:
                self.client.set_registered_model_alias(model_name, alias, versions[step])
                self.result.aliases_set += 1
        for alias in sorted(owned - set(tagged)):
            if alias in have:
                self.client.delete_registered_model_alias(model_name, alias)
                self.result.aliases_removed += 1
        if owned != set(tagged):
            self.client.set_registered_model_tag(model_name, TAG_ALIASES, json.dumps(sorted(tagged)))

    def _versions(self, model_name: str, run_id: str, models: Mapping[int, LoggedModel], *,
                  needed: set[int]) -> dict[int, str]:
        """The model version of each step's model (a version made from another model of the same step, in
        another experiment, is not it), made for each step in ``needed``; its ``registry.status`` follows
        its step's."""
        status = {i.step: str(i.status) for i in self.checkpoints}
        step_of = {f"models:/{model.model_id}": step for step, model in models.items()}
        versions: dict[int, str] = {}
        for version in self.client.search_model_versions(f"name = {_quoted(model_name)}"):
            step = step_of.get(version.source or "")
            if step is None:
                continue
            versions.setdefault(step, version.version)
            if step in status and version.tags.get(TAG_STATUS) != status[step]:
                self.client.set_model_version_tag(model_name, version.version, TAG_STATUS, status[step])
                self.result.versions_updated += 1
        for step in sorted(needed - set(versions)):
            model = models[step]
            tags = {k: v for k, v in model.tags.items() if k in (TAG_RUN, TAG_REF, TAG_STEP, TAG_DIGEST, TAG_STATUS)}
            made = self.client.create_model_version(model_name, source=f"models:/{model.model_id}", run_id=run_id,
                                                    tags=tags, model_id=model.model_id, await_creation_for=0)
            versions[step] = made.version
            self.result.versions_created += 1
        return versions


__all__ = ["MirrorResult", "aliasable", "client", "flatten", "mirror_event", "mirror_run", "mlflow_key", "run_params"]
