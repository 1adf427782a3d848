"""Tracker ``mlflow``: an MLflow run with the plan as parameters and every metric by step; by
default in a SQLite store under the run directory (MLflow 3 refuses new file stores)."""

from __future__ import annotations

import time

import ftcore
from ftcore import rundir
from ftcore.component import Component, Options
from ftcore.plan import redact
from ftcore.types import OutputPath

from ftcore_plugins.common import mlflow_store
from ftcore_plugins.trackers import _base as _tracking

_BATCH = 100
_STATUS = {"complete": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}


class MLflow(Component):
    """MLflow run (local SQLite store by default): metrics by step, the plan as parameters, status.

    Metrics are ``<stage>/<metric>`` at the trainer's optimizer step (one-off values at step 0),
    each step's final metrics ``<stage>/final/<metric>``; the redacted plan is flattened into
    parameters (``stage.0.learning_rate``); the run ends FINISHED, FAILED or KILLED."""

    name = "mlflow"

    class Options(Options):
        tracking_uri: str | None = None  # default: sqlite:///<dir>/mlflow.db
        dir: OutputPath | None = None  # default: <run dir>/tracking/mlflow (the store and artifacts)
        experiment: str = "ftcore"
        run_name: str | None = None  # default: the plan's [run] name
        tags: dict[str, str] = {}

    def __init__(self, options=None):
        super().__init__(options)
        self._client = None
        self._run_id = ""

    def check(self, plan):
        return mlflow_store.missing(self.options.tracking_uri)

    @ftcore.hookimpl
    def ftcore_run_start(self, run):
        if not run.is_main:
            return
        from mlflow.entities import Param

        o = self.options
        uri, artifacts = mlflow_store.store_for(o.tracking_uri, o.dir or run.run_dir / "tracking" / "mlflow")
        client = mlflow_store.client(uri)
        experiment_id = mlflow_store.experiment(client, o.experiment, artifacts)
        # Tags are redacted as the plan is: the manifest and params never hold a secret, nor may the tags.
        tags = {"ftcore.run_dir": str(run.run_dir), "ftcore.plan_fingerprint": run.plan.fingerprint(),
                **redact(dict(o.tags))}
        self._run_id = client.create_run(experiment_id, run_name=o.run_name or run.plan.run_name,
                                         tags=tags).info.run_id
        params = [Param(mlflow_store.key(k), v[:mlflow_store.MAX_VALUE])
                  for k, v in mlflow_store.flat(run.plan.redacted()).items()]
        for i in range(0, len(params), _BATCH):
            client.log_batch(self._run_id, params=params[i:i + _BATCH])
        self._client = client

    @ftcore.hookimpl
    def ftcore_log(self, run, stage, step, metrics):
        self._log(stage, step or 0, _tracking.numbers(metrics))

    @ftcore.hookimpl
    def ftcore_stage_end(self, run, stage, metrics, seconds):
        if run.is_main:
            self._log(f"{stage}/final", 0, {**_tracking.numbers(metrics), "seconds": seconds})

    @ftcore.hookimpl
    def ftcore_run_end(self, run, error):
        if self._client is None or not run.is_main:
            return
        if error is not None:
            self._client.set_tag(self._run_id, "ftcore.error", _tracking.error_line(error))
        self._client.set_terminated(self._run_id, _STATUS[rundir.run_status(error)])
        self._client = None

    def _log(self, prefix: str, step: int, values: dict[str, float]) -> None:
        if self._client is None or not values:  # run_start failed; that was reported once already
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self._run_id, metrics=[Metric(mlflow_store.key(f"{prefix}/{k}"), v, now, step)
                                                      for k, v in values.items()])


@ftcore.hookimpl
def register_trackers(register):
    register(MLflow)
