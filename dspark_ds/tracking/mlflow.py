"""MLflow tracking on rank 0 (a no-op elsewhere). `tracking/` is the only package that imports
mlflow.

Default store: `$MLFLOW_TRACKING_URI`, else `sqlite:///<output_dir>/mlflow.db` (every run under
one output dir lands in one store, so `mlflow ui --backend-store-uri sqlite:///runs/mlflow.db`
compares them). With a local store (sqlite or files) an experiment the tracker creates keeps its
artifacts under `<output_dir>/mlartifacts` (MLflow's own default is `./mlruns` of the current
directory); a tracking server decides where its artifacts go.

Every run says what it is (`kind`: train / eval / tune / demo / bench) and carries the tags runs
are grouped by (`RUN_TAGS`); a nested run names its parent (`mlflow.parentRunId`): the demo's
stages under the demo's run, an evaluation under the training run of the drafter it evaluates
(the export's `mlflow_run.json` names it), the tuner's options under the sweep.

Logging is off the caller's thread and survives the server (tracking/sender.py): the tracker
queues each call and returns; a server that is slow or down delays delivery, never the step, and
never turns tracking off. The run's end waits `flush_timeout_s` for the queue, then writes what
was not delivered to `<run_dir>/mlflow_undelivered.json` and says how to send it
(`dspark-ds sync-tracking --run_dir <run_dir>`).

The environment (docs/tracking.md): `MLFLOW_TRACKING_URI` and `MLFLOW_EXPERIMENT_NAME` are the
defaults of `tracking.uri` / `tracking.experiment`. `MLFLOW_RUN_ID` names a run that a top-level
run logs into (what `mlflow run` and orchestrators set), only when that run exists, is RUNNING,
and is not another run than the one this run directory already continues; otherwise the job
stops with one line naming it. A nested run never reads it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

from dspark_ds.errors import ConfigError
from dspark_ds.tracking.sender import (
    UNDELIVERED_FILE,
    Op,
    Sender,
    summarize,
    write_undelivered,
)

RUN_ID_FILE = "mlflow_run_id"
EXPORT_RECORD = "mlflow_run.json"
"""In an export directory: the MLflow run that trained it ({"run_id", "tracking_uri", ...})."""
KIND_TAG = "kind"
KINDS = ("train", "eval", "tune", "demo", "bench")
PARENT_TAG = "mlflow.parentRunId"
LAUNCH_TAG = "dspark.launch_id"
"""A random id per tracker: finds the run a create_run made whose answer was lost."""
RUN_TAGS = (
    "kind",
    "drafter_kind",
    "target",
    "recipe",
    "zero",
    "seed",
    "world_size",
    "slurm_job_id",
)
"""The tags a user groups runs by (each run sets those that apply to it)."""
DEFAULT_EXPERIMENT = "dspark-ds"
MODEL_TYPE = "dspark-ds-drafter"


def default_uri(output_dir: str) -> str:
    return f"sqlite:///{Path(output_dir).resolve() / 'mlflow.db'}"


def resolve_uri(uri: str | None, output_dir: str) -> str:
    """`tracking.uri`, else `$MLFLOW_TRACKING_URI`, else the output directory's sqlite store."""
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or default_uri(output_dir)


def resolve_experiment(experiment: str | None) -> str:
    """`tracking.experiment`, else `$MLFLOW_EXPERIMENT_NAME`, else "dspark-ds"."""
    return experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT


def default_artifact_location(output_dir: str) -> str:
    """Where a new experiment in a local store keeps its artifacts: under the output directory."""
    return (Path(output_dir).resolve() / "mlartifacts").as_uri()


def is_local_store(uri: str) -> bool:
    """sqlite / file stores (and plain paths): MLflow itself decides their artifact location."""
    scheme = uri.split(":", 1)[0] if "://" in uri or uri.startswith("sqlite:") else ""
    return scheme in ("", "file", "sqlite")


def git_sha() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def _param_value(value) -> str:
    text = str(value)
    return text if len(text) <= 6000 else text[:5997] + "..."


def _now_ms() -> int:
    return int(time.time() * 1000)


_SAID: set[str] = set()


def _warn(line: str, once: bool = False) -> None:
    """A line on stderr with the time and rank; `once`: once per process."""
    from dspark_ds.distributed import log

    if once and line in _SAID:
        return
    _SAID.add(line)
    log(line, file=sys.stderr)


def write_export_record(export_dir: str | Path, run_id: str, tracking_uri: str | None) -> None:
    """Names the training run in an export directory (`dspark-ds export` of its checkpoint:
    the store is not known there, None)."""
    record = {"run_id": run_id, "experiment_id": None, "tracking_uri": tracking_uri}
    (Path(export_dir) / EXPORT_RECORD).write_text(json.dumps(record, indent=1) + "\n")


def run_exists(uri: str, run_id: str) -> bool:
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    try:
        MlflowClient(tracking_uri=uri).get_run(run_id)
        return True
    except MlflowException:
        return False


def read_export_record(export_dir: str | Path) -> dict | None:
    """The MLflow run an export directory names (`EXPORT_RECORD`), or None."""
    path = Path(export_dir) / EXPORT_RECORD
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("run_id") else None


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
                _warn(f"[tracking] WARNING: {err}; logging into a new run instead")
        if run is None and resume_run_id:
            run = self._get(resume_run_id)  # None: a run of another store, start a new one
        if run is None:
            run = self._created_by(launch_id)
        if run is None:
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
                _warn(
                    f"[tracking] WARNING: experiment {name!r} keeps its artifacts in {where} "
                    "(set when it was created), outside this run's output directory",
                    once=True,
                )
        return experiment.experiment_id

    def _get(self, run_id: str):
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
        _warn(
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
    from mlflow.entities import RunTag

    return [RunTag(k, str(v)) for k, v in tags.items() if v is not None]


def _clean_metrics(metrics: dict) -> dict[str, float]:
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
            args = {"metrics": _clean_metrics(metrics), "step": row["step"], "timestamp_ms": stamp}
            ops.append(Op("metrics", args, in_log=True))
    return ops


class Tracker:
    """One MLflow run: params, metrics, tags, artifacts, inputs, the model. Every call is safe
    on any rank, returns at once, and never raises for the server's sake."""

    def __init__(
        self,
        *,
        enabled: bool,
        uri: str,
        experiment: str | None,
        run_name: str,
        run_dir: str,
        artifact_location: str,
        timeout_s: float = 10.0,
        kind: str | None = None,
        tags: dict | None = None,
        parent_run_id: str | None = None,
        resume: bool = True,
        replay_log: str | Path | None = None,
        flush_timeout_s: float = 60.0,
        max_queued_values: int = 200_000,
    ):
        """`artifact_location`: where the experiment keeps its artifacts if this tracker creates
        it in a local store (`default_artifact_location(output_dir)`); ignored for servers.
        `kind`: what the run is (`KINDS`). `parent_run_id`: nest the run under that one (and
        never read MLFLOW_RUN_ID). `resume`: continue the run named in <run_dir>/mlflow_run_id.
        `replay_log`: the run's train_log.jsonl, where metrics evicted from a full queue are
        read back from. `flush_timeout_s`: how long `finish` waits for the queue."""
        self.enabled = enabled
        self.uri = uri
        self.run_dir = Path(run_dir)
        self.flush_timeout_s = flush_timeout_s
        self.undelivered: list[Op] = []
        self._sender: Sender | None = None
        self._delivery: Delivery | None = None
        if kind is not None and kind not in KINDS:
            raise ValueError(f"tracker kind {kind!r} is not one of {KINDS}")
        if not enabled:
            return
        # NOTE: one try per request: the sender retries, and a request never waits longer
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(max(1, timeout_s))))
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        self._delivery = delivery = Delivery(
            uri, timeout_s, Path(replay_log) if replay_log else None
        )
        delivery.records.append(self.run_dir / RUN_ID_FILE)
        all_tags = {**(tags or {}), KIND_TAG: kind, PARENT_TAG: parent_run_id}
        if os.environ.get("MLFLOW_EXPERIMENT_ID") and not experiment:
            _warn(
                "[tracking] MLFLOW_EXPERIMENT_ID is not read: set MLFLOW_EXPERIMENT_NAME or "
                "--tracking.experiment"
            )
        start = Op(
            "start",
            {
                "experiment": resolve_experiment(experiment),
                "artifact_location": artifact_location if is_local_store(uri) else None,
                "run_name": run_name,
                "tags": {k: str(v) for k, v in all_tags.items() if v is not None},
                "resume_run_id": self._previous_run_id() if resume else None,
                "env_run_id": None if parent_run_id else os.environ.get("MLFLOW_RUN_ID"),
                "launch_id": uuid.uuid4().hex,
            },
        )
        self._sender = Sender(delivery, max_queued_values=max_queued_values, log=_warn)
        left_over = self._left_over() if resume else []
        try:
            delivery.apply([start])  # at once: the run id, and a refused MLFLOW_RUN_ID (exit 2)
        except ConfigError:
            raise
        except Exception as err:  # noqa: BLE001 - tracking must never stop training
            _warn(
                f"[tracking] WARNING: cannot start an MLflow run at {uri} ({_short(err)}); "
                "training goes on, and the run is made (and sent what was logged) when the "
                "server answers"
            )
            start.args["strict"] = False
            self._sender.put(start)
            self._sender.failing_since = time.monotonic()
        for op in left_over:
            self._sender.put(op)
        self._sender.start()

    @classmethod
    def for_rank(cls, rank: int, **kwargs) -> Tracker:
        if rank != 0:
            kwargs["enabled"] = False
        return cls(**kwargs)

    @property
    def run_id(self) -> str | None:
        return self._delivery.run_id if self._delivery is not None else None

    @property
    def experiment_id(self) -> str | None:
        return self._delivery.experiment_id if self._delivery is not None else None

    @property
    def model_id(self) -> str | None:
        return self._delivery.model_id if self._delivery is not None else None

    def _left_over(self) -> list[Op]:
        """What the previous job of this run directory could not deliver (its end and start
        excepted): sent before anything new; its file is removed once read."""
        from dspark_ds.tracking.sender import read_undelivered

        path = self.run_dir / UNDELIVERED_FILE
        if not path.is_file():
            return []
        try:
            header, ops = read_undelivered(path)
        except (OSError, ValueError, KeyError):
            return []
        if header.get("tracking_uri") != self.uri:
            return []  # another store: `dspark-ds sync-tracking` sends them there
        path.unlink()
        kept = [op for op in ops if op.kind not in ("start", "end")]
        if kept:
            _warn(f"[tracking] sending what the previous job left undelivered: {summarize(kept)}")
        return kept

    def _previous_run_id(self) -> str | None:
        path = self.run_dir / RUN_ID_FILE
        return path.read_text().strip() or None if path.is_file() else None

    def _put(self, op: Op) -> None:
        if self.enabled and self._sender is not None:
            self._sender.put(op)

    # ---- what callers log ----------------------------------------------------------------------
    def log_params(self, params: dict) -> None:
        self._put(Op("params", {"params": {k: _param_value(v) for k, v in params.items()}}))

    def log_metrics(
        self,
        metrics: dict[str, float],
        step: int,
        *,
        timestamp: float | None = None,
        in_log: bool = False,
        model_of_run: str | None = None,
        run_id: str | None = None,
    ) -> None:
        """`timestamp`: when they were measured (seconds; now by default); `in_log`: they are a
        row of the `replay_log`; `model_of_run`: attach them to the model that run logged;
        `run_id`: log them to another run (an evaluation's headline figures into the training
        run)."""
        stamp = round((time.time() if timestamp is None else timestamp) * 1000)
        args = {"metrics": _clean_metrics(metrics), "step": int(step), "timestamp_ms": stamp}
        if model_of_run:
            args["model_of_run"] = model_of_run
        if run_id:
            args["run_id"] = run_id
        self._put(Op("metrics", args, in_log=in_log))

    def set_tags(self, tags: dict[str, object], run_id: str | None = None) -> None:
        """`run_id`: tag another run (a training run gets its evaluations' ids)."""
        clean = {k: str(v) for k, v in tags.items() if v is not None}
        self._put(Op("tags", {"tags": clean, **({"run_id": run_id} if run_id else {})}))

    def log_text(self, text: str, artifact_file: str) -> None:
        self._put(Op("text", {"text": text, "artifact_file": artifact_file}))

    def log_dict(self, data: dict, artifact_file: str) -> None:
        data = json.loads(json.dumps(data, default=str))
        self._put(Op("dict", {"data": data, "artifact_file": artifact_file}))

    def log_artifacts(self, local_dir: str, artifact_path: str | None = None) -> None:
        self._put(Op("artifacts", {"local_dir": str(local_dir), "artifact_path": artifact_path}))

    def log_dataset(
        self,
        *,
        name: str,
        digest: str,
        source: str,
        context: str,
        source_type: str = "local",
        profile: dict | None = None,
    ) -> None:
        """An input of the run: `digest` tells regenerations of the same `source` apart."""
        args = {
            "name": name,
            "digest": digest,
            "source": source,
            "source_type": source_type,
            "context": context,
            "profile": json.dumps(profile) if profile else None,
        }
        self._put(Op("dataset", args))

    def log_model(
        self,
        local_dir: str | Path,
        *,
        name: str,
        step: int,
        register_as: str | None = None,
        params: dict | None = None,
    ) -> None:
        """The directory as an MLflow model of this run (and a version of `register_as`)."""
        args = {
            "local_dir": str(local_dir),
            "name": name,
            "register_as": register_as,
            "step": step,
            "params": {k: _param_value(v) for k, v in (params or {}).items()},
        }
        self._put(Op("model", args))

    def record_run(self, path: str | Path) -> None:
        """Writes this run's id to `path` (now, or once the run exists): an export's
        `EXPORT_RECORD`."""
        if self._delivery is None:
            return
        path = Path(path)
        self._delivery.records.append(path)
        if self.run_id is not None:
            self._delivery.write_record(path)

    # ---- the end -------------------------------------------------------------------------------
    def flush(self, timeout_s: float | None = None) -> bool:
        """Waits until what was logged is delivered (True) or the time is up (False)."""
        if self._sender is None:
            return True
        return self._sender.drain(self.flush_timeout_s if timeout_s is None else timeout_s)

    def finish(self, status: str = "FINISHED", flush_timeout_s: float | None = None) -> list[Op]:
        """Ends the run: waits up to `flush_timeout_s` (default: the tracker's) for the queue;
        what is still undelivered is written to <run_dir>/mlflow_undelivered.json, with a line
        saying how to send it (a resumed run sends it first). Returns the undelivered ops
        (empty when all arrived). Only the first call counts."""
        if not self.enabled or self._sender is None:
            self.enabled = False
            return []
        self.enabled = False
        sender = self._sender
        sender.put(Op("end", {"status": status, "end_time_ms": _now_ms()}))
        wait_s = self.flush_timeout_s if flush_timeout_s is None else flush_timeout_s
        if not sender.drain(wait_s):
            self.undelivered = sender.stop(self._delivery.timeout_s + 1)
        else:
            sender.stop(1.0)
        for what in sender.dropped:
            _warn(f"[tracking] WARNING: not delivered and not kept: {what}")
        if self.undelivered:
            self._save_undelivered(sender)
        return self.undelivered

    def _save_undelivered(self, sender: Sender) -> None:
        d = self._delivery
        path = self.run_dir / UNDELIVERED_FILE
        header = {
            "tracking_uri": d.uri,
            "run_id": d.run_id,
            "experiment_id": d.experiment_id,
            "replay_log": str(d.replay_log) if d.replay_log else None,
            "records": [str(p) for p in d.records],
            "written": time.time(),
        }
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_undelivered(path, header, self.undelivered)
        why = sender.last_error or "no answer"
        _warn(
            f"[tracking] WARNING: {summarize(self.undelivered)} did not reach {d.uri} in "
            f"time ({why}); kept in {path}: `dspark-ds sync-tracking "
            f"--run_dir {self.run_dir}` sends them when the server is back"
        )


def _short(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text[:200] + "..." if len(text) > 200 else text


def read_run(uri: str, run_id: str):
    """The MLflow run (params, metrics, tags) — for tools and tests."""
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri).get_run(run_id)


def metric_history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    hist = MlflowClient(tracking_uri=uri).get_metric_history(run_id, key)
    return [(m.step, m.value) for m in sorted(hist, key=lambda m: (m.step, m.timestamp))]


def list_artifacts(uri: str, run_id: str) -> list[str]:
    from mlflow.tracking import MlflowClient

    return [a.path for a in MlflowClient(tracking_uri=uri).list_artifacts(run_id)]


def child_runs(uri: str, parent_run_id: str) -> list:
    """The runs nested under `parent_run_id` (oldest first)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    parent = client.get_run(parent_run_id)
    return client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.`{PARENT_TAG}` = '{parent_run_id}'",
        order_by=["attributes.start_time ASC"],
    )
