"""What each queued call (an `Op`, tracking/sender.py) does against one MLflow store, for one
run: `Delivery`. The tracker's sender applies the ops of a live run; `dspark-ds sync-tracking`
applies the same ops again, from the file a run's end writes when some could not be sent.

A call that is retried leaves one result in the store: the run an earlier `create_run` made (its
answer lost) is found by its launch id, params already logged are not sent again, and each part
of the model is made once.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from dspark_ds.errors import ConfigError
from dspark_ds.tracking.sender import Op
from dspark_ds.tracking.store import LAUNCH_TAG, MODEL_TYPE, RUN_ID_FILE

_SAID: set[str] = set()


def warn(line: str, once: bool = False) -> None:
    """A line on stderr with the time and rank; `once`: once per process."""
    # lazy: torch, 1.5 s; tracking.mlflow imports in 0.06 s without it
    from dspark_ds.distributed import log

    if once and line in _SAID:
        return
    _SAID.add(line)
    log(line, file=sys.stderr)


class Delivery:
    """What each `Op` does against one MLflow store, for one run (its id once started)."""

    def __init__(self, uri: str, timeout_s: float, replay_log: Path | None = None):
        self.uri, self.timeout_s, self.replay_log = uri, timeout_s, replay_log
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self.model_id: str | None = None
        self.model_version: str | None = None
        self.records: list[Path] = []
        """Files that get the run's id once it exists (<run_dir>/mlflow_run_id, an export's
        record)."""
        self._logged_params: dict[str, str] | None = None
        self._models_of_runs: dict[str, str | None] = {}
        self._model_progress: dict = {}
        self._client = None

    @property
    def client(self):
        if self._client is None:
            # lazy: mlflow, 1.4 s of import
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(tracking_uri=self.uri)
        return self._client

    def apply(self, ops: list[Op]) -> None:
        if ops[0].kind == "metrics":
            self.metrics_batch(ops)
            return
        for op in ops:
            getattr(self, op.kind)(**op.args)

    # ---- the run -------------------------------------------------------------------------------
    def start(
        self,
        *,
        experiment,
        artifact_location,
        run_name,
        tags,
        resume_run_id,
        env_run_id,
        launch_id,
        strict=True,
    ) -> None:
        """Creates the run (or continues `resume_run_id` / adopts `env_run_id`); `strict`: a
        refused MLFLOW_RUN_ID raises ConfigError, else it is warned about and a new run made."""
        self.experiment_id = self._experiment(experiment, artifact_location)
        client = self.client
        run = None
        if env_run_id:
            try:
                run = self._adoptable(env_run_id, resume_run_id)
            except ConfigError as err:
                if strict:
                    raise
                warn(f"[tracking] WARNING: {err}; logging into a new run instead")
        if run is None and resume_run_id:
            run = self._get(resume_run_id)  # None: a run of another store, start a new one
        if run is None:
            run = self._created_by(launch_id)
        if run is None:
            # lazy: mlflow, 1.4 s of import
            from mlflow.tracking.context.registry import resolve_tags

            all_tags = resolve_tags({**tags, LAUNCH_TAG: launch_id})
            run = client.create_run(self.experiment_id, tags=all_tags, run_name=run_name)
        else:
            if run.info.status != "RUNNING":
                client.update_run(run.info.run_id, status="RUNNING")
            client.log_batch(run.info.run_id, tags=_tags(tags))
        self.run_id = run.info.run_id
        self.experiment_id = run.info.experiment_id
        self._write_records()

    def _experiment(self, name: str, artifact_location: str | None) -> str:
        client = self.client
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            # lazy: mlflow, 1.4 s of import
            from mlflow.exceptions import MlflowException

            try:
                # NOTE: the experimentKind tag opens the UI on its training runs, not GenAI's view
                return client.create_experiment(
                    name,
                    artifact_location=artifact_location,
                    tags={"mlflow.experimentKind": "custom_model_development"},
                )
            except MlflowException:
                experiment = client.get_experiment_by_name(name)  # another run created it
                if experiment is None:
                    raise
        elif artifact_location is not None:
            where = experiment.artifact_location
            if not where.startswith(artifact_location.removesuffix("mlartifacts")):
                warn(
                    f"[tracking] WARNING: experiment {name!r} keeps its artifacts in {where} "
                    "(set when it was created), outside this run's output directory",
                    once=True,
                )
        return experiment.experiment_id

    def _get(self, run_id: str):
        # lazy: mlflow, 1.4 s of import
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_run(run_id)
        except MlflowException as err:
            if err.get_http_status_code() == 404 or "not found" in str(err).lower():
                return None
            raise

    def _adoptable(self, env_run_id: str, resume_run_id: str | None):
        """The run MLFLOW_RUN_ID names, when this job may log into it (else ConfigError)."""
        if resume_run_id and resume_run_id != env_run_id:
            raise ConfigError(
                f"MLFLOW_RUN_ID: {env_run_id} is not the run this run directory continues "
                f"({resume_run_id}); unset MLFLOW_RUN_ID to continue it, or use another "
                "--output_dir / --name"
            )
        run = self._get(env_run_id)
        if run is None:
            raise ConfigError(
                f"MLFLOW_RUN_ID: run {env_run_id} does not exist at {self.uri}; unset it (a new "
                "run is made) or set --tracking.uri to its store"
            )
        if run.info.status != "RUNNING":
            raise ConfigError(
                f"MLFLOW_RUN_ID: run {env_run_id} is {run.info.status}; a finished run is never "
                "resumed through the environment: unset MLFLOW_RUN_ID (a resumed training "
                "continues its own run, named in <run_dir>/mlflow_run_id)"
            )
        warn(
            f"[tracking] MLFLOW_RUN_ID={env_run_id}: logging into that run (experiment "
            f"{run.info.experiment_id}, started {time.ctime(run.info.start_time / 1000)})"
        )
        return run

    def _created_by(self, launch_id: str):
        """The run an earlier try of this create made (its answer lost), or None."""
        if not self._tried_create:
            self._tried_create = True
            return None
        found = self.client.search_runs(
            [self.experiment_id], filter_string=f"tags.`{LAUNCH_TAG}` = '{launch_id}'"
        )
        return found[0] if found else None

    _tried_create = False

    def _write_records(self) -> None:
        for path in self.records:
            self.write_record(path)

    def write_record(self, path: Path) -> None:
        if self.run_id is None:
            return
        if path.name == RUN_ID_FILE:
            text = self.run_id + "\n"
        else:
            ids = {
                "run_id": self.run_id,
                "experiment_id": self.experiment_id,
                "tracking_uri": self.uri,
            }
            text = json.dumps(ids, indent=1) + "\n"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)

    def end(self, *, status: str, end_time_ms: int) -> None:
        self.client.set_terminated(self.run_id, status=status, end_time=end_time_ms)

    # ---- data ----------------------------------------------------------------------------------
    def params(self, *, params: dict) -> None:
        """Params are immutable in MLflow: on resume only the ones not logged yet are sent."""
        # lazy: mlflow, 1.4 s of import
        from mlflow.entities import Param

        if self._logged_params is None:
            self._logged_params = dict(self.client.get_run(self.run_id).data.params)
        todo = [(k, v) for k, v in params.items() if k not in self._logged_params]
        for i in range(0, len(todo), 100):
            chunk = todo[i : i + 100]
            self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in chunk])
            self._logged_params.update(chunk)

    def tags(self, *, tags: dict, run_id: str | None = None) -> None:
        self.client.log_batch(run_id or self.run_id, tags=_tags(tags))

    def metrics_batch(self, ops: list[Op]) -> None:
        # lazy: mlflow, 1.4 s of import
        from mlflow.entities import Metric

        metrics = []
        for op in ops:
            a = op.args
            model_id = self._model_of(a["model_of_run"]) if a.get("model_of_run") else None
            for key, value in a["metrics"].items():
                metrics.append(Metric(key, value, a["timestamp_ms"], a["step"], model_id=model_id))
        self.client.log_batch(ops[0].args.get("run_id") or self.run_id, metrics=metrics)

    def metrics(self, **args) -> None:
        self.metrics_batch([Op("metrics", args)])

    def replay(self, *, log: str, first: int, last: int) -> None:
        """The metrics of the log rows of steps first..last, as they were logged."""
        ops = [op for op in rows_as_ops(Path(log)) if first <= op.args["step"] <= last]
        batch, values = [], 0
        for op in ops:
            if batch and values + op.values > 1000:
                self.metrics_batch(batch)
                batch, values = [], 0
            batch.append(op)
            values += op.values
        if batch:
            self.metrics_batch(batch)

    def text(self, *, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def dict(self, *, data: dict, artifact_file: str) -> None:
        self.client.log_dict(self.run_id, data, artifact_file)

    def artifacts(self, *, local_dir: str, artifact_path: str | None) -> None:
        self.client.log_artifacts(self.run_id, local_dir, artifact_path)

    def dataset(self, *, name, digest, source, source_type, context, profile=None) -> None:
        # lazy: mlflow, 1.4 s of import
        from mlflow.entities import Dataset, DatasetInput, InputTag

        ds = Dataset(
            name=name, digest=digest, source_type=source_type, source=source, profile=profile
        )
        tags = [InputTag("mlflow.data.context", context)]
        self.client.log_inputs(self.run_id, [DatasetInput(ds, tags)])

    def model(
        self, *, local_dir: str, name: str, register_as: str | None, params: dict, step: int
    ) -> None:
        """The export as an MLflow model of the run (its files, no flavour), and a version of
        `register_as` when set. Each part is done once across retries."""
        # lazy: mlflow, 1.4 s of import
        from mlflow.entities import LoggedModelOutput

        client, done = self.client, self._model_progress
        if "model_id" not in done:
            found = client.search_logged_models(
                [self.experiment_id], filter_string=f"source_run_id = '{self.run_id}'"
            )
            mine = [m for m in found if m.name == name]
            if mine:
                model = mine[0]
            else:
                model = client.create_logged_model(
                    self.experiment_id,
                    name=name,
                    source_run_id=self.run_id,
                    params=params,
                    model_type=MODEL_TYPE,
                )
            done["model_id"] = model.model_id
        model_id = done["model_id"]
        if "files" not in done:
            client.log_model_artifacts(model_id, local_dir)
            client.finalize_logged_model(model_id, "READY")
            client.log_outputs(self.run_id, [LoggedModelOutput(model_id, step)])
            done["files"] = True
        tags = {"model_id": model_id}
        if register_as and "version" not in done:
            self._register(register_as, model_id)
            done["version"] = self.model_version
        if register_as:
            tags["registered_model"] = f"{register_as} v{done['version']}"
        client.log_batch(self.run_id, tags=_tags(tags))
        self.model_id = model_id

    def _register(self, name: str, model_id: str) -> None:
        # lazy: mlflow, 1.4 s of import
        from mlflow.exceptions import MlflowException

        client = self.client
        try:
            client.create_registered_model(name)
        except MlflowException as err:
            if "already exists" not in str(err).lower():
                raise
        version = client.create_model_version(
            name, source=f"models:/{model_id}", run_id=self.run_id, model_id=model_id
        )
        self.model_version = str(version.version)

    def _model_of(self, run_id: str) -> str | None:
        """The MLflow model a training run logged (its export), or None (no such run here)."""
        if run_id not in self._models_of_runs:
            run = self._get(run_id)
            if run is None:
                self._models_of_runs[run_id] = None
                return None
            experiment = run.info.experiment_id
            found = self.client.search_logged_models(
                [experiment], filter_string=f"source_run_id = '{run_id}'"
            )
            self._models_of_runs[run_id] = found[0].model_id if found else None
        return self._models_of_runs[run_id]


def _tags(tags: dict):
    # lazy: mlflow, 1.4 s of import
    from mlflow.entities import RunTag

    return [RunTag(k, str(v)) for k, v in tags.items() if v is not None]


def clean_metrics(metrics: dict) -> dict[str, float]:
    return {k.replace("@", "_at_"): float(v) for k, v in metrics.items() if v is not None}


def rows_as_ops(log: Path) -> list[Op]:
    """train_log.jsonl's rows as the metric ops training sent: every "section/name" number of a
    row, at its step, stamped with the row's time."""
    ops = []
    if not log.is_file():
        return ops
    for line in log.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            continue
        metrics = {
            k: v
            for k, v in row.items()
            if "/" in k and isinstance(v, int | float) and not isinstance(v, bool)
        }
        if metrics:
            stamp = round(float(row.get("time", time.time())) * 1000)
            args = {"metrics": clean_metrics(metrics), "step": row["step"], "timestamp_ms": stamp}
            ops.append(Op("metrics", args, in_log=True))
    return ops
