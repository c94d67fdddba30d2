"""``logger=mlflow``: the run in MLflow (``pip install 'dtrain[mlflow]'``; ``docs/callbacks-and-loggers.md#loggers``)."""
from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path
from urllib.parse import urlparse

from dtrain.session.logger_requirements import check_writable_directory
from dtrain.loggers.tracking import (FAILED, FINISHED, TrackingLogger, recipe_name,
                                     run_name, sweep_dir)
from dtrain.session.callbacks import RunView

#: how each way a run ends is recorded in MLflow (a preempted run is KILLED until its resume sets it RUNNING)
_STATUS = {FINISHED: "FINISHED", FAILED: "FAILED"}
#: MLflow's limits: parameters and metrics per log_batch call, characters of a parameter's value
_PARAMS_PER_BATCH, _METRICS_PER_BATCH, _PARAM_VALUE_LENGTH = 100, 1000, 6000


class MLflowLogger(TrackingLogger):
    """Logs the run to MLflow: its config as parameters (flattened: ``optimizer.lr``), the records of
    ``metrics.jsonl`` at their global sample count, and its outputs as artifacts; a resumed run continues the
    same MLflow run (its id in ``run_dir/mlflow_run_id``).

    Args:
        tracking_uri: where runs are kept: a server (``http://...``), a database (``sqlite:///...``) or a
            directory (``file:...``); default ``file:<run_dir>/mlruns``, in a sweep ``file:<sweep dir>/mlruns``
            (one store for all its jobs). A file store is allowed for this process (``MLFLOW_ALLOW_FILE_STORE``).
        experiment: the experiment's name (default: the recipe's name), created when missing.
        run_name: the run's name (default: the run directory's name; a sweep job: ``<sweep>/<job>``).
        tags: more tags of the run (a sweep job also gets ``dtrain.sweep``: the sweep's directory).

    Raises:
        ValueError: the mlflow package is not installed.
    """

    package = "mlflow"
    extra = "mlflow"
    id_file = "mlflow_run_id"
    tracker = "MLflow"

    def __init__(self, tracking_uri: str | None = None, experiment: str | None = None, run_name: str | None = None,
                 tags: dict | None = None):
        super().__init__()
        self.tracking_uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        self.tags = {str(key): str(value) for key, value in dict(tags or {}).items()}
        self._client = None

    def uri(self, run: RunView) -> str:
        """The tracking URI this run logs to (the default resolved for its run directory or sweep)."""
        if self.tracking_uri is not None:
            return str(self.tracking_uri)
        sweep = sweep_dir()
        return f"file:{(sweep if sweep is not None else run.run_dir).absolute() / 'mlruns'}"

    def check(self, run: RunView) -> None:
        super().check(run)
        directory = local_directory(self.uri(run))
        if directory is not None:
            check_writable_directory(directory, "MLflowLogger tracking_uri")

    def _start(self, run: RunView, resume_id: str | None) -> str:
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        uri = self.uri(run)
        if urlparse(uri).scheme in ("", "file"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses a file store unless allowed
        self._client = client = MlflowClient(uri)
        params = flatten(run.config or {})
        existing = _find_run(client, resume_id) if resume_id is not None else None
        if resume_id is not None and existing is None:
            warnings.warn(f"MLflow run {resume_id} (run_dir/{self.id_file}) is not in {uri}; this resumed run "
                          f"starts a new MLflow run", RuntimeWarning, stacklevel=2)
        if existing is not None:
            client.update_run(existing.info.run_id, status="RUNNING")
            run_id, logged = existing.info.run_id, existing.data.params
            # MLflow parameters cannot change: a setting changed for the resume is kept as a tag
            for key, value in params.items():
                if key in logged and logged[key] != value:
                    client.set_tag(run_id, f"changed.{key}", value)
            params = {key: value for key, value in params.items() if key not in logged}
        else:
            tags = dict(self.tags)
            sweep = sweep_dir()
            if sweep is not None:
                tags.setdefault("dtrain.sweep", str(sweep))
            run_id = client.create_run(_experiment_id(client, self.experiment or recipe_name(run)),
                                       run_name=self.run_name or run_name(run), tags=tags).info.run_id
        items = [Param(key, value) for key, value in params.items()]
        for start in range(0, len(items), _PARAMS_PER_BATCH):
            client.log_batch(run_id, params=items[start:start + _PARAMS_PER_BATCH])
        job = {"dtrain.run_dir": str(run.run_dir.absolute()), "dtrain.world_size": str(run.world_size)}
        client.log_batch(run_id, tags=[RunTag(key, value) for key, value in job.items()])
        run.line(f"dtrain: MLflow run {run_id} {'continued' if existing is not None else 'started'} in {uri}")
        return run_id

    def _log(self, values: dict[str, float], step: int, timestamp: float) -> None:
        from mlflow.entities import Metric

        milliseconds = int(timestamp * 1000)
        metrics = [Metric(key, value, milliseconds, step) for key, value in values.items()]
        for start in range(0, len(metrics), _METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=metrics[start:start + _METRICS_PER_BATCH])

    def _log_files(self, paths: list[Path]) -> None:
        for path in paths:
            self._client.log_artifact(self.run_id, str(path))

    def _end(self, status: str) -> None:
        self._client.set_terminated(self.run_id, _STATUS.get(status, "KILLED"))


#: what MLflow refuses in a parameter's name (it allows letters, digits, ``_ - . : /`` and spaces)
_NOT_IN_A_KEY = re.compile(r"[^A-Za-z0-9_\-. :/]")


def flatten(config: dict, prefix: str = "") -> dict[str, str]:
    """A nested config as MLflow parameters: ``{"optimizer.lr": "0.05"}``; a list is one JSON value, a character
    MLflow refuses in a name becomes ``_``, a value longer than MLflow allows ends in ``...`` (``config.yaml`` in
    the run directory holds it whole)."""
    params: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{_NOT_IN_A_KEY.sub('_', str(key))}"
        if isinstance(value, dict) and value:
            params.update(flatten(value, f"{name}."))
            continue
        text = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
        params[name] = text if len(text) <= _PARAM_VALUE_LENGTH else text[:_PARAM_VALUE_LENGTH - 3] + "..."
    return params


def local_directory(uri: str) -> Path | None:
    """The local directory a tracking URI writes to (a file store's, a SQLite database's), ``None`` for a server."""
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        return Path(parsed.path if parsed.scheme else uri)
    if parsed.scheme == "sqlite":
        database = uri.split("://", 1)[1].lstrip("/") if "://" in uri else ""
        return Path("/" + database).parent if uri.startswith("sqlite:////") else Path(database).parent
    return None


def _experiment_id(client, name: str) -> str:
    """The id of the experiment called ``name``, created if missing (a sweep's jobs may race to create it)."""
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    try:
        return client.create_experiment(name)
    except MlflowException:
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return experiment.experiment_id


def _find_run(client, run_id: str):
    """The run ``run_id`` in this store, ``None`` when it is not there (the id of another tracking URI)."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(run_id)
    except MlflowException:
        return None
