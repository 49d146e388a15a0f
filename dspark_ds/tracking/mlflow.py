"""MLflow tracking on rank 0 (a no-op elsewhere): `Tracker`, one run's params, metrics, tags,
artifacts, inputs and model. `tracking/` is the only package that imports mlflow (where runs
live and what names them: tracking/store.py; what each call does in the store:
tracking/delivery.py).

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
import time
import uuid
from pathlib import Path

from dspark_ds.errors import ConfigError
from dspark_ds.tracking.delivery import Delivery, clean_metrics, warn
from dspark_ds.tracking.sender import (
    UNDELIVERED_FILE,
    Op,
    Sender,
    read_undelivered,
    summarize,
    write_undelivered,
)
from dspark_ds.tracking.store import (
    KIND_TAG,
    KINDS,
    PARENT_TAG,
    RUN_ID_FILE,
    is_local_store,
    resolve_experiment,
)


def _param_value(value) -> str:
    text = str(value)
    return text if len(text) <= 6000 else text[:5997] + "..."


def _now_ms() -> int:
    return int(time.time() * 1000)


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
            warn(
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
        self._sender = Sender(delivery, max_queued_values=max_queued_values, log=warn)
        left_over = self._left_over() if resume else []
        try:
            delivery.apply([start])  # at once: the run id, and a refused MLFLOW_RUN_ID (exit 2)
        except ConfigError:
            raise
        except Exception as err:  # noqa: BLE001 - tracking must never stop training
            warn(
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
            warn(f"[tracking] sending what the previous job left undelivered: {summarize(kept)}")
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
        args = {"metrics": clean_metrics(metrics), "step": int(step), "timestamp_ms": stamp}
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
            warn(f"[tracking] WARNING: not delivered and not kept: {what}")
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
        warn(
            f"[tracking] WARNING: {summarize(self.undelivered)} did not reach {d.uri} in "
            f"time ({why}); kept in {path}: `dspark-ds sync-tracking "
            f"--run_dir {self.run_dir}` sends them when the server is back"
        )


def _short(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text[:200] + "..." if len(text) > 200 else text
