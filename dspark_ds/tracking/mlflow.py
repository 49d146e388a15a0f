"""MLflow tracking on rank 0 (a no-op elsewhere). The only module that imports mlflow.

Default store: `sqlite:///<output_dir>/mlflow.db` (every run under one output dir lands in one
store, so `mlflow ui --backend-store-uri sqlite:///runs/mlflow.db` compares them). With a local
store (sqlite or files) an experiment the tracker creates keeps its artifacts under
`<output_dir>/mlartifacts` (MLflow's own default is `./mlruns` of the current directory); a
tracking server decides where its artifacts go. A resumed run continues its MLflow run (the id
is kept in <run>/mlflow_run_id). An unreachable server never stops training: the tracker warns
once and turns itself off.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

RUN_ID_FILE = "mlflow_run_id"


def default_uri(output_dir: str) -> str:
    return f"sqlite:///{Path(output_dir).resolve() / 'mlflow.db'}"


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


class Tracker:
    """Logs params, metrics, artifacts and tags of one run; every call is safe to make on any
    rank and after a failure."""

    def __init__(
        self,
        *,
        enabled: bool,
        uri: str,
        experiment: str,
        run_name: str,
        run_dir: str,
        artifact_location: str,
        timeout_s: float = 10.0,
    ):
        """`artifact_location`: where the experiment keeps its artifacts if this tracker creates
        it in a local store (`default_artifact_location(output_dir)`); ignored for servers."""
        self.enabled = enabled
        self.uri = uri
        self.run_dir = Path(run_dir)
        self.run_id: str | None = None
        self._mlflow = None
        if not enabled:
            return
        try:
            # NOTE: keep an unreachable server from stalling the job for minutes of retries.
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(max(1, timeout_s))))
            import mlflow

            self._mlflow = mlflow
            mlflow.set_tracking_uri(uri)
            self._set_experiment(experiment, artifact_location if is_local_store(uri) else None)
            previous = self._previous_run_id()
            if previous is not None:
                run = mlflow.start_run(run_id=previous)
            else:
                run = mlflow.start_run(run_name=run_name)
            self.run_id = run.info.run_id
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / RUN_ID_FILE).write_text(self.run_id + "\n")
        except Exception as err:  # noqa: BLE001 - tracking must never stop training
            self._disable(f"cannot start an MLflow run at {uri}: {err}")

    def _set_experiment(self, name: str, artifact_location: str | None) -> None:
        mlflow = self._mlflow
        experiment = mlflow.get_experiment_by_name(name)
        if experiment is None and artifact_location is not None:
            try:
                mlflow.create_experiment(name, artifact_location=artifact_location)
            except mlflow.exceptions.MlflowException:
                pass  # another run created it meanwhile
        elif experiment is not None and artifact_location is not None:
            where = experiment.artifact_location
            if not where.startswith(artifact_location.removesuffix("mlartifacts")):
                print(
                    f"[tracking] WARNING: experiment {name!r} keeps its artifacts in {where} "
                    "(set when it was created), outside this run's output directory",
                    file=sys.stderr,
                    flush=True,
                )
        mlflow.set_experiment(name)

    @classmethod
    def for_rank(cls, rank: int, **kwargs) -> Tracker:
        if rank != 0:
            kwargs["enabled"] = False
        return cls(**kwargs)

    def _previous_run_id(self) -> str | None:
        path = self.run_dir / RUN_ID_FILE
        if not path.exists():
            return None
        run_id = path.read_text().strip()
        try:
            self._mlflow.get_run(run_id)
        except Exception:  # noqa: BLE001 - a run from another store: start a new one
            return None
        return run_id

    def _disable(self, why: str) -> None:
        if self.enabled:
            warnings.warn(f"MLflow tracking disabled, training continues: {why}", stacklevel=3)
            from dspark_ds.distributed import log

            log(f"[tracking] WARNING: {why}; training continues without MLflow", file=sys.stderr)
        self.enabled = False

    def _call(self, fn_name: str, *args, **kwargs) -> None:
        if not self.enabled or self._mlflow is None:
            return
        try:
            getattr(self._mlflow, fn_name)(*args, **kwargs)
        except Exception as err:  # noqa: BLE001
            self._disable(f"mlflow.{fn_name} failed: {err}")

    def log_params(self, params: dict) -> None:
        """Params are immutable in MLflow: on resume only the ones not logged yet are sent."""
        if not self.enabled:
            return
        try:
            logged = self._mlflow.get_run(self.run_id).data.params
        except Exception:  # noqa: BLE001
            logged = {}
        todo = {k: _param_value(v) for k, v in params.items() if k not in logged}
        items = list(todo.items())
        for i in range(0, len(items), 100):
            self._call("log_params", dict(items[i : i + 100]))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        clean = {k.replace("@", "_at_"): float(v) for k, v in metrics.items() if v is not None}
        self._call("log_metrics", clean, step=step)

    def set_tags(self, tags: dict[str, object]) -> None:
        self._call("set_tags", {k: str(v) for k, v in tags.items() if v is not None})

    def log_text(self, text: str, artifact_file: str) -> None:
        self._call("log_text", text, artifact_file)

    def log_dict(self, data: dict, artifact_file: str) -> None:
        self._call("log_dict", data, artifact_file)

    def log_artifacts(self, local_dir: str, artifact_path: str | None = None) -> None:
        self._call("log_artifacts", local_dir, artifact_path)

    def finish(self, status: str = "FINISHED") -> None:
        if self.enabled and self._mlflow is not None:
            self._call("end_run", status=status)
        self.enabled = False


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
